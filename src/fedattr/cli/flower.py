"""``fedattr flower``: fedattr on Flower (a loopback federation here, or the app for flwr run)."""

from __future__ import annotations

import argparse
import json
import secrets
import sys

from ..errors import UserError
from .common import config_options, default_run_dir, resolve_run_config, say


def _cmd_flower_local(args: argparse.Namespace) -> int:
    import importlib.util
    import time

    from ..config import load, to_dict
    from ..pipeline.config import DemoConfig
    from ..reporting.run_folder import RunFolder

    if importlib.util.find_spec("flwr") is None:
        raise UserError("flower: Flower is not installed; pip install 'fedattr[flower]'")
    from ..flower.launch import run_loopback

    command = "demo" if args.demo else "run"
    if args.demo and not args.resume:  # with --resume, --demo is refused below
        if args.preset:
            raise UserError("--preset: for LLM runs; drop it with --demo")
        cfg = load(DemoConfig, args.config, args.set)
        folder = None
        default = f"runs/{time.strftime('%Y%m%d-%H%M%S')}-flower-demo"
    else:
        # The folder's own configuration on resume: nothing may change (as fedattr run).
        cfg, folder = resolve_run_config(
            args, args.preset or "tiny", ("--config", "--set", "--out", "--preset", "--demo")
        )
        default = None if folder is not None else f"{default_run_dir(cfg)}-flower"
    node_config = {}
    for item in args.node_config:
        key, sep, value = item.partition("=")
        if not sep or not key or key == "partition-id":
            raise UserError(
                f"--node-config: KEY=VALUE (e.g. min-members=5; partition-id is set per node), "
                f"got {item!r}"
            )
        from ..config import parse_scalar

        node_config[key] = parse_scalar(value)
    if not args.timeout > 0:
        raise UserError(f"--timeout: must be > 0 seconds, got {args.timeout}")
    # Everything checkable before a folder is written or a process started (as the ServerApp
    # would check it, 10 s of SuperLink and SuperNodes later).
    from ..flower.server_app import check_settings

    check_settings(cfg, command)
    from ..pipeline.run import check_devices, check_inputs

    # Loopback: every node runs on this machine, so its hardware is the nodes' hardware.
    if command == "run":
        check_inputs(cfg)  # check_devices, then data, key files, model path
    else:
        check_devices(cfg)
    if default is not None:
        folder = RunFolder(args.out or default)
        folder.claim(to_dict(cfg))  # before any process starts: a bad --out costs nothing
    data = run_loopback(
        command,
        cfg,
        folder,
        message_timeout=args.timeout,
        node_config=node_config,
        say=say,
    )
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(folder.file("report.md").read_text())
        loop = data["runtime"]["loopback"]
        print(
            f"\nFlower loopback: {data['runtime']['messages']} messages, "
            f"{data['runtime']['sa_exchanges']} SA exchanges; federation ready in "
            f"{loop['nodes_ready_s']:.1f} s, run {loop['run_s']:.1f} s"
        )
    print(f"run folder: {folder}", file=sys.stderr)
    return 0


def _cmd_flower_keygen(args: argparse.Namespace) -> int:
    from ..secagg.envelope import Recipient

    key = Recipient()
    path = key.save(args.key_file)
    say(f"wrote {path} (mode 0600: this party's alone); its public identity, for the directory:")
    print(key.identity.hex())
    return 0


def _public_keys(items: list[str], option: str, names: tuple[str, ...] | None) -> dict[str, str]:
    """``NAME=HEX`` pairs of a ``directory`` option (checked by the directory itself)."""
    keys: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        allowed = "/".join(names) if names else "an index"
        if (
            not sep
            or (names is not None and name not in names)
            or (names is None and not (name.isascii() and name.isdecimal()))
        ):
            raise UserError(f"{option}: NAME=PUBLIC_KEY with NAME {allowed}, got {item!r}")
        name = name if names is not None else str(int(name))  # 01 and 1 are one party
        if name in keys:
            raise UserError(f"{option}: {name} given twice")
        keys[name] = value
    return keys


def _cmd_flower_directory(args: argparse.Namespace) -> int:
    from ..config import load, to_dict
    from ..pipeline.config import RunConfig
    from ..secagg.directory import SERVERS, Directory, run_digest

    # The configuration exactly as the ServerApp reads it (--run-config "config='...'"): the
    # digest every node checks is of that.
    cfg = load(RunConfig, args.config)
    if cfg.attribution.protocol.mode != "sealed":
        raise UserError(
            "attribution.protocol.mode: a directory serves the sealed mode; allowed: sealed"
        )
    servers = _public_keys(args.server, "--server", SERVERS)
    owners = _public_keys(args.owner, "--owner", None)
    clients = _public_keys(args.client, "--client", None)
    if sorted(servers) != list(SERVERS):
        raise UserError(f"--server: give A=... and B=...; got {sorted(servers) or 'none'}")
    from ..flower.server_app import sealed_parties

    wanted = range(sealed_parties(cfg) - 2)
    if sorted(int(o) for o in owners) != list(wanted):
        raise UserError(
            f"--owner: the run has {len(wanted)} owners, indices 0..{len(wanted) - 1}, each "
            f"with its key; got {sorted(owners) or 'none'}"
        )
    if sorted(int(c) for c in clients) != list(range(cfg.fl.K)):
        raise UserError(
            f"--client: the run has {cfg.fl.K} clients, ids 0..{cfg.fl.K - 1}, each with its "
            f"key; got {sorted(int(c) for c in clients) or 'none'}"
        )
    directory = Directory.from_dict(  # checks every identity
        {
            "run": run_digest(json.dumps(to_dict(cfg))),
            "nonce": secrets.token_hex(16),  # this run's, whatever keys it reuses
            "servers": servers,
            "owners": owners,
            "clients": clients,
        }
    )
    path = directory.save(args.out)
    say(
        f"wrote {path}: {len(clients)} clients, {len(owners)} owners, servers A and B, the run "
        f"sha256 {directory.run[:16]}...; give it to every party (--node-config "
        "\"directory='...' key-file='...'\")"
    )
    return 0


def _cmd_flower_app(args: argparse.Namespace) -> int:
    from ..flower.launch import write_app

    path = write_app(args.folder)
    print(
        f"wrote {path}/pyproject.toml: submit it with flwr run {path} <superlink> "
        "--run-config \"run-folder='/abs/run/folder' config='/abs/run.toml'\""
    )
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``flower`` and its subcommands; the group takes the threads (``flower local``
    runs every node on this machine)."""
    flower = sub.add_parser("flower", help="run fedattr on Flower (SuperLink, SuperNodes)")
    flower.set_defaults(threads=True)
    flower_sub = flower.add_subparsers(dest="flower", required=True)
    fl = flower_sub.add_parser(
        "local",
        help="a whole federation on this machine: SuperLink + one SuperNode per client",
    )
    fl.add_argument("--demo", action="store_true", help="the synthetic federation (no LLM)")
    fl.add_argument("--preset", help="tiny (default) or smollm2; LLM runs only")
    config_options(fl, "the same .json/.toml file fedattr run (or --demo: demo-protocol) reads")
    fl.add_argument("--out", help="run folder (default: runs/<time>-...-flower)")
    fl.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds a node has to answer one message (default 600)",
    )
    fl.add_argument(
        "--node-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a SuperNode setting for every node, e.g. min-members=5",
    )
    fl.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue an interrupted LLM run "
        "after its last finished round (its own configuration)",
    )
    fl.add_argument("--json", action="store_true", help="print results.json")
    fl.set_defaults(func=_cmd_flower_local)
    kg = flower_sub.add_parser(
        "keygen", help="a sealed-mode party's envelope key (prints its public key)"
    )
    kg.add_argument("key_file", metavar="KEY_FILE", help="where to write it (never overwritten)")
    kg.set_defaults(func=_cmd_flower_keygen)
    fd = flower_sub.add_parser(
        "directory",
        help="the sealed mode's directory: every party's public key and the run, pinned",
    )
    fd.add_argument("out", metavar="OUT", help="the directory file to write (JSON)")
    fd.add_argument(
        "--config",
        required=True,
        help="the run's .json/.toml file, the one the ServerApp reads (--run-config config=...)",
    )
    for option, what in (
        ("--server", "A=HEX or B=HEX"),
        ("--owner", "INDEX=HEX (the owner node's owner= setting)"),
        ("--client", "ID=HEX (the client node's partition-id)"),
    ):
        fd.add_argument(
            option,
            action="append",
            default=[],
            metavar=what.split(" ")[0],
            help=f"a party's public key, {what} (repeatable)",
        )
    fd.set_defaults(func=_cmd_flower_directory)
    fa = flower_sub.add_parser("app", help="write the Flower app project for flwr run")
    fa.add_argument("folder", help="where to write pyproject.toml")
    fa.set_defaults(func=_cmd_flower_app)
