"""The ServerApp: fedattr's round engine with SuperNode clients and pairwise masking over
Flower messages.

Run settings (``flwr run ... --run-config "..."``):

- ``run-folder`` (required): where results go, the same files as ``fedattr run --out``; a folder
  claimed by ``fedattr flower`` already holds the configuration (``config.json``);
- ``config``: a ``.toml``/``.json`` configuration file, the same file ``fedattr run --config``
  (or ``demo-protocol --config``) reads, for a folder that holds none yet;
- ``command``: ``run`` (an LLM federation, default) or ``demo`` (the synthetic one);
- ``timeout``: seconds a node has to answer one message (default 600); a node past it is
  offline for the round, its queries fail with nothing released;
- ``wait-nodes``: seconds to wait for one SuperNode per client (default 120).
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from ..config import load
from ..errors import UserError
from ..pipeline.config import require_in_process
from ..reporting.run_folder import RunFolder
from ..runtime import set_threads
from ..secagg.remote_server import RemoteMaskingServer
from . import COMMANDS
from .link import FlowerLink
from .pool import FlowerPool
from .records import config_json, config_of
from .sealed import FlowerParties

app = ServerApp()

ERROR_FILE = "flower-error.txt"
"""Written into the run folder when the ServerApp fails: a traceback for a bug, one line for
bad input (the launcher reports it)."""
PROGRESS_FILE = "progress.log"
"""The ServerApp's progress lines, appended as the run goes."""


def _config(run_config: Mapping[str, Any], folder: RunFolder, command: str) -> Any:
    from ..pipeline.config import DemoConfig, RunConfig

    path = run_config.get("config")
    if path:
        cfg = load(RunConfig if command == "run" else DemoConfig, str(path))
        if folder.claim(cfg, reuse=True) == "finished":
            raise UserError(
                f"run-folder: {str(folder.path)!r} holds a finished run of this "
                "configuration; choose another run-folder"
            )
        return cfg
    if folder.status == "finished":
        raise UserError(f"run-folder: {str(folder.path)!r} holds a finished run; choose another")
    if folder.status == "new":
        raise UserError(
            "config: the run folder holds no configuration; pass "
            "--run-config \"config='run.toml' run-folder='...'\""
        )
    return config_of(command, json.dumps(folder.saved_config()))


def sealed_others(cfg: Any) -> list[str]:
    """Attribution variants other than the main one that run the sealed mode."""
    variants = cfg.attribution_variants()
    return [n for n, a in list(variants.items())[1:] if a.protocol.mode == "sealed"]


def sealed_parties(cfg: Any) -> int:
    """SuperNodes the sealed mode needs beside the clients: two share servers and one node per
    owner."""
    wm = cfg.watermark
    return 2 + (len(wm.kgw.key_files) if wm.kgw.key_files else wm.owners)


def check_settings(cfg: Any, command: str) -> None:
    """Refuse the settings a Flower federation cannot run (``fedattr flower local`` checks them
    before it starts any process, the ServerApp again)."""
    sa = cfg.secagg
    if sa.backend != "pairwise-mask":
        raise UserError(
            f"secagg.backend: on Flower the clients mask their own updates; allowed: "
            f"pairwise-mask (got {sa.backend!r})"
        )
    if sa.dropout:
        raise UserError(
            "secagg.dropout: simulated dropouts are for in-process runs; on Flower a node that "
            "misses the timeout is a dropout; allowed: 0"
        )
    if command == "run" and any(g.drop for g in cfg.fl.clients):
        raise UserError(
            "fl.clients[].drop: simulated dropouts are for in-process runs; on Flower a node "
            "that misses the timeout is a dropout; allowed: 0"
        )
    if command == "demo":
        require_in_process(cfg)  # the synthetic federation has no detector to read shares with
    elif sealed_others(cfg):
        raise UserError(
            f"variants: on Flower the sealed mode is the main attribution only (its parties "
            f"serve one); sealed variants {sealed_others(cfg)}; allowed: paper, hardened"
        )
    if command == "run" and cfg.baselines:
        raise UserError(
            "baselines: they read plaintext client updates, which Flower clients never send; "
            "allowed: false"
        )


def serve(grid: Grid, run_config: Mapping[str, Any], say: Callable[[str], None] = print) -> Any:
    """Run the configured federation on the grid's SuperNodes; write and return its results."""
    from ..pipeline.run import run_demo, run_experiment

    if not run_config.get("run-folder"):
        raise UserError("run-folder: required (--run-config \"run-folder='results/flower'\")")
    folder = RunFolder(str(run_config["run-folder"]), option="run-folder")
    command = str(run_config.get("command", "run"))
    if command not in COMMANDS:
        raise UserError(f"command: unknown {command!r}; allowed: {', '.join(COMMANDS)}")
    cfg = _config(run_config, folder, command)
    check_settings(cfg, command)
    clients = cfg.fl.K if command == "run" else cfg.synthetic.K
    link = FlowerLink(grid, float(run_config.get("timeout", 600)), say)
    sealed = command == "run" and cfg.attribution.protocol.mode == "sealed"
    sizes = link.register(
        command,
        config_json(cfg),
        clients,
        float(run_config.get("wait-nodes", 120)),
        parties=sealed_parties(cfg) if sealed else 0,
    )
    sa = cfg.secagg
    server = RemoteMaskingServer(link, sa.min_members, sa.codec(), sa.release_budget or None)
    parties = None
    if sealed:
        parties = FlowerParties(link)
    pool = FlowerPool(link, sizes, send_state=(command == "run"), sealed=parties)
    if command == "run":
        result = run_experiment(cfg, say, folder, pool=pool, sa=server, parties=parties)
    else:
        result = run_demo(cfg, say, folder, pool=pool, sa=server)
    import flwr

    result.details["runtime"] = {
        "name": "flower",
        "flwr": flwr.__version__,
        "nodes": {str(c): n for c, n in sorted(link.node_of.items())},
        "messages": link.messages,
        "sa_exchanges": server.exchanges,
        "message_seconds": {k: round(v, 3) for k, v in link.seconds.items()},
    }
    result.write(folder)
    folder.clear_checkpoint()
    say(f"results written to {folder}")
    return result


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Flower's entry point: :func:`serve` with the run's settings. Progress goes to stdout and
    the run folder's ``progress.log``; a failure leaves ``flower-error.txt`` there before
    Flower sees it."""
    set_threads()
    path = str(context.run_config.get("run-folder") or "")
    folder = RunFolder(path) if path else None

    def say(message: str) -> None:
        print(message, flush=True)
        if folder is not None and folder.path.is_dir():
            with open(folder.file(PROGRESS_FILE), "a") as log:
                log.write(message + "\n")

    try:
        serve(grid, dict(context.run_config), say)
    except UserError as exc:
        if folder is not None and folder.path.is_dir():
            folder.file(ERROR_FILE).write_text(f"{exc}\n")
        raise
    except BaseException:
        if folder is not None and folder.path.is_dir():
            folder.file(ERROR_FILE).write_text(traceback.format_exc())
        raise
