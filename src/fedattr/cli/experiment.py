"""``fedattr experiment``: the paper's tables and figures, calibration and sweeps (resumable)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from ..errors import UserError, require_creatable_folder, require_extra
from .common import PRESET_HELP, config_options, say


def _parse_seeds(text: str, option: str = "--seeds") -> list[int]:
    """``1,2,3`` or a range ``0-199`` (or both: ``0-9,20``)."""
    form = "comma-separated integers or ranges FIRST-LAST, e.g. 1,2,3 or 0-199 or 0-9,20"
    out: list[int] = []
    try:
        for part in (x.strip() for x in text.split(",")):
            if not part:
                continue
            lo, sep, hi = part.partition("-")
            if sep and lo and int(hi) < int(lo):
                raise UserError(
                    f"{option}: the range {part!r} is empty (it runs down); a range is "
                    f"FIRST-LAST with FIRST <= LAST, e.g. {int(hi)}-{int(lo)}"
                )
            out += list(range(int(lo), int(hi) + 1)) if sep and lo else [int(part)]
    except UserError:
        raise
    except ValueError:
        raise UserError(f"{option}: {form}; got {text!r}") from None
    if not out:
        raise UserError(f"{option}: none given: {form}; got {text!r}")
    return out


def _experiment(run: Callable[[Callable[[str], None]], object], out: str, summary: str) -> int:
    """Run a resumable experiment into ``out`` (``run(progress)``), then print ``summary``."""
    from pathlib import Path

    require_creatable_folder(out, "--out")  # before the first run, not after it
    try:
        run(say)
    except KeyboardInterrupt:
        print(
            "fedattr: interrupted; finished runs are kept: re-run the same command to continue",
            file=sys.stderr,
        )
        return 130
    print(Path(out, summary).read_text())
    print(f"experiment folder: {out}")
    return 0


def _cmd_experiment_calibration(args: argparse.Namespace) -> int:
    require_extra("matplotlib", "plots", "fedattr experiment calibration (its figures)")
    from ..experiments.calibration import CalibrationSpec, run_calibration

    spec = CalibrationSpec(
        args.bed,
        _parse_seeds(args.seeds),
        _parse_seeds(args.r, "--r"),
        args.config,
        args.set,
        args.jobs,
        args.reread,
    )
    out = args.out or f"runs/calibration-{args.bed}"
    return _experiment(lambda say: run_calibration(spec, out, say), out, "calibration.md")


def _cmd_experiment_tail_check(args: argparse.Namespace) -> int:
    from ..experiments.calibration import tail_check, write_tail_check

    if args.draws < 100:
        raise UserError(f"--draws: Monte Carlo draws per point, >= 100; got {args.draws}")
    out = require_creatable_folder(args.out, "--out")
    device = None if args.device == "cpu" else args.device
    if device == "cuda":
        from ..runtime import require_cuda

        require_cuda("--device")
    pairs = [_pair(p) for p in args.pair]
    rows = tail_check(args.run_dirs, args.draws, device=device, progress=say, pairs=pairs)
    write_tail_check(rows, out)
    print((out / "tail-check.md").read_text())
    return 0


def _pair(text: str) -> tuple[int, str]:
    """``46:kgw:owner0`` -> ``(46, "kgw:owner0")``."""
    client, _, statistic = text.partition(":")
    if not client.strip().isdigit() or not statistic:
        raise UserError(
            f"--pair: CLIENT:STATISTIC, a client id and a statistic as results.json names them "
            f"(e.g. 46:kgw:owner0); got {text!r}"
        )
    return int(client), statistic


def _cmd_experiment_sweep(args: argparse.Namespace) -> int:
    require_extra("matplotlib", "plots", "fedattr experiment sweep (its figures)")
    from ..experiments.sweep import SweepSpec, parse_grid, run_sweep

    grid = parse_grid(args.grid)
    spec = SweepSpec(grid, _parse_seeds(args.seeds), args.preset, args.config, args.set)
    out = args.out or "runs/sweep-" + "-".join(a.label.rsplit(".", 1)[-1] for a in grid)
    return _experiment(lambda say: run_sweep(spec, out, say), out, "table.md")


def _cmd_experiment_table(args: argparse.Namespace) -> int:
    require_extra("matplotlib", "plots", "fedattr experiment table (its figures)")
    from ..experiments.sweep import run_sweep
    from ..experiments.tables import table_spec

    spec = table_spec(args.name, _parse_seeds(args.seeds), args.preset, args.config, args.set)
    out = args.out or f"runs/table-{args.name}-{args.preset}"
    return _experiment(lambda say: run_sweep(spec, out, say), out, "table.md")


def _cmd_experiment_main(args: argparse.Namespace) -> int:
    from ..experiments.main import MainSpec, run_main

    spec = MainSpec(args.preset, _parse_seeds(args.seeds), args.config, args.set)
    out = args.out or f"runs/main-{args.preset}"
    return _experiment(lambda say: run_main(spec, out, say), out, "table.md")


def _cmd_experiment_mechanism(args: argparse.Namespace) -> int:
    require_extra("matplotlib", "plots", "fedattr experiment mechanism (its figures)")
    from pathlib import Path

    from ..experiments.main import MainSpec, run_or_reuse
    from ..experiments.mechanism import write_mechanism

    if args.watermark not in ("kgw", "fk"):
        raise UserError(f"--watermark: must be kgw or fk, got {args.watermark!r}")
    spec = MainSpec(args.preset, [args.seed], args.config, [f"fl.rounds={args.rounds}", *args.set])
    cfg = spec.run_config(args.strategy, args.watermark, args.seed)
    out = Path(args.out or f"runs/mechanism-{args.preset}-{args.strategy}-{args.watermark}")
    require_creatable_folder(out, "--out")
    run_dir = out / "run"
    run_or_reuse(cfg, run_dir)
    summary = write_mechanism(run_dir, out)
    print(
        f"m̂ = {summary['m_hat']:.3f}, ε̂ = {summary['eps_hat']:.3f}, ν̂ = {summary['nu_hat']:.3f} "
        f"over {summary['rounds']} rounds"
    )
    print(f"wrote {out}/fig2a..fig2d PNGs and mechanism.json")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``experiment`` and its subcommands; every one runs (or reads) runs here, so the
    group takes the threads."""
    exp = sub.add_parser(
        "experiment", help="Table 1 (main), Figure 2 (mechanism), calibration, sweeps"
    )
    exp.set_defaults(threads=True)
    exp_sub = exp.add_subparsers(dest="experiment", required=True)
    em = exp_sub.add_parser(
        "main", help="{FedIT, FLoRA} x {KGW, FK} x seeds: FedAttr and the baselines (resumable)"
    )
    em.add_argument("--preset", default="tiny", help=PRESET_HELP)
    em.add_argument("--seeds", default="1,2,3", help="comma-separated seeds (default 1,2,3)")
    em.add_argument("--out", help="experiment folder (default runs/main-<preset>)")
    mech = exp_sub.add_parser("mechanism", help="Figure 2's four panels from one run")
    mech.add_argument("--preset", default="tiny", help=PRESET_HELP)
    mech.add_argument("--strategy", default="fedit", help="fedit (default) or flora")
    mech.add_argument("--watermark", default="kgw", help="kgw (default) or fk")
    mech.add_argument("--seed", type=int, default=1, help="the run's seed (default 1)")
    mech.add_argument("--rounds", type=int, default=5, help="FL rounds T (default 5)")
    mech.add_argument("--out", help="folder (default runs/mechanism-<preset>-<strategy>-<wm>)")
    cal = exp_sub.add_parser(
        "calibration", help="empirical FPR of null p-values, QQ plot, family-wise TPR (resumable)"
    )
    cal.add_argument(
        "--bed",
        default="synthetic",
        help="synthetic (default), an LLM preset (tiny, smollm2, smollm2-cpu) or a stress bed "
        "of tiny: partial-skew, free-riders, stragglers, few-clients, many-clients",
    )
    cal.add_argument("--seeds", default="0-199", help="seeds: 1,2,3 or 0-199 (default 0-199)")
    cal.add_argument("--r", default="0,3", help="watermarked clients per run (default 0,3)")
    cal.add_argument("--out", help="experiment folder (default runs/calibration-<bed>)")
    cal.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs in parallel processes, one thread each (default 1)",
    )
    cal.add_argument(
        "--reread",
        action="store_true",
        help="read every finished run's verdicts again from its saved change matrices with "
        "this fedattr's tails (no training) before summarising",
    )
    cal.set_defaults(func=_cmd_experiment_calibration)
    tc = exp_sub.add_parser(
        "tail-check", help="the verdict's exact tail against tilted Monte Carlo on saved runs"
    )
    tc.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="run folders with changes.safetensors"
    )
    tc.add_argument("--draws", type=int, default=4000, help="random keys per point (4000)")
    tc.add_argument("--out", default="runs/tail-check", help="where tail-check.md/json go")
    tc.add_argument(
        "--pair",
        action="append",
        default=[],
        metavar="CLIENT:STATISTIC",
        help="only this client's change under this statistic (e.g. 46:kgw:owner0, a named "
        "pair); default: every saved change",
    )
    tc.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where the random keys are drawn: cpu (numpy, default) or cuda (torch; "
        "vocabulary-sized changes)",
    )
    tc.set_defaults(func=_cmd_experiment_tail_check)
    sw = exp_sub.add_parser(
        "sweep",
        help="any configuration keys, their cross product, one table and a plot per key; "
        "attribution-only keys share one training run (resumable)",
    )
    sw.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=v1,v2,...",
        help="a key and its values (repeatable: the cross product is swept)",
    )
    sw.add_argument("--seeds", default="0", help="seeds: 1,2,3 or 0-4 (default 0)")
    sw.add_argument("--preset", default="tiny", help=PRESET_HELP)
    sw.add_argument("--out", help="experiment folder (default runs/sweep-<keys>)")
    sw.set_defaults(func=_cmd_experiment_sweep)
    tb = exp_sub.add_parser(
        "table",
        help="a named table of the paper (prevalence, subset-size, queries, ratio, "
        "lora-rank, noniid, scalability, partial, noniid-recovery, overhead) as a sweep "
        "(resumable)",
    )
    tb.add_argument("name", metavar="NAME", help="which table")
    tb.add_argument("--seeds", default="0", help="seeds: 1,2,3 or 0-4 (default 0)")
    tb.add_argument("--preset", default="tiny", help=PRESET_HELP)
    tb.add_argument("--out", help="experiment folder (default runs/table-<name>-<preset>)")
    tb.set_defaults(func=_cmd_experiment_table)
    # Last, so that --config/--set follow each command's own options in its help.
    for sp in (em, mech, cal, sw, tb):
        config_options(
            sp, "a .json or .toml file applied to every run", "override a setting in every run"
        )
    em.set_defaults(func=_cmd_experiment_main)
    mech.set_defaults(func=_cmd_experiment_mechanism)
