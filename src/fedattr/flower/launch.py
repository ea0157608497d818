"""A whole Flower federation on this machine: SuperLink, one SuperNode per client, ``flwr run``.

:class:`LoopbackFederation` starts ``flower-superlink`` and the SuperNodes as processes on
127.0.0.1 (free ports, each in its own session), writes a Flower configuration naming that
SuperLink into a private ``FLWR_HOME``, submits the fedattr app with ``flwr run``, waits for
the run to end and stops every process it started (its descendants included) by process id.
It runs offline: telemetry, update checks and runtime dependency installation are off.

:func:`write_app` writes the Flower app project (a ``pyproject.toml`` naming fedattr's
ServerApp and ClientApp); ``flwr run`` packages that folder and the SuperLink runs the fedattr
installed next to Flower.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserError, not_writable
from ..secagg.directory import SERVERS, Directory, run_digest
from ..secagg.envelope import Recipient

Say = Callable[[str], None]

APP_TOML = """\
# A Flower app whose code is fedattr itself: install fedattr[flower] wherever the SuperLink and
# the SuperNodes run (their runtime dependency installation off), then flwr run this folder.
[project]
name = "fedattr-flower"
version = "{version}"
description = "fedattr on Flower: FedAttr attribution under pairwise-mask secure aggregation"
license = "Apache-2.0"
dependencies = ["flwr==1.41.0"]

[tool.flwr.app]
publisher = "fedattr"

[tool.flwr.app.components]
serverapp = "fedattr.flower.server_app:app"
clientapp = "fedattr.flower.client_app:app"

[tool.flwr.app.config]
# Override with flwr run ... --run-config "run-folder='/abs/path'" (see fedattr.flower.server_app)
run-folder = ""
config = ""
command = "run"
timeout = 600.0
wait-nodes = 120.0
"""


def write_app(folder: str | Path) -> Path:
    """Write the Flower app project into ``folder`` (created); returns its path."""
    from .. import __version__

    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise UserError(f"app folder: {str(path)!r} is a file; give a folder")
    made = [p for p in (path, *path.parents) if not p.exists()]  # innermost first
    toml = path / "pyproject.toml"
    new = not toml.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
        toml.write_text(APP_TOML.format(version=__version__))
    except OSError as exc:  # a read-only place, a file where a parent folder should be
        if new:  # leave nothing behind: a half-written file, the folders made here
            with contextlib.suppress(OSError):
                toml.unlink()
        for p in made:
            with contextlib.suppress(OSError):
                p.rmdir()
        raise not_writable(path, "app folder", exc) from None
    return path


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on 127.0.0.1 (bound together, then released)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _descendants(pid: int) -> list[int]:
    """Every living descendant of ``pid`` (Linux ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the command name may hold spaces or parentheses: the fields follow the last ')'
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class LoopbackFederation:
    """SuperLink + ``nodes`` SuperNodes on loopback; a context manager that stops them all.

    ``node_config`` adds settings to every SuperNode's ``--node-config`` (``partition-id`` is
    the node's index). ``threads`` sets ``FEDATTR_THREADS`` for every process the federation
    runs (the ClientApps of all nodes share this machine's cores).
    """

    def __init__(
        self,
        nodes: int,
        workdir: str | Path,
        node_config: Mapping[str, Any] | None = None,
        threads: int = 1,
        say: Say | None = None,
        start_timeout: float = 120.0,
        parties: Sequence[Mapping[str, Any]] = (),
        per_client: Mapping[int, Mapping[str, Any]] | None = None,
    ) -> None:
        if nodes < 1:
            raise UserError(f"nodes: must be >= 1, got {nodes}")
        self.nodes, self.workdir = nodes, Path(workdir).resolve()
        self.node_config = dict(node_config or {})
        self.parties = [dict(p) for p in parties]
        """Further SuperNodes, each with its own ``--node-config`` (the sealed mode's share
        servers and owners)."""
        self.per_client = {int(c): dict(v) for c, v in (per_client or {}).items()}
        """Settings client node ``c`` adds to its own (its key file, the directory)."""
        self.say = say or (lambda _m: None)
        self.start_timeout = start_timeout
        self.bin = Path(sys.executable).parent
        self.logs = self.workdir / "logs"
        self.home = self.workdir / "flwr-home"
        self.env = {
            **os.environ,
            "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
            "FLWR_HOME": str(self.home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FEDATTR_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1",
        }
        self.processes: list[subprocess.Popen] = []
        self.port: int | None = None
        self.timings: dict[str, float] = {}

    # -- processes ----------------------------------------------------------------------------
    def _spawn(self, args: list[str], log: str) -> subprocess.Popen:
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.logs / log, "w") as out:
            proc = subprocess.Popen(
                [str(self.bin / args[0]), *args[1:]],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.workdir,
                start_new_session=True,
            )
        self.processes.append(proc)
        return proc

    def _wait(self, ready: Callable[[], bool], proc: subprocess.Popen, what: str, log: str) -> None:
        deadline = time.monotonic() + self.start_timeout
        while not ready():
            if proc.poll() is not None:
                raise UserError(
                    f"flower: {what} exited with code {proc.returncode}:\n{_tail(self.logs / log)}"
                )
            if time.monotonic() > deadline:
                raise UserError(
                    f"flower: {what} not ready after {self.start_timeout:.0f} s; "
                    f"see {self.logs / log}"
                )
            time.sleep(0.1)

    def start(self) -> LoopbackFederation:
        """Start the SuperLink and the SuperNodes; return when all are connected."""
        start = time.perf_counter()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.home.mkdir(parents=True, exist_ok=True)
        self.port, *node_ports = free_ports(1 + self.nodes + len(self.parties))
        link = self._spawn(
            [
                "flower-superlink",
                "--insecure",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--disable-runtime-dependency-installation",
            ],
            "superlink.log",
        )

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1):
                    return True
            except OSError:
                return False

        self._wait(healthy, link, "the SuperLink", "superlink.log")
        self.timings["superlink_ready_s"] = time.perf_counter() - start
        configs = [
            {"partition-id": i, **self.node_config, **self.per_client.get(i, {})}
            for i in range(self.nodes)
        ]
        for i, (port, node) in enumerate(zip(node_ports, configs + self.parties, strict=True)):
            settings = " ".join(f"{k}={_toml(v)}" for k, v in node.items())
            self._spawn(
                [
                    "flower-supernode",
                    "--insecure",
                    "--superlink",
                    f"127.0.0.1:{self.port}",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--node-config",
                    settings,
                ],
                f"supernode-{i}.log",
            )
        for i, proc in enumerate(self.processes[1:]):
            log = self.logs / f"supernode-{i}.log"
            self._wait(
                lambda log=log: "SuperNode ID:" in log.read_text(errors="replace"),
                proc,
                f"SuperNode {i}",
                log.name,
            )
        self.timings["nodes_ready_s"] = time.perf_counter() - start
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\n'
            f'address = "127.0.0.1:{self.port}"\ninsecure = true\n'
        )
        self.say(
            f"flower: SuperLink on 127.0.0.1:{self.port} and "
            f"{self.nodes + len(self.parties)} SuperNodes "
            f"ready in {self.timings['nodes_ready_s']:.1f} s (logs: {self.logs})"
        )
        return self

    def stop(self) -> None:
        """Stop every process started here and all their descendants (TERM, then KILL)."""
        pids = [p.pid for p in self.processes]
        pids += [d for p in self.processes for d in _descendants(p.pid)]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and any(_alive(p) for p in pids):
                time.sleep(0.1)
            if not any(_alive(p) for p in pids):
                break
        for proc in self.processes:
            proc.wait(timeout=5)
        self.processes = []

    def __enter__(self) -> LoopbackFederation:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- runs ----------------------------------------------------------------------------------
    def flwr(self, *args: str, timeout: float = 120) -> str:
        """Run the ``flwr`` CLI against this federation; its stdout."""
        done = subprocess.run(
            [str(self.bin / "flwr"), *args],
            capture_output=True,
            text=True,
            env=self.env,
            cwd=self.workdir,
            timeout=timeout,
        )
        if done.returncode != 0:
            raise UserError(
                f"flower: 'flwr {' '.join(args[:2])}' failed: "
                f"{(done.stderr or done.stdout).strip()[-500:]}"
            )
        return done.stdout

    def submit(self, app: str | Path, run_config: Mapping[str, Any]) -> int:
        """``flwr run`` the app folder with ``run_config``; the run id."""
        overrides = [x for k, v in run_config.items() for x in ("--run-config", f"{k}={_toml(v)}")]
        out = self.flwr("run", str(Path(app).resolve()), "loopback", "--format", "json", *overrides)
        reply = json.loads(out[out.index("{") :])
        if not reply.get("success"):
            raise UserError(f"flower: the SuperLink did not start the run: {reply}")
        return int(reply["run-id"])

    def status(self, run_id: int) -> str:
        """The run's status, e.g. ``running`` or ``finished:completed``."""
        out = self.flwr("ls", "loopback", "--run-id", str(run_id), "--format", "json")
        run = json.loads(out[out.index("{") :])["runs"][0]
        return str(run["status"])

    def log(self, run_id: int) -> str:
        """The ServerApp's output so far."""
        try:
            return self.flwr("log", str(run_id), "loopback", "--show", timeout=60)
        except (UserError, subprocess.TimeoutExpired) as exc:
            return f"(no log: {exc})"

    def wait(
        self, run_id: int, finished: Callable[[], bool], timeout: float, poll: float = 5.0
    ) -> str:
        """Wait until ``finished()`` or the SuperLink reports the run finished; its status."""
        deadline, next_poll = time.monotonic() + timeout, 0.0
        while True:
            if finished():
                # the ServerApp has written its files; let Flower record the end
                for _ in range(20):
                    status = self.status(run_id)
                    if status.startswith("finished"):
                        return status
                    time.sleep(0.5)
                return status
            if time.monotonic() >= next_poll:
                status = self.status(run_id)
                if status.startswith("finished"):
                    return status
                next_poll = time.monotonic() + poll
            if time.monotonic() > deadline:
                raise UserError(f"flower: run {run_id} did not finish within {timeout:.0f} s")
            if any(p.poll() is not None for p in self.processes):
                dead = [i for i, p in enumerate(self.processes) if p.poll() is not None]
                raise UserError(
                    f"flower: a federation process exited during the run (#{dead}); see {self.logs}"
                )
            time.sleep(0.25)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _toml(value: Any) -> str:
    """A value as Flower's ``key=value`` settings parse it (TOML)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value)
    if "'" in text or "\n" in text:
        raise UserError(f"flower setting: {text!r} may not hold a single quote or a newline")
    return f"'{text}'"


class ServerAppError(RuntimeError):
    """The ServerApp failed with a bug; the message holds its traceback."""


@dataclass
class SealedNodes:
    """The sealed mode's node settings on one machine: the share servers' and owners' nodes,
    and what each client node adds to its own."""

    parties: list[dict[str, Any]] = field(default_factory=list)
    clients: dict[int, dict[str, Any]] = field(default_factory=dict)


def _envelope_key(folder: Path, name: str) -> tuple[str, bytes]:
    """A party's key file under ``folder`` (kept: a resumed run's parties keep their keys)."""
    path = folder / f"{name}.key"
    key = Recipient.load(path) if path.is_file() else Recipient()
    if not path.is_file():
        key.save(path)
    return str(path.resolve()), key.identity


def sealed_nodes(config: Any, work: Path) -> SealedNodes:
    """The sealed mode's SuperNodes beside the clients (none in another mode): share servers A
    and B, each keeping its running sums in its own folder under ``work``, and one node per
    owner; every party, clients too, with its own envelope key and the deployment directory
    (``work/keys``), so no party takes a key from the coordinator."""
    from .records import config_json
    from .server_app import sealed_parties

    if config.attribution.protocol.mode != "sealed":
        return SealedNodes()
    folder = work / "keys"
    folder.mkdir(parents=True, exist_ok=True)
    servers = {s: _envelope_key(folder, f"server-{s}") for s in SERVERS}
    owners = {j: _envelope_key(folder, f"owner-{j}") for j in range(sealed_parties(config) - 2)}
    clients = {c: _envelope_key(folder, f"client-{c}") for c in range(config.fl.K)}
    directory = Directory.new(
        {s: k for s, (_, k) in servers.items()},
        {j: k for j, (_, k) in owners.items()},
        {c: k for c, (_, k) in clients.items()},
        run_digest(config_json(config)),
    )
    path = folder / "directory.json"
    if path.is_file():  # a resumed run keeps its nonce (the same run)
        try:
            kept = Directory.load(path)
        except UserError:  # written by an earlier version: a new one
            kept = directory
        if (kept.servers, kept.owners, kept.clients, kept.run) == (
            directory.servers,
            directory.owners,
            directory.clients,
            directory.run,
        ):
            directory = kept
    pinned = {"directory": str(directory.save(path).resolve())}
    parties = [
        {
            "role": "share-server",
            "server": s,
            "state-dir": str((work / f"server-{s}").resolve()),
            "key-file": path,
            **pinned,
        }
        for s, (path, _) in servers.items()
    ]
    parties += [
        {"role": "owner", "owner": j, "key-file": path, **pinned} for j, (path, _) in owners.items()
    ]
    # Each client keeps the rounds it answered in a folder of its own (its ledger).
    return SealedNodes(
        parties,
        {
            c: {"key-file": path, "state-dir": str((work / f"client-{c}").resolve()), **pinned}
            for c, (path, _) in clients.items()
        },
    )


def run_loopback(
    command: str,
    config: Any,
    folder: Any,
    *,
    timeout: float = 6 * 3600,
    message_timeout: float = 600.0,
    node_config: Mapping[str, Any] | None = None,
    say: Say | None = None,
) -> dict:
    """Run ``config`` (a ``RunConfig`` for ``run``, a ``DemoConfig`` for ``demo``) on a
    loopback Flower federation with one SuperNode per client, into the claimed run folder
    ``folder`` (a :class:`~fedattr.reporting.run_folder.RunFolder`); returns its
    ``results.json`` with the launcher's timings added under ``runtime.loopback``."""
    from .server_app import ERROR_FILE, PROGRESS_FILE

    say = say or (lambda _m: None)
    clients = config.fl.K if command == "run" else config.synthetic.K
    work = folder.path / "flower"
    app = write_app(work / "app")
    results, error = folder.file("results.json"), folder.file(ERROR_FILE)
    progress = folder.file(PROGRESS_FILE)
    error.unlink(missing_ok=True)  # a resumed run's earlier failure
    shown = len(progress.read_text().splitlines()) if progress.is_file() else 0

    def finished() -> bool:
        nonlocal shown
        if progress.is_file():  # relay the ServerApp's progress
            lines = progress.read_text(errors="replace").splitlines()
            for line in lines[shown:]:
                say(line)
            shown = len(lines)
        return results.is_file() or error.is_file()

    sealed = sealed_nodes(config, work) if command == "run" else SealedNodes()
    with LoopbackFederation(
        clients, work, node_config, say=say, parties=sealed.parties, per_client=sealed.clients
    ) as fed:
        start = time.perf_counter()
        run_id = fed.submit(
            app,
            {
                "run-folder": str(folder.path.resolve()),
                "command": command,
                "timeout": float(message_timeout),
            },
        )
        say(f"flower: run {run_id} submitted")
        status = fed.wait(run_id, finished, timeout)
        run_s = time.perf_counter() - start
        finished()
        (work / "serverapp.log").write_text(fed.log(run_id))
        timings = dict(fed.timings)
    if error.is_file():
        text = error.read_text()
        if text.startswith("Traceback"):
            raise ServerAppError(f"the ServerApp failed:\n{text}")
        raise UserError(text.strip())
    if not status.endswith("completed") or not results.is_file():
        raise UserError(
            f"flower: run {run_id} ended {status!r} without results; ServerApp log: "
            f"{work / 'serverapp.log'}"
        )
    data = json.loads(results.read_text())
    data.setdefault("runtime", {})["loopback"] = {
        **{k: round(v, 2) for k, v in timings.items()},
        "run_s": round(run_s, 2),
        "run_id": run_id,
        "status": status,
    }
    results.write_text(json.dumps(data, indent=2))
    return data
