"""``fedattr demo-protocol`` and ``fedattr run`` (and ``--resume``): one federation, end to end."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from .common import PRESET_HELP, config_options, default_run_dir, resolve_run_config


def _cmd_demo(args: argparse.Namespace) -> int:
    from ..config import load, to_dict
    from ..pipeline.config import DemoConfig
    from ..pipeline.run import check_devices, run_demo
    from ..reporting.run_folder import RunFolder

    cfg = load(DemoConfig, args.config, args.set)
    check_devices(cfg)  # this machine's hardware: when the run starts, before any folder
    folder = None
    if args.out:
        folder = RunFolder(args.out)
        folder.claim(to_dict(cfg))  # before any work: a bad --out costs nothing
    # A demo keeps no checkpoint: one that fails leaves no folder to block its re-run.
    with folder.released_on_failure() if folder else contextlib.nullcontext():
        result = run_demo(cfg, progress=None if not args.quiet else (lambda _m: None))
        if folder is not None:
            result.write(folder)
    if folder is not None:
        print(
            f"wrote {folder}/: results.json report.md attribution.png rounds.jsonl "
            "queries.jsonl config.json",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        from ..reporting.markdown import attribution_table

        print(attribution_table(result.report))
        t = result.timing
        print(
            f"\nSA backend {cfg.secagg.backend}: {result.sa_queries} SA queries; "
            f"total {t['total_s']:.2f} s (SA {t['sa_s']:.2f} s, scoring {t['scoring_s']:.3f} s)"
        )
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from ..config import to_dict
    from ..errors import UserError
    from ..pipeline.run import check_inputs, run_experiment
    from ..reporting.markdown import attribution_table
    from ..reporting.run_folder import RunFolder

    if args.continue_run and (args.resume or not args.out):
        raise UserError("--continue: give --out (the run folder to continue or keep), not --resume")
    cfg, folder = resolve_run_config(args, args.preset, ("--config", "--set", "--out"))
    if folder is None:  # a new run, not a resumed one
        folder = RunFolder(args.out or default_run_dir(cfg))
        if args.continue_run and folder.status == "finished":
            # Checked as a new run would be: the same configuration, else one line.
            folder.claim(cfg, reuse=True)
            print(f"{folder}: a finished run of this configuration, kept ({folder}/report.md)")
            return 0
        check_inputs(cfg)  # data, key files, model path: before the folder is written
        if folder.claim(cfg if args.continue_run else to_dict(cfg), reuse=args.continue_run) == (
            "resume"
        ):
            print(f"{folder}: continuing its unfinished run", file=sys.stderr)
    else:
        check_inputs(cfg)
    try:
        # A start that fails before its first round leaves no folder to block the re-run.
        with folder.released_on_failure():
            result = run_experiment(cfg, folder=folder)
    except KeyboardInterrupt:
        if folder.status == "new":  # released: no round had finished
            print(
                "fedattr: interrupted before the first round finished; nothing was kept",
                file=sys.stderr,
            )
            return 130
        print(
            f"fedattr: interrupted; finished rounds are kept: continue with "
            f"'fedattr run --resume {folder}'",
            file=sys.stderr,
        )
        return 130
    result.write(folder)
    folder.clear_checkpoint()
    if cfg.attribution.scoring == "owner":
        print(
            f"{folder}/rounds/: one folder per round for the owners; each scores them with "
            f"'fedattr owner score --key KEY {folder}/rounds/round-*', then "
            f"'fedattr attribute {folder}' writes the verdicts"
        )
        return 0
    print(attribution_table(result.report))
    t = result.timing
    print(
        f"\n{cfg.fl.strategy} / {cfg.watermark.kind.upper()} / {cfg.model.preset}: "
        f"{result.sa_queries} SA queries; "
        f"train {t['train_s']:.1f} s, SA {t['sa_s']:.1f} s, scoring {t['scoring_s']:.1f} s, "
        f"verdict {t.get('verdict_s', 0.0):.1f} s, total {t['total_s']:.1f} s "
        f"(FedAttr overhead {100 * t['overhead']:.0f}% of training)"
    )
    for name, v in result.variants.items():
        print(
            f"variant {name} ({v['differs']}): flagged {v['flagged']}, "
            f"TPR {v['tpr']}, FPR {v['fpr']}, {v['sa_queries']} SA queries"
        )
    print(f"run folder: {folder}")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``demo-protocol`` and ``run``; both do the work here, so take the threads."""
    demo = sub.add_parser(
        "demo-protocol",
        help="the protocol demo: a synthetic federation of plain vectors through SA and FedAttr "
        "(no language model; the embedded default job is 'fedattr run')",
    )
    config_options(
        demo,
        "a .json or .toml file with [synthetic], [secagg], [attribution]",
        "override a setting, e.g. --set attribution.protocol.M=10",
    )
    demo.add_argument("--out", help="write results.json, report.md, rounds.jsonl here")
    demo.add_argument("--json", action="store_true", help="print results as JSON")
    demo.add_argument("--quiet", action="store_true", help="no per-round progress lines")
    demo.set_defaults(func=_cmd_demo, threads=True)

    run = sub.add_parser(
        "run",
        help="federated LoRA fine-tuning with watermarked clients (KGW or FK), SA and FedAttr",
    )
    run.add_argument("--preset", default="tiny", help=PRESET_HELP)
    config_options(
        run,
        "a .json or .toml file (sections: model, lora, data, watermark, fl, secagg, attribution)",
        "override a setting, e.g. --set fl.strategy=flora",
    )
    run.add_argument("--out", help="run folder (default: runs/<time>-<strategy>-<model>)")
    run.add_argument(
        "--resume", metavar="RUN_DIR", help="continue an interrupted run after its last round"
    )
    run.add_argument(
        "--continue",
        dest="continue_run",
        action="store_true",
        help="with --out: where the folder holds a run of this configuration, continue it if "
        "it was cut, keep it if it finished (so the same command can be given again)",
    )
    run.set_defaults(func=_cmd_run, threads=True)
