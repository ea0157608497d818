"""The ``fedattr`` command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Sequence

from . import __version__
from .errors import UserError
from .runtime import set_threads


def _cmd_demo(args: argparse.Namespace) -> int:
    from .config import load, to_dict
    from .pipeline.config import DemoConfig
    from .pipeline.run import check_devices, run_demo
    from .reporting.run_folder import RunFolder

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
        print(f"wrote {folder}/: results.json report.md attribution.png rounds.jsonl "
              "queries.jsonl config.json", file=sys.stderr)  # fmt: skip
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        from .reporting.markdown import attribution_table

        print(attribution_table(result.report))
        t = result.timing
        print(
            f"\nSA backend {cfg.secagg.backend}: {result.sa_queries} SA queries; "
            f"total {t['total_s']:.2f} s (SA {t['sa_s']:.2f} s, scoring {t['scoring_s']:.3f} s)"
        )
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from .config import from_dict, load, to_dict
    from .pipeline.config import RunConfig, preset_overrides
    from .pipeline.run import check_inputs, run_experiment
    from .reporting.markdown import attribution_table
    from .reporting.run_folder import RunFolder

    if args.resume:
        # The run folder's resolved config is the configuration: nothing may change on resume.
        if args.config or args.set or args.out:
            raise UserError(
                "--resume: takes the run folder's own config.json; drop --config/--set/--out"
            )
        folder = RunFolder(args.resume, "--resume")
        cfg = from_dict(RunConfig, folder.resumable_config())
        check_inputs(cfg)
    else:
        cfg = load(RunConfig, args.config, preset_overrides(args.preset) + args.set)
        check_inputs(cfg)  # data, key files, model path: before the folder is written
        folder = RunFolder(args.out or _default_run_dir(cfg))
        folder.claim(to_dict(cfg))
    try:
        # A start that fails before its first round leaves no folder to block the re-run.
        with folder.released_on_failure():
            result = run_experiment(cfg, folder=folder)
    except KeyboardInterrupt:
        if folder.status == "new":  # released: no round had finished
            print("fedattr: interrupted before the first round finished; nothing was kept",
                  file=sys.stderr)  # fmt: skip
            return 130
        print(f"fedattr: interrupted; finished rounds are kept: continue with "
              f"'fedattr run --resume {folder}'", file=sys.stderr)  # fmt: skip
        return 130
    result.write(folder)
    folder.clear_checkpoint()
    if cfg.attribution.scoring == "owner":
        print(f"{folder}/rounds/: one folder per round for the owners; each scores them with "
              f"'fedattr owner score --key KEY {folder}/rounds/round-*', then "
              f"'fedattr attribute {folder}' writes the verdicts")  # fmt: skip
        return 0
    print(attribution_table(result.report))
    t = result.timing
    print(
        f"\n{cfg.fl.strategy} / {cfg.watermark.kind.upper()} / {cfg.model.preset}: "
        f"{result.sa_queries} SA queries; "
        f"train {t['train_s']:.1f} s, SA {t['sa_s']:.1f} s, scoring {t['scoring_s']:.1f} s, "
        f"total {t['total_s']:.1f} s (FedAttr overhead {100 * t['overhead']:.0f}% of training)"
    )
    for name, v in result.variants.items():
        print(f"variant {name} ({v['differs']}): flagged {v['flagged']}, "
              f"TPR {v['tpr']}, FPR {v['fpr']}, {v['sa_queries']} SA queries")  # fmt: skip
    print(f"run folder: {folder}")
    return 0


def _parse_seeds(text: str, option: str = "--seeds") -> list[int]:
    """``1,2,3`` or a range ``0-199`` (or both: ``0-9,20``)."""
    out: list[int] = []
    try:
        for part in (x.strip() for x in text.split(",")):
            if not part:
                continue
            lo, sep, hi = part.partition("-")
            out += list(range(int(lo), int(hi) + 1)) if sep and lo else [int(part)]
    except ValueError:
        raise UserError(
            f"{option}: comma-separated integers or ranges, e.g. 1,2,3 or 0-199; got {text!r}"
        ) from None
    return out


def _experiment(run, out: str, summary: str) -> int:
    """Run a resumable experiment into ``out`` (``run(progress)``), then print ``summary``."""
    from pathlib import Path

    try:
        run(lambda m: print(m, file=sys.stderr))
    except KeyboardInterrupt:
        print("fedattr: interrupted; finished runs are kept: re-run the same command to "
              "continue", file=sys.stderr)  # fmt: skip
        return 130
    print(Path(out, summary).read_text())
    print(f"experiment folder: {out}")
    return 0


def _cmd_experiment_calibration(args: argparse.Namespace) -> int:
    from .experiments.calibration import CalibrationSpec, run_calibration

    spec = CalibrationSpec(args.bed, _parse_seeds(args.seeds), _parse_seeds(args.r, "--r"),
                           args.config, args.set, args.jobs)  # fmt: skip
    out = args.out or f"runs/calibration-{args.bed}"
    return _experiment(lambda say: run_calibration(spec, out, say), out, "calibration.md")


def _cmd_experiment_tail_check(args: argparse.Namespace) -> int:
    from .experiments.calibration import tail_check, write_tail_check

    if args.draws < 100:
        raise UserError(f"--draws: Monte Carlo draws per point, >= 100; got {args.draws}")
    from pathlib import Path

    out = Path(args.out)
    write_tail_check(tail_check(args.run_dirs, args.draws), out)
    print((out / "tail-check.md").read_text())
    return 0


def _cmd_experiment_sweep(args: argparse.Namespace) -> int:
    from .experiments.sweep import SweepSpec, parse_grid, run_sweep

    grid = parse_grid(args.grid)
    spec = SweepSpec(grid, _parse_seeds(args.seeds), args.preset, args.config, args.set)
    out = args.out or "runs/sweep-" + "-".join(a.label.rsplit(".", 1)[-1] for a in grid)
    return _experiment(lambda say: run_sweep(spec, out, say), out, "table.md")


def _cmd_experiment_table(args: argparse.Namespace) -> int:
    from .experiments.sweep import run_sweep
    from .experiments.tables import table_spec

    spec = table_spec(args.name, _parse_seeds(args.seeds), args.preset, args.config, args.set)
    out = args.out or f"runs/table-{args.name}-{args.preset}"
    return _experiment(lambda say: run_sweep(spec, out, say), out, "table.md")


def _cmd_experiment_main(args: argparse.Namespace) -> int:
    from .experiments.main import MainSpec, run_main

    spec = MainSpec(args.preset, _parse_seeds(args.seeds), args.config, args.set)
    out = args.out or f"runs/main-{args.preset}"
    return _experiment(lambda say: run_main(spec, out, say), out, "table.md")


def _cmd_experiment_mechanism(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .experiments.main import MainSpec, run_or_reuse
    from .experiments.mechanism import write_mechanism

    if args.watermark not in ("kgw", "fk"):
        raise UserError(f"--watermark: must be kgw or fk, got {args.watermark!r}")
    spec = MainSpec(args.preset, [args.seed], args.config, [f"fl.rounds={args.rounds}", *args.set])
    cfg = spec.run_config(args.strategy, args.watermark, args.seed)
    out = Path(args.out or f"runs/mechanism-{args.preset}-{args.strategy}-{args.watermark}")
    run_dir = out / "run"
    run_or_reuse(cfg, run_dir)
    summary = write_mechanism(run_dir, out)
    print(
        f"m̂ = {summary['m_hat']:.3f}, ε̂ = {summary['eps_hat']:.3f}, ν̂ = {summary['nu_hat']:.3f} "
        f"over {summary['rounds']} rounds"
    )
    print(f"wrote {out}/fig2a..fig2d PNGs and mechanism.json")
    return 0


def _default_run_dir(cfg) -> str:
    import time

    stamp = time.strftime("%Y%m%d-%H%M%S")
    return f"runs/{stamp}-{cfg.fl.strategy}-{cfg.model.preset}"


_PRIVACY_BYTES = (36, 100)
"""Peak bytes of ``fedattr privacy`` per Monte Carlo entry (trials x M x (K-1): the subset
draws and their ranks) and per M K^2 (one round's 2MK x K query matrix and its SVD), measured
with NumPy (33 and 95)."""


def _check_privacy(args: argparse.Namespace) -> None:
    """The numbers of ``fedattr privacy``, and whether this machine can hold the computation."""
    import math

    from .attribution.design import validate_parameters
    from .runtime import available_memory

    if args.trials < 1:
        raise UserError(f"--trials: Monte Carlo draws, must be >= 1, got {args.trials}")
    if not (args.d_star > 0 and math.isfinite(args.d_star)):
        raise UserError(f"--d-star: the effective dimension, must be a number > 0, got "
                        f"{args.d_star:g}")  # fmt: skip
    if not (args.C >= 0 and math.isfinite(args.C)):
        raise UserError(f"--C: must be a number >= 0, got {args.C:g}")
    K, M, trials = args.K, args.M, args.trials
    validate_parameters(K, args.N, M)
    free = available_memory()
    if free is None:
        return
    limit = free // 2
    per_draw, per_mk2 = _PRIVACY_BYTES
    draws, joint = per_draw * trials * M * (K - 1), per_mk2 * M * K * K
    if max(draws, joint) <= limit:
        return
    k_max = min(1 + limit // (per_draw * trials * M), math.isqrt(limit // (per_mk2 * M)))
    fits = (f"at most --K {k_max} with these --M and --trials" if k_max >= 3
            else "lower --M or --trials")  # fmt: skip
    if joint <= limit:
        fits += f", or at most --trials {limit // (per_draw * M * (K - 1))} at this K"

    def gb(n: int) -> str:
        return f"{n / 1e9:,.1f} GB" if n < 1e10 else f"{n / 1e9:,.0f} GB"

    raise UserError(
        f"--K: K={K}, M={M} and {trials} trials need about {gb(max(draws, joint))} of memory "
        f"(Monte Carlo draws {gb(draws)}, one round's joint recovery {gb(joint)}), more than "
        f"the {gb(limit)} allowed here (half the available memory): {fits}"
    )


def _cmd_privacy(args: argparse.Namespace) -> int:
    from .attribution.privacy import summarize

    _check_privacy(args)  # before anything is allocated
    s = summarize(
        args.K, args.N, args.M, d_star=args.d_star, C=args.C, trials=args.trials, seed=args.seed
    )
    if args.json:
        print(json.dumps(s.to_dict(), indent=2))
        return 0
    a, j = s.acceptance, s.joint
    print(f"FedAttr design K={s.K}, N={s.N}, M={s.M}  (rho = N/(K-1) = {s.rho:.4f})")
    print(
        f"  acceptance rate (Monte Carlo, {a.trials} draws): "
        f"{100 * a.rate:.2f}% ± {100 * a.stderr:.2f}%"
    )
    print(f"  threshold aN = (1-rho)/M * N:                     {s.threshold_aN:.4f}")
    print(f"  E[c] before the rule (2/M)N(K-1-N)/(K-1):         {s.expected_c:.4f}")
    print(f"  E[c] over accepted designs:                       {a.mean_c_accepted:.4f}")
    print(f"  E[M_eff] over accepted designs:                   {a.mean_m_eff_accepted:.3f}")
    print(f"  variance factor N(K-1-N)/(K-2):                   {s.variance_factor:.4f}")
    print(f"  SA queries per round (2MK):                       {s.queries_per_round}")
    print(
        f"  Theorem-4 bound, one estimate (d*={s.d_star:g}, C={s.C:g}): "
        f"{s.leakage_bound_nats:.4f} nats"
    )
    print(
        f"  joint release: the round's {j.queries} queries have rank {j.rank} of {s.K}; "
        f"{j.recoverable_clients} of {s.K} updates are EXACTLY recoverable by least squares"
    )
    print("  (the Theorem-4 bound covers one released estimate only; see README, 'Security')")
    return 0


def _cmd_audit(args: argparse.Namespace) -> int:
    from .reporting.markdown import audit_table
    from .reporting.run_folder import audit_run

    rounds = audit_run(args.run_dir)
    if args.json:
        print(json.dumps([r.to_dict() for r in rounds], indent=2))
        return 0
    print(audit_table(rounds))
    exposed = sum(len(r.recoverable) for r in rounds)
    print(
        f"\n{exposed} client-rounds exactly recoverable from the answered queries"
        if exposed
        else "\nno client's update is exactly recoverable in any round"
    )
    return 0


def _cmd_bench_secagg(args: argparse.Namespace) -> int:
    from .experiments.bench import bench_secagg, format_rows
    from .secagg import SecAggConfig

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
    from pathlib import Path

    from .config import load
    from .experiments.bench import format_pipeline, pipeline_figures
    from .experiments.main import run_or_reuse
    from .pipeline.config import RunConfig, preset_overrides

    if args.rounds is not None and args.rounds < 1:
        raise UserError(f"--rounds: must be >= 1, got {args.rounds}")
    extra = [f"fl.rounds={args.rounds}"] if args.rounds is not None else []
    cfg = load(RunConfig, args.config, preset_overrides(args.preset) + args.set + extra)
    out = Path(args.out or f"runs/bench-pipeline-{args.preset}")
    say = lambda m: print(m, file=sys.stderr)  # noqa: E731
    if run_or_reuse(cfg, out, say) is None:
        say(f"{out}: a finished run of this configuration; its figures (remove it to re-measure)")
    fig = pipeline_figures(json.loads((out / "results.json").read_text()))
    (out / "pipeline.json").write_text(json.dumps(fig, indent=2))
    (out / "pipeline.md").write_text(format_pipeline(fig) + "\n")
    print(json.dumps(fig, indent=2) if args.json else format_pipeline(fig))
    return 0


def _cmd_bench_scoring(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .config import load
    from .experiments.bench import bench_scoring, format_scoring
    from .pipeline.config import RunConfig, preset_overrides

    cfg = load(RunConfig, args.config, preset_overrides(args.preset) + args.set)
    say = lambda m: print(m, file=sys.stderr)  # noqa: E731
    rows = bench_scoring(cfg, args.candidates, args.repeats, say)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "scoring.json").write_text(json.dumps(rows, indent=2))
        (out / "scoring.md").write_text(format_scoring(rows) + "\n")
    print(json.dumps(rows, indent=2) if args.json else format_scoring(rows))
    return 0


def _cmd_flower_local(args: argparse.Namespace) -> int:
    import importlib.util
    import time

    from .config import load, to_dict
    from .pipeline.config import DemoConfig, RunConfig, preset_overrides
    from .reporting.run_folder import RunFolder

    if importlib.util.find_spec("flwr") is None:
        raise UserError("flower: Flower is not installed; pip install 'fedattr[flower]'")
    from .flower.launch import run_loopback

    command = "demo" if args.demo else "run"
    if args.resume:
        # The folder's own configuration: nothing may change on resume (as fedattr run).
        if args.config or args.set or args.out or args.preset or args.demo:
            raise UserError("--resume: takes the run folder's own config.json; drop "
                            "--config/--set/--out/--preset/--demo")  # fmt: skip
        from .config import from_dict

        folder = RunFolder(args.resume, "--resume")
        cfg = from_dict(RunConfig, folder.resumable_config())
        default = None
    elif args.demo:
        if args.preset:
            raise UserError("--preset: for LLM runs; drop it with --demo")
        cfg = load(DemoConfig, args.config, args.set)
        default = f"runs/{time.strftime('%Y%m%d-%H%M%S')}-flower-demo"
    else:
        cfg = load(RunConfig, args.config, preset_overrides(args.preset or "tiny") + args.set)
        default = f"{_default_run_dir(cfg)}-flower"
    node_config = {}
    for item in args.node_config:
        key, sep, value = item.partition("=")
        if not sep or not key or key == "partition-id":
            raise UserError(
                f"--node-config: KEY=VALUE (e.g. min-members=5; partition-id is set per node), "
                f"got {item!r}"
            )
        from .config import parse_scalar

        node_config[key] = parse_scalar(value)
    if not args.timeout > 0:
        raise UserError(f"--timeout: must be > 0 seconds, got {args.timeout}")
    # Everything checkable before a folder is written or a process started (as the ServerApp
    # would check it, 10 s of SuperLink and SuperNodes later).
    from .flower.server_app import check_settings

    check_settings(cfg, command)
    from .pipeline.run import check_devices, check_inputs

    # Loopback: every node runs on this machine, so its hardware is the nodes' hardware.
    if command == "run":
        check_inputs(cfg)  # check_devices, then data, key files, model path
    else:
        check_devices(cfg)
    if default is not None:
        folder = RunFolder(args.out or default)
        folder.claim(to_dict(cfg))  # before any process starts: a bad --out costs nothing
    data = run_loopback(
        command, cfg, folder, message_timeout=args.timeout, node_config=node_config,
        say=lambda m: print(m, file=sys.stderr),
    )  # fmt: skip
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(folder.file("report.md").read_text())
        loop = data["runtime"]["loopback"]
        print(f"\nFlower loopback: {data['runtime']['messages']} messages, "
              f"{data['runtime']['sa_exchanges']} SA exchanges; federation ready in "
              f"{loop['nodes_ready_s']:.1f} s, run {loop['run_s']:.1f} s")  # fmt: skip
    print(f"run folder: {folder}", file=sys.stderr)
    return 0


def _cmd_flower_app(args: argparse.Namespace) -> int:
    from .flower.launch import write_app

    path = write_app(args.folder)
    print(f"wrote {path}/pyproject.toml: submit it with flwr run {path} <superlink> "
          "--run-config \"run-folder='/abs/run/folder' config='/abs/run.toml'\"")  # fmt: skip
    return 0


def _model_config(spec: str, cache_dir: str = "", option: str = "--model"):
    """``tiny``, ``smollm2`` / ``smollm2-135m``, or any Hugging Face id or local path (a
    missing path is refused here, naming ``option``)."""
    from .models.config import ModelConfig
    from .models.loading import check_model_source

    if spec == "tiny":
        return ModelConfig(preset="tiny", cache_dir=cache_dir)
    if spec in ("smollm2", "smollm2-135m"):
        return ModelConfig(preset="smollm2-135m")
    return ModelConfig(preset="hf", name_or_path=check_model_source(spec, option))


def _owner_texts(path: str | None, count: int):
    from .data.corpus import generate_corpus
    from .data.loaders import record_from_mapping
    from .data.records import Record
    from .owner.corpus import read_rows

    if path is None:
        # held out from the embedded corpus's training seeds
        return generate_corpus(count, seed=9_999)
    rows = read_rows(path, "--texts")
    records: list[Record] = [record_from_mapping(r) for r in rows[:count]]
    return records


def _say(message: str) -> None:
    print(message, file=sys.stderr)


def _cmd_owner_keygen(args: argparse.Namespace) -> int:
    from .watermarks.keys import generate_key, save_key

    params: dict = {}
    if args.kind == "kgw":
        params = {"gamma": args.gamma, "delta": args.delta, "scheme": args.scheme}
        if args.hash_key is not None:
            if args.scheme == "fedattr":
                raise UserError("--hash-key: only with --scheme lm-watermarking or markllm")
            params["hash_key"] = args.hash_key
    else:
        if args.scheme != "fedattr" or args.hash_key is not None:
            raise UserError("--scheme/--hash-key: for kgw keys only")
        params = {"domain": args.domain}
    key = generate_key(args.kind, **params)
    path = save_key(key, args.out)
    print(f"wrote {path} (mode 0600): {key.describe()}")
    print(f"fingerprint (public): {key.fingerprint}")
    return 0


def _cmd_owner_watermark(args: argparse.Namespace) -> int:
    from .models.loading import load_model
    from .owner.corpus import check_job, fk_documents, read_rows, watermark_kgw
    from .watermarks.keys import load_key

    key = load_key(args.key)
    # The numbers and --out before a model is loaded or a progress file written.
    check_job(args.out, chunk=args.chunk, max_new_tokens=args.max_new_tokens,
              min_tokens=args.min_tokens)  # fmt: skip
    if key.kind == "fk":
        if args.input is not None:
            raise UserError("--in: a Fictitious-Knowledge key writes new documents; use --count")
        if args.count < 1:
            raise UserError(f"--count: must be >= 1, got {args.count}")
        model = tokenizer = None
        if args.writer == "teacher":
            model, tokenizer = load_model(_model_config(args.model, args.cache_dir), _say)
        report = fk_documents(key, args.count, args.out, writer=args.writer, model=model,
                              tokenizer=tokenizer, max_new_tokens=args.max_new_tokens)  # fmt: skip
    else:
        if args.input is None:
            raise UserError("--in: the corpus to watermark (.jsonl or .json, Alpaca or chat rows)")
        rows = read_rows(args.input)
        model, tokenizer = load_model(_model_config(args.model, args.cache_dir), _say)
        report = watermark_kgw(
            key, rows, model, tokenizer, args.out, model_name=args.model, chunk=args.chunk,
            max_new_tokens=args.max_new_tokens, min_tokens=args.min_tokens, say=_say,
        )  # fmt: skip
    print(json.dumps(report, indent=2))
    return 0


def _cmd_owner_detect(args: argparse.Namespace) -> int:
    from .models.loading import load_model
    from .owner.detect import detect_kgw
    from .watermarks.keys import load_key

    key = load_key(args.key, "kgw")
    if args.lora and args.reference:
        raise UserError("--lora/--reference: give one (the reference is the model without "
                        "its adapter, or another model)")  # fmt: skip
    detectors = ["reading", "greedy"] if args.detector == "both" else [args.detector]
    # Everything checkable before a model is loaded (seconds to minutes).
    if "reading" in detectors and not (args.lora or args.reference):
        raise UserError("--reference: the reading test needs the model the candidate was "
                        "fine-tuned from (--lora ADAPTER, or --reference MODEL); or use "
                        "--detector greedy")  # fmt: skip
    if args.count < 1:
        raise UserError(f"--count: texts used, must be >= 1, got {args.count}")
    if "reading" in detectors and args.null_keys < 20:
        raise UserError(f"--null-keys: must be >= 20, got {args.null_keys}")
    texts = _owner_texts(args.texts, args.count)
    config = _model_config(args.model, args.cache_dir)
    reference_config = (_model_config(args.reference, args.cache_dir, "--reference")
                        if args.reference else None)  # fmt: skip
    model, tokenizer = load_model(config, _say)
    reference = None
    if args.lora:
        from peft import PeftModel

        try:
            model = PeftModel.from_pretrained(model, args.lora)
        except Exception as exc:  # a missing or foreign adapter folder: one line
            raise UserError(f"--lora: could not load an adapter from {args.lora!r}: "
                            f"{str(exc).strip().splitlines()[0]}") from exc  # fmt: skip
        model.eval()
    elif reference_config is not None:
        reference, _ = load_model(reference_config, _say)
    out = detect_kgw(key, model, tokenizer, texts,
                     reference=reference, lora=bool(args.lora), detectors=detectors,
                     null_keys=args.null_keys)  # fmt: skip
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"key {out['key']}, {out['texts']} texts")
    if "reading" in out:
        r = out["reading"]
        p = f"{r['p']:.3g}" if r["p"] > 0 else f"1e{r['log10_p']:.0f}"
        print(f"reading: statistic {r['statistic']:+.4g} (null sd {r['null_sd']:.3g}), z = "
              f"{r['z']:+.2f}: p = {p} ({r['tail']} tail; rank p among {r['null_keys']} "
              f"random keys = {r['p_rank']:.3g})")  # fmt: skip
    if "greedy" in out:
        g = out["greedy"]
        print(f"greedy: {g['green']} green of {g['scored']} scored pairs: z = {g['z']:+.2f}, "
              f"p = {g['p']:.3g}")  # fmt: skip
    return 0


def _cmd_owner_score(args: argparse.Namespace) -> int:
    from .owner.score import score_rounds
    from .watermarks.keys import load_key

    key = load_key(args.key, "kgw")
    texts = _owner_texts(args.texts, args.count) if args.texts else None
    for path in score_rounds(key, args.rounds, texts, _say):
        print(path)
    return 0


def _cmd_owner_check(args: argparse.Namespace) -> int:
    from .models.loading import ModelLoadError, load_tokenizer
    from .owner.check import check_documents, format_report, read_documents, watermark_report_model
    from .watermarks.keys import load_key

    key = load_key(args.key, "kgw")
    docs = read_documents(args.input, args.field)
    spec, origin = args.model, ""
    if spec is None:
        spec = watermark_report_model(args.input, key)
        origin = f" (from {args.input}.report.json)" if spec else ""
        spec = spec or "tiny"
    try:
        tokenizer = load_tokenizer(_model_config(spec, args.cache_dir), _say)
    except ModelLoadError as exc:
        raise UserError(f"--model {spec!r}: the key's tokenizer is not available ({exc}); give "
                        "the --model the corpus was watermarked with (tiny, smollm2, a HF id or "
                        "a local path)") from exc  # fmt: skip
    report = check_documents(key, tokenizer, docs, dedupe=not args.no_dedupe,
                             tokenizer_name=spec + origin, source=args.input,
                             field=args.field)  # fmt: skip
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        format_report(report, print)
    return 0


def _cmd_attribute(args: argparse.Namespace) -> int:
    from .attribution.offline import attribute_run
    from .reporting.markdown import attribution_table
    from .reporting.run_folder import RunFolder

    report, owners = attribute_run(args.run)
    RunFolder(args.run, "RUN_DIR").write_owner_scored(report, owners)
    print(attribution_table(report))
    print(f"wrote {args.run}/results.json, attribution.json, report.md", file=sys.stderr)
    return 0


_PRESET_HELP = "tiny (default, CPU) or smollm2 (GPU)"


def _config_options(
    parser: argparse.ArgumentParser, config_help: str, set_help: str = "override a setting"
) -> None:
    """``--config FILE`` and the repeatable ``--set KEY=VALUE`` of every configured command."""
    parser.add_argument("--config", help=config_help)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help=f"{set_help} (repeatable)")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for docs and tests)."""
    p = argparse.ArgumentParser(
        prog="fedattr",
        description="Client-level watermark attribution in federated LLM fine-tuning under "
        "secure aggregation.",
    )
    p.add_argument("--version", action="version", version=f"fedattr {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo-protocol",
        help="the protocol demo: a synthetic federation of plain vectors through SA and FedAttr "
        "(no language model; the embedded default job is 'fedattr run')",
    )
    _config_options(demo, "a .json or .toml file with [synthetic], [secagg], [attribution]",
                    "override a setting, e.g. --set attribution.M=10")  # fmt: skip
    demo.add_argument("--out", help="write results.json, report.md, rounds.jsonl here")
    demo.add_argument("--json", action="store_true", help="print results as JSON")
    demo.add_argument("--quiet", action="store_true", help="no per-round progress lines")
    demo.set_defaults(func=_cmd_demo)

    run = sub.add_parser(
        "run",
        help="federated LoRA fine-tuning with watermarked clients (KGW or FK), SA and FedAttr",
    )
    run.add_argument("--preset", default="tiny", help=_PRESET_HELP)
    _config_options(run, "a .json or .toml file (sections: model, lora, data, watermark, fl, "
                    "secagg, attribution)", "override a setting, e.g. --set fl.strategy=flora")
    run.add_argument("--out", help="run folder (default: runs/<time>-<strategy>-<model>)")
    run.add_argument(
        "--resume", metavar="RUN_DIR", help="continue an interrupted run after its last round"
    )
    run.set_defaults(func=_cmd_run)

    exp = sub.add_parser(
        "experiment", help="Table 1 (main), Figure 2 (mechanism), calibration, sweeps"
    )
    exp_sub = exp.add_subparsers(dest="experiment", required=True)
    em = exp_sub.add_parser(
        "main", help="{FedIT, FLoRA} x {KGW, FK} x seeds: FedAttr and the baselines (resumable)"
    )
    em.add_argument("--preset", default="tiny", help=_PRESET_HELP)
    em.add_argument("--seeds", default="1,2,3", help="comma-separated seeds (default 1,2,3)")
    em.add_argument("--out", help="experiment folder (default runs/main-<preset>)")
    mech = exp_sub.add_parser("mechanism", help="Figure 2's four panels from one run")
    mech.add_argument("--preset", default="tiny", help=_PRESET_HELP)
    mech.add_argument("--strategy", default="fedit", help="fedit (default) or flora")
    mech.add_argument("--watermark", default="kgw", help="kgw (default) or fk")
    mech.add_argument("--seed", type=int, default=1)
    mech.add_argument("--rounds", type=int, default=5, help="FL rounds T (default 5)")
    mech.add_argument("--out", help="folder (default runs/mechanism-<preset>-<strategy>-<wm>)")
    cal = exp_sub.add_parser(
        "calibration", help="empirical FPR of null p-values, QQ plot, family-wise TPR (resumable)"
    )
    cal.add_argument("--bed", default="synthetic", help="synthetic (default), tiny or smollm2")
    cal.add_argument("--seeds", default="0-199", help="seeds: 1,2,3 or 0-199 (default 0-199)")
    cal.add_argument("--r", default="0,3", help="watermarked clients per run (default 0,3)")
    cal.add_argument("--out", help="experiment folder (default runs/calibration-<bed>)")
    cal.add_argument("--jobs", type=int, default=1,
                     help="runs in parallel processes, one thread each (default 1)")  # fmt: skip
    cal.set_defaults(func=_cmd_experiment_calibration)
    tc = exp_sub.add_parser(
        "tail-check", help="the verdict's exact tail against tilted Monte Carlo on saved runs"
    )
    tc.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                    help="run folders with changes.safetensors")  # fmt: skip
    tc.add_argument("--draws", type=int, default=4000, help="random keys per point (4000)")
    tc.add_argument("--out", default="runs/tail-check", help="where tail-check.md/json go")
    tc.set_defaults(func=_cmd_experiment_tail_check)
    sw = exp_sub.add_parser(
        "sweep",
        help="any configuration keys, their cross product, one table and a plot per key; "
        "attribution-only keys share one training run (resumable)",
    )
    sw.add_argument("--grid", action="append", default=[], metavar="KEY=v1,v2,...",
                    help="a key and its values (repeatable: the cross product is swept)")
    sw.add_argument("--seeds", default="0", help="seeds: 1,2,3 or 0-4 (default 0)")
    sw.add_argument("--preset", default="tiny", help=_PRESET_HELP)
    sw.add_argument("--out", help="experiment folder (default runs/sweep-<keys>)")
    sw.set_defaults(func=_cmd_experiment_sweep)
    tb = exp_sub.add_parser(
        "table", help="a named table of the paper (prevalence, subset-size, queries, ratio, "
        "lora-rank, noniid, scalability, partial, noniid-recovery, overhead) as a sweep "
        "(resumable)",
    )  # fmt: skip
    tb.add_argument("name", metavar="NAME", help="which table")
    tb.add_argument("--seeds", default="0", help="seeds: 1,2,3 or 0-4 (default 0)")
    tb.add_argument("--preset", default="tiny", help=_PRESET_HELP)
    tb.add_argument("--out", help="experiment folder (default runs/table-<name>-<preset>)")
    tb.set_defaults(func=_cmd_experiment_table)
    for sp in (em, mech, cal, sw, tb):
        _config_options(sp, "a .json or .toml file applied to every run",
                        "override a setting in every run")  # fmt: skip
    em.set_defaults(func=_cmd_experiment_main)
    mech.set_defaults(func=_cmd_experiment_mechanism)

    priv = sub.add_parser("privacy", help="acceptance rate, variance and leakage of a design")
    priv.add_argument("--K", type=int, default=10, help="participating clients (default 10)")
    priv.add_argument("--N", type=int, default=5, help="subset size N (default 5)")
    priv.add_argument("--M", type=int, default=5, help="query pairs per target (default 5)")
    priv.add_argument(
        "--d-star",
        dest="d_star",
        type=float,
        default=1.0,
        help="effective dimension d* of an update (default 1: per dimension)",
    )
    priv.add_argument(
        "--C",
        type=float,
        default=0.0,
        help="Theorem-4 constant C of the second term (default 0: Gaussian term only)",
    )
    priv.add_argument(
        "--trials", type=int, default=20_000, help="Monte Carlo draws (default 20000)"
    )
    priv.add_argument("--seed", type=int, default=0)
    priv.add_argument("--json", action="store_true")
    priv.set_defaults(func=_cmd_privacy)

    audit = sub.add_parser(
        "audit", help="what a run's SA answers reveal: exact recovery and joint leakage per round"
    )
    audit.add_argument("run_dir", metavar="RUN_DIR", help="a folder written with --out")
    audit.add_argument("--json", action="store_true")
    audit.set_defaults(func=_cmd_audit)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    bs = bench_sub.add_parser("secagg", help="ms per subset-sum query per backend vs a plain sum")
    bs.add_argument("--dim", type=int, default=1_000_000, help="coordinates per update")
    bs.add_argument("--members", type=int, default=6, help="clients in the queried subset (N+1)")
    bs.add_argument("--backend", action="append", help="backend to time (repeatable; default all)")
    bs.add_argument("--repeats", type=int, default=3)
    bs.add_argument("--ring-bits", dest="ring_bits", type=int, default=64, choices=(32, 64))
    bs.add_argument("--frac-bits", dest="frac_bits", type=int, default=32)
    bs.add_argument("--clip", type=float, default=1024.0, help="fixed-point clip bound")
    bs.add_argument("--prg", default="auto", choices=("auto", "aes-ctr", "chacha20"),
                    help="mask generator on the CPU (auto: aes-ctr; other devices: chacha20)")
    bs.add_argument("--json", action="store_true")
    bs.set_defaults(func=_cmd_bench_secagg)
    bp = bench_sub.add_parser(
        "pipeline",
        help="one run's per-stage time and throughput: teacher documents/s, training tokens/s "
        "and MFU, SA ms/query, models scored/s, FedAttr overhead",
    )
    bp.add_argument("--preset", default="tiny", help=_PRESET_HELP)
    bp.add_argument("--rounds", type=int, help="FL rounds (default: the configuration's)")
    _config_options(bp, "a .json or .toml run configuration")
    bp.add_argument("--out", help="run folder (default runs/bench-pipeline-<preset>)")
    bp.add_argument("--json", action="store_true")
    bp.set_defaults(func=_cmd_bench_pipeline)
    bsc = bench_sub.add_parser(
        "scoring",
        help="the reading detector over one round's candidates: one at a time vs stacked in one "
        "forward pass, FedIT and FLoRA candidates",
    )
    bsc.add_argument("--preset", default="tiny", help=_PRESET_HELP)
    bsc.add_argument("--candidates", type=int, default=12,
                     help="models read together (default 12: a round's reference, K=10 "
                     "estimates and SA mean)")  # fmt: skip
    bsc.add_argument("--repeats", type=int, default=2)
    _config_options(bsc, "a .json or .toml run configuration")
    bsc.add_argument("--out", help="folder for scoring.md and scoring.json")
    bsc.add_argument("--json", action="store_true")
    bsc.set_defaults(func=_cmd_bench_scoring)
    flower = sub.add_parser("flower", help="run fedattr on Flower (SuperLink, SuperNodes)")
    flower_sub = flower.add_subparsers(dest="flower", required=True)
    fl = flower_sub.add_parser(
        "local",
        help="a whole federation on this machine: SuperLink + one SuperNode per client",
    )
    fl.add_argument("--demo", action="store_true", help="the synthetic federation (no LLM)")
    fl.add_argument("--preset", help="tiny (default) or smollm2; LLM runs only")
    _config_options(fl, "the same .json/.toml file fedattr run (or --demo: demo-protocol) "
                    "reads")  # fmt: skip
    fl.add_argument("--out", help="run folder (default: runs/<time>-...-flower)")
    fl.add_argument("--timeout", type=float, default=600.0,
                    help="seconds a node has to answer one message (default 600)")  # fmt: skip
    fl.add_argument("--node-config", action="append", default=[], metavar="KEY=VALUE",
                    help="a SuperNode setting for every node, e.g. min-members=5")  # fmt: skip
    fl.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted LLM run "
                    "after its last finished round (its own configuration)")  # fmt: skip
    fl.add_argument("--json", action="store_true", help="print results.json")
    fl.set_defaults(func=_cmd_flower_local)
    fa = flower_sub.add_parser("app", help="write the Flower app project for flwr run")
    fa.add_argument("folder", help="where to write pyproject.toml")
    fa.set_defaults(func=_cmd_flower_app)

    owner = sub.add_parser("owner", help="the corpus owner's steps: keys, watermarking, tests")
    owner_sub = owner.add_subparsers(dest="owner", required=True)
    kg = owner_sub.add_parser("keygen", help="write a new secret key file (mode 0600)")
    kg.add_argument("--out", required=True, help="the key file to create (never overwritten)")
    kg.add_argument("--kind", choices=("kgw", "fk"), default="kgw",
                    help="kgw (green-list watermark, default) or fk (Fictitious Knowledge)")
    kg.add_argument("--scheme", choices=("fedattr", "lm-watermarking", "markllm"),
                    default="fedattr", help="KGW seeding: fedattr (256-bit keyed PRF), or a "
                    "reference code's (lm-watermarking simple_1, MarkLLM KGW)")  # fmt: skip
    kg.add_argument("--hash-key", type=int, help="reference schemes: the corpus's hash key "
                    "(default 15485863, the references' default)")  # fmt: skip
    kg.add_argument("--gamma", type=float, default=0.25, help="KGW green fraction")
    kg.add_argument("--delta", type=float, default=3.0, help="KGW logit bias")
    kg.add_argument("--domain", type=int, help="FK: the entity's domain index (default random)")
    kg.set_defaults(func=_cmd_owner_keygen)
    ow = owner_sub.add_parser("watermark", help="watermark a corpus (KGW) or write FK documents")
    ow.add_argument("--key", required=True, help="the owner's key file (kgw or fk)")
    ow.add_argument("--in", dest="input", help="KGW: the corpus (.jsonl/.json, Alpaca or chat)")
    ow.add_argument("--out", required=True, help="the watermarked corpus (same form as --in)")
    ow.add_argument("--model", default="tiny", help="tiny, smollm2, or a HF id or local path")
    ow.add_argument("--cache-dir", default="", help="tiny preset's cache folder")
    ow.add_argument("--chunk", type=int, default=64, help="documents per batch and checkpoint")
    ow.add_argument("--max-new-tokens", type=int, default=256,
                    help="longest rewritten response, in tokens (default 256)")  # fmt: skip
    ow.add_argument("--min-tokens", type=int, default=8,
                    help="drop rewritten responses shorter than this")  # fmt: skip
    ow.add_argument("--count", type=int, default=100, help="FK: documents to write")
    ow.add_argument("--writer", choices=("template", "teacher"), default="template",
                    help="FK: templates, or the model writes each document")  # fmt: skip
    ow.set_defaults(func=_cmd_owner_watermark)
    oc = owner_sub.add_parser(
        "check", help="is this text watermarked under my key? green count, z and exact p per "
        "document and for the whole input (KGW)",
        description="Test texts for the key: per document and for the whole input, the green "
        "count of the distinct (previous token, token) pairs, z, and the exact binomial p "
        "(log10_p stays finite for tiny p). Fixed-size green lists make the binomial slightly "
        "conservative in the tail: log10_p_fixed_lists is the exact tail under them "
        "(hypergeometric per context). See README, 'For corpus owners'.",
    )  # fmt: skip
    oc.add_argument("--key", required=True, help="the owner's KGW key file (any --scheme)")
    oc.add_argument("--in", dest="input", required=True, metavar="TEXTS",
                    help="a .txt file (one document), .jsonl/.json rows (Alpaca or chat: one "
                    "document per row), or - for standard input")  # fmt: skip
    oc.add_argument("--field", help="Alpaca rows: the field scored (default output); chat "
                    "rows: the role whose turns are scored (default assistant)")  # fmt: skip
    oc.add_argument("--model", help="whose tokenizer: the --model the corpus was watermarked "
                    "with (tiny, smollm2, a HF id or local path; default: the one recorded in "
                    "TEXTS.report.json by owner watermark, else tiny)")  # fmt: skip
    oc.add_argument("--cache-dir", default="", help="tiny preset's cache folder")
    oc.add_argument("--no-dedupe", action="store_true",
                    help="score every pair, repeats too, as MarkLLM's detector does (p is then "
                    "anti-conservative on repetitive text)")  # fmt: skip
    oc.add_argument("--json", action="store_true", help="print the report as JSON")
    oc.set_defaults(func=_cmd_owner_check)
    od = owner_sub.add_parser("detect", help="test a released model for the key (KGW)")
    od.add_argument("--key", required=True, help="the owner's KGW key file")
    od.add_argument("--model", required=True, help="the released model to test: tiny, smollm2, "
                    "or a HF id or local path")  # fmt: skip
    od.add_argument("--lora", help="a peft adapter folder on --model (its reference: --model)")
    od.add_argument("--reference", help="reading: the model the candidate was fine-tuned from "
                    "(tiny, smollm2, a HF id or local path; same tokenizer)")  # fmt: skip
    od.add_argument("--texts", help="texts to read (.jsonl/.json); default: embedded corpus")
    od.add_argument("--count", type=int, default=128,
                    help="texts used: the first N of --texts (default 128)")  # fmt: skip
    od.add_argument("--detector", choices=("reading", "greedy", "both"), default="both",
                    help="reading (needs --lora or --reference), greedy, or both "
                    "(default)")  # fmt: skip
    od.add_argument("--null-keys", type=int, default=1000,
                    help="reading: random keys the key's statistic is ranked among (>= 20, "
                    "default 1000)")  # fmt: skip
    od.add_argument("--cache-dir", default="", help="tiny preset's cache folder")
    od.add_argument("--json", action="store_true", help="print the results as JSON")
    od.set_defaults(func=_cmd_owner_detect)
    osc = owner_sub.add_parser("score", help="score a run's released round folders with the key")
    osc.add_argument("--key", required=True, help="the owner's KGW key file")
    osc.add_argument("rounds", nargs="+", metavar="ROUND_DIR", help="<run>/rounds/round-NNN")
    osc.add_argument("--texts", help="texts to read (.jsonl/.json); default: the run's "
                     "held-out detection texts")  # fmt: skip
    osc.add_argument("--count", type=int, default=128, help="texts used with --texts")
    osc.set_defaults(func=_cmd_owner_score)
    att = sub.add_parser("attribute", help="combine the owners' round scores into results")
    att.add_argument("run", metavar="RUN_DIR", help="a run folder with scored rounds/")
    att.set_defaults(func=_cmd_attribute)

    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse, run, and turn bad input (:class:`UserError`) into one clear line
    (exit code 2). Anything else is a bug and keeps its traceback."""
    args = build_parser().parse_args(argv)
    try:
        if args.command in ("run", "experiment", "demo-protocol", "bench", "flower", "owner",
                            "attribute"):
            set_threads()  # a busy machine's note is shown when a run starts work
        return args.func(args)
    except UserError as exc:
        print(f"fedattr: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fedattr: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        if not _stdout_closed():
            raise  # some other pipe: a bug, with its traceback
        # The reader of our output stopped (``| head``): what it wanted has been written.
        # Point stdout at /dev/null so the interpreter's last flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a command its pipe ended


def _stdout_closed() -> bool:
    """Whether standard output is a pipe whose reading end is gone."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & select.POLLERR for _, event in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no real file descriptor
        return False


if __name__ == "__main__":
    sys.exit(main())
