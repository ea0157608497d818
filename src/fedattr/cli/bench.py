"""``fedattr bench``: SA backends, one run's stages, a round's training against its
arithmetic floor, the reading detector and the verdict, timed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..errors import UserError
from .common import PRESET_HELP, config_options, load_run_config, say


def _cmd_bench_secagg(args: argparse.Namespace) -> int:
    from ..experiments.bench import bench_secagg, format_rows
    from ..secagg import SecAggConfig

    base = SecAggConfig(
        ring_bits=args.ring_bits, frac_bits=args.frac_bits, clip=args.clip, prg=args.prg
    )
    rows = bench_secagg(args.dim, args.members, args.backend, args.repeats, base)
    if args.json:
        print(json.dumps([r.to_dict() for r in rows], indent=2))
    else:
        print(format_rows(rows))
    return 0


def _cmd_bench_pipeline(args: argparse.Namespace) -> int:
    from ..experiments.bench import format_pipeline, pipeline_figures
    from ..experiments.main import run_or_reuse

    if args.rounds is not None and args.rounds < 1:
        raise UserError(f"--rounds: must be >= 1, got {args.rounds}")
    extra = [f"fl.rounds={args.rounds}"] if args.rounds is not None else []
    cfg = load_run_config(args, args.preset, extra)
    out = Path(args.out or f"runs/bench-pipeline-{args.preset}")
    if run_or_reuse(cfg, out, say) is None:
        say(f"{out}: a finished run of this configuration; its figures (remove it to re-measure)")
    fig = pipeline_figures(json.loads((out / "results.json").read_text()))
    (out / "pipeline.json").write_text(json.dumps(fig, indent=2))
    (out / "pipeline.md").write_text(format_pipeline(fig) + "\n")
    print(json.dumps(fig, indent=2) if args.json else format_pipeline(fig))
    return 0


def _report(args: argparse.Namespace, stem: str, figures: Any, markdown: str) -> int:
    """Write ``STEM.json`` and ``STEM.md`` into ``--out`` (when given) and print one of them."""
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}.json").write_text(json.dumps(figures, indent=2))
        (out / f"{stem}.md").write_text(markdown + "\n")
    print(json.dumps(figures, indent=2) if args.json else markdown)
    return 0


def _cmd_bench_scoring(args: argparse.Namespace) -> int:
    from ..experiments.bench import bench_scoring, format_scoring

    cfg = load_run_config(args, args.preset)
    rows = bench_scoring(cfg, args.candidates, args.repeats, say)
    return _report(args, "scoring", rows, format_scoring(rows))


def _cmd_bench_training(args: argparse.Namespace) -> int:
    from ..experiments.bench_training import bench_training, format_training

    cfg = load_run_config(args, args.preset)
    fig = bench_training(cfg, args.repeats, say)
    return _report(args, "training", fig, format_training(fig))


def _cmd_bench_verdicts(args: argparse.Namespace) -> int:
    from ..experiments.bench_verdicts import bench_verdicts, format_verdicts

    fig = bench_verdicts(
        args.clients,
        args.owners,
        args.contexts,
        args.vocab,
        args.rounds,
        args.null_keys,
        args.device,
        mode=args.mode,
        signal=args.signal,
        spill=args.spill,
        block_cells=args.block_cells,
    )
    print(json.dumps(fig, indent=2) if args.json else format_verdicts(fig))
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``bench`` and its subcommands; a benchmark measures this machine's work, so the
    group takes the threads."""
    bench = sub.add_parser("bench", help="benchmarks")
    bench.set_defaults(threads=True)
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    bs = bench_sub.add_parser("secagg", help="ms per subset-sum query per backend vs a plain sum")
    bs.add_argument("--dim", type=int, default=1_000_000, help="coordinates per update")
    bs.add_argument("--members", type=int, default=6, help="clients in the queried subset (N+1)")
    bs.add_argument("--backend", action="append", help="backend to time (repeatable; default all)")
    bs.add_argument("--repeats", type=int, default=3, help="timed repetitions (default 3)")
    bs.add_argument(
        "--ring-bits",
        dest="ring_bits",
        type=int,
        default=64,
        choices=(32, 64),
        help="bits of the fixed-point ring",
    )
    bs.add_argument(
        "--frac-bits",
        dest="frac_bits",
        type=int,
        default=32,
        help="fixed-point fraction bits (default 32)",
    )
    bs.add_argument("--clip", type=float, default=1024.0, help="fixed-point clip bound")
    bs.add_argument(
        "--prg",
        default="auto",
        choices=("auto", "aes-ctr", "chacha20"),
        help="mask generator on the CPU (auto: aes-ctr; other devices: chacha20)",
    )
    bs.add_argument("--json", action="store_true", help="print the timings as JSON")
    bs.set_defaults(func=_cmd_bench_secagg)
    bp = bench_sub.add_parser(
        "pipeline",
        help="one run's per-stage time and throughput: teacher documents/s, training tokens/s "
        "and MFU, SA ms/query, models scored/s, FedAttr overhead",
    )
    bp.add_argument("--preset", default="tiny", help=PRESET_HELP)
    bp.add_argument("--rounds", type=int, help="FL rounds (default: the configuration's)")
    config_options(bp, "a .json or .toml run configuration")
    bp.add_argument("--out", help="run folder (default runs/bench-pipeline-<preset>)")
    bp.add_argument("--json", action="store_true", help="print the stages as JSON")
    bp.set_defaults(func=_cmd_bench_pipeline)
    bsc = bench_sub.add_parser(
        "scoring",
        help="the reading detector over one round's candidates: one at a time vs stacked in one "
        "forward pass, FedIT and FLoRA candidates",
    )
    bsc.add_argument("--preset", default="tiny", help=PRESET_HELP)
    bsc.add_argument(
        "--candidates",
        type=int,
        default=12,
        help="models read together (default 12: a round's reference, K=10 estimates and SA mean)",
    )
    bsc.add_argument("--repeats", type=int, default=2, help="timed repetitions (default 2)")
    config_options(bsc, "a .json or .toml run configuration")
    bsc.add_argument("--out", help="folder for scoring.md and scoring.json")
    bsc.add_argument("--json", action="store_true", help="print the timings as JSON")
    bsc.set_defaults(func=_cmd_bench_scoring)
    bt = bench_sub.add_parser(
        "training",
        help="one round of local training, timed, beside the least time its matrix products "
        "take at this machine's best matrix-product rate (what no scheduling can beat)",
    )
    bt.add_argument("--preset", default="tiny", help=PRESET_HELP)
    bt.add_argument("--repeats", type=int, default=3, help="timed rounds (default 3)")
    config_options(bt, "a .json or .toml run configuration")
    bt.add_argument("--out", help="folder for training.md and training.json")
    bt.add_argument("--json", action="store_true", help="print the figures as JSON")
    bt.set_defaults(func=_cmd_bench_training)
    bv = bench_sub.add_parser(
        "verdicts",
        help="the calibrated statistic's verdict on synthetic changes of a run's size (no model): "
        "time and peak memory of the rounds (standardised, summed), the exact tails, the rank "
        "check",
    )
    bv.add_argument("--clients", type=int, default=10, help="clients K (default 10)")
    bv.add_argument("--owners", type=int, default=3, help="owners' keys (default 3)")
    bv.add_argument(
        "--contexts", type=int, default=550, help="probe contexts (550: the smollm2 preset)"
    )
    bv.add_argument("--vocab", type=int, default=49_152, help="vocabulary (49,152: SmolLM2)")
    bv.add_argument("--rounds", type=int, default=5, help="rounds summed (default 5)")
    bv.add_argument(
        "--null-keys",
        dest="null_keys",
        type=int,
        default=200,
        help="random keys of the rank check (default 200)",
    )
    bv.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="where the changes live"
    )
    bv.add_argument(
        "--mode",
        default="memory",
        choices=["memory", "stream"],
        help="memory: every change and sum held whole (a run's default); stream: sums spilled "
        "to float32 files, rounds and tails read by row blocks",
    )
    bv.add_argument(
        "--signal",
        type=float,
        default=8.0,
        help="the watermarked clients' key-aligned signal, in sd of one round's statistic",
    )
    bv.add_argument("--spill", help="stream mode: folder for the sums (default: a temporary one)")
    bv.add_argument(
        "--block-cells",
        dest="block_cells",
        type=int,
        help="stream mode: cells per row block of a round (default 1,048,576)",
    )
    bv.add_argument("--json", action="store_true", help="print the timings as JSON")
    bv.set_defaults(func=_cmd_bench_verdicts)
