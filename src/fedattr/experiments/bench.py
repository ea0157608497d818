"""Benchmarks: ``bench secagg`` (milliseconds per subset-sum query for each SA backend vs a
plain sum), ``bench pipeline`` (a run's timings by stage) and ``bench scoring`` (the reading
detector's candidates per second); ``bench verdicts`` is :mod:`.bench_verdicts`."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..errors import UserError
from ..reporting.markdown import table
from ..secagg import BACKENDS, SecAggConfig, make_aggregator


@dataclass
class BenchRow:
    """Timing of one backend (or the plain-sum baseline) on one device."""

    backend: str
    device: str
    dim: int
    members: int
    ms_per_query: float
    client_ms_max: float
    upload_ms: float
    bytes_per_query: int
    ratio_to_plain_sum: float

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return asdict(self)


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued kernels, so a timer reads finished work."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


PLAIN_SUM_REPEATS = 5
"""Fewest timed plain sums: each takes milliseconds, so a few more cost nothing and steady the
median every ``× plain sum`` is divided by."""


def _plain_sum_ms(vectors: Sequence[torch.Tensor], device: str, repeats: int) -> float:
    """Median milliseconds of one plain sum, timed as the backends are: one untimed warm-up
    (the first sum starts torch's threads, allocates and faults in pages; a GPU compiles), then
    at least :data:`PLAIN_SUM_REPEATS` timed sums."""
    xs = [v.to(device) for v in vectors]

    def plain_sum() -> torch.Tensor:
        total = xs[0].clone()
        for x in xs[1:]:
            total += x
        return total

    plain_sum()  # warm-up
    times = []
    for _ in range(max(repeats, PLAIN_SUM_REPEATS)):
        synchronize(device)
        t0 = time.perf_counter()
        plain_sum()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def bench_secagg(
    dim: int,
    members: int,
    backends: Sequence[str] | None = None,
    repeats: int = 3,
    base: SecAggConfig | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[BenchRow]:
    """Time ``repeats`` queries over ``members`` clients of ``dim`` float32 coordinates each."""
    if dim < 1:
        raise UserError(f"--dim: must be >= 1, got {dim}")
    if members < 2:
        # one member's "secure sum" is its own update: no pair to mask, nothing to time
        raise UserError(
            f"--members: clients in the queried subset, must be >= 2 (a sum of one client is "
            f"its update), got {members}"
        )
    if repeats < 1:
        raise UserError(f"--repeats: must be >= 1, got {repeats}")
    names = list(backends or BACKENDS)
    unknown = [b for b in names if b not in BACKENDS]
    if unknown:
        raise UserError(f"--backend: unknown {unknown}; allowed: {', '.join(BACKENDS)}")
    say = progress or (lambda msg: print(msg, file=sys.stderr))
    gen = torch.Generator().manual_seed(0)
    vectors = [torch.randn(dim, generator=gen) * 1e-2 for _ in range(members)]
    rows = []
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    plain = {d: _plain_sum_ms(vectors, d, repeats) for d in devices}
    for d in devices:
        rows.append(BenchRow("plain-sum", d, dim, members, plain[d], 0.0, 0.0, 0, 1.0))
    base = base or SecAggConfig()
    for name in names:
        # Plaintext sums float64 NumPy vectors on the host; the masked backends run on every
        # device torch offers (the masks, shares and ring sums live there).
        for device in devices if name != "plaintext" else ["cpu"]:
            say(
                f"benchmarking {name} on {device} (dim={dim}, members={members}, repeats={repeats})"
            )
            cfg = SecAggConfig(
                backend=name,
                min_members=min(base.min_members, members),
                ring_bits=base.ring_bits,
                frac_bits=base.frac_bits,
                clip=base.clip,
                prg=base.prg if device == "cpu" else "chacha20",
                device=device,
            )
            sa = make_aggregator(cfg)
            sa.open_round(0, range(members))
            t0 = time.perf_counter()
            for j, v in enumerate(vectors):
                sa.submit(j, v)
            upload_ms = 1000 * (time.perf_counter() - t0) / members
            sa.subset_sum_flat(range(members))  # warm-up (kernel compilation on a GPU)
            for _ in range(repeats):
                sa.subset_sum_flat(range(members))
            sa.close_round()
            log = sa.log[-repeats:]
            ms = 1000 * statistics.median(r.seconds for r in log)
            client_ms = 1000 * statistics.median(r.client_seconds_max for r in log)
            rows.append(
                BenchRow(
                    name,
                    device,
                    dim,
                    members,
                    ms,
                    client_ms,
                    upload_ms,
                    log[-1].bytes_moved,
                    ms / plain[device],
                )
            )
    return rows


def format_rows(rows: Sequence[BenchRow]) -> str:
    """Markdown table of benchmark rows."""
    head = [
        "backend",
        "device",
        "dim",
        "members",
        "ms/query",
        "slowest client ms",
        "upload ms/client",
        "MB moved/query",
        "× plain sum",
    ]
    return table(
        head,
        (
            [
                r.backend,
                r.device,
                f"{r.dim:,}",
                r.members,
                f"{r.ms_per_query:.1f}",
                f"{r.client_ms_max:.1f}",
                f"{r.upload_ms:.1f}",
                f"{r.bytes_per_query / 1e6:.1f}",
                f"{r.ratio_to_plain_sum:.1f}",
            ]
            for r in rows
        ),
    )


# Dense bf16 tensor-core peaks (FLOP/s) of the GPUs the project runs on, for MFU.
_GPU_PEAK = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}


def _peak_flops(gpu: str | None) -> float | None:
    for name, peak in _GPU_PEAK.items():
        if gpu and name in gpu:
            return peak
    return None


# Stages as a run's memory profile names them (its Stopwatch's keys) -> as the bench does.
_STAGE_OF = {"train": "training"}


def pipeline_figures(results: dict) -> dict:
    """Per-stage seconds, work and throughput from a run's ``results.json`` content."""
    t, work = results["timing"], results.get("work", {})
    model = results.get("model", {})
    tokens, params = work.get("train_tokens", 0.0), float(model.get("parameters", 0))
    # 6 N FLOPs per token is the usual MFU convention; LoRA training of frozen weights does
    # about 4 N (no weight gradients), so MFU here is an upper bound on useful work.
    flops = 6.0 * params * tokens / t["train_s"] if t["train_s"] > 0 else 0.0
    on_gpu = str(model.get("device", "")).startswith("cuda")
    peak = _peak_flops(model.get("gpu")) if on_gpu else None
    queries = results.get("sa_queries", 0)
    scored = work.get("models_scored", 0.0)
    docs = work.get("teacher_documents", 0.0)

    def rate(n: float, s: float) -> float | None:
        return n / s if s > 0 and n else None

    teacher_s = t.get("teacher_s", 0.0)
    stages = {
        "load": {"seconds": t.get("load_s", 0.0)},
        "teacher": {
            "seconds": teacher_s,
            "documents": docs,
            "documents_per_s": rate(docs, teacher_s),
        },
        "training": {
            "seconds": t["train_s"],
            "tokens": tokens,
            "steps": work.get("train_steps", 0.0),
            "tokens_per_s": rate(tokens, t["train_s"]),
            "model_tflops": flops / 1e12,
            "mfu": flops / peak if peak else None,
        },
        "sa": {
            "seconds": t["sa_s"],
            "queries": queries,
            "ms_per_query": 1000 * t["sa_s"] / queries if queries else None,
        },
        "scoring": {
            "seconds": t["scoring_s"],
            "models": scored,
            "models_per_s": rate(scored, t["scoring_s"]),
        },
        "verdict": {"seconds": t.get("verdict_s", 0.0)},
    }
    for name, gb in results.get("memory_gb", {}).items():
        stage = stages.setdefault(_STAGE_OF.get(name, name), {"seconds": t.get(f"{name}_s", 0.0)})
        stage["peak_gb"] = gb
    # A CUDA run's device profile (timing.stages): each stage's device memory and busy share.
    for name, row in (t.get("stages") or {}).items():
        if "device_peak_gb" in row:
            stage = stages.setdefault(_STAGE_OF.get(name, name), {"seconds": row["seconds"]})
            stage["device_peak_gb"] = row["device_peak_gb"]
            stage["device_busy"] = row.get("device_busy")
    return {
        "device": model.get("device"),
        "gpu": model.get("gpu"),
        "dtype": model.get("dtype"),
        "parameters": int(params),
        "stages": stages,
        "overhead": t["overhead"],
        "total_s": t["total_s"],
    }


def format_pipeline(fig: dict) -> str:
    """Markdown table of :func:`pipeline_figures`."""
    st = fig["stages"]

    def f(x: float | None, spec: str = ".1f") -> str:
        return "–" if x is None else format(x, spec)

    tr, te, sa, sc = st["training"], st["teacher"], st["sa"], st["scoring"]
    mfu = f"; MFU {100 * tr['mfu']:.1f}%" if tr["mfu"] is not None else ""
    rows = [
        ["load model", f(st["load"]["seconds"]), "", ""],
        [
            "teacher (watermarked documents)",
            f(te["seconds"]),
            f"{te['documents']:.0f} documents",
            f"{f(te['documents_per_s'], '.2f')} documents/s",
        ],
        [
            "local training",
            f(tr["seconds"]),
            f"{tr['tokens']:,.0f} tokens, {tr['steps']:.0f} steps",
            f"{f(tr['tokens_per_s'], ',.0f')} tokens/s; "
            f"{tr['model_tflops']:.3f} TFLOP/s at 6N{mfu}",
        ],
        [
            "SA queries",
            f(sa["seconds"]),
            f"{sa['queries']} queries",
            f"{f(sa['ms_per_query'])} ms/query",
        ],
        [
            "scoring",
            f(sc["seconds"]),
            f"{sc['models']:.0f} models read",
            f"{f(sc['models_per_s'], '.2f')} models/s",
        ],
        ["verdict (exact tails, rank check)", f(st["verdict"]["seconds"]), "", ""],
    ]
    keys = ["load", "teacher", "training", "sa", "scoring", "verdict"]
    device = any("device_peak_gb" in stage for stage in st.values())
    for row, key in zip(rows, keys, strict=True):
        row.append(f(st[key].get("peak_gb"), ".2f"))
    # Stages only some runs have (baselines): seconds and peak only.
    for key, stage in st.items():
        if key not in keys:
            rows.append([key, f(stage.get("seconds")), "", "", f(stage.get("peak_gb"), ".2f")])
            keys.append(key)
    if device:  # a CUDA run: the device's peak memory and how busy it was, per stage
        for row, key in zip(rows, keys, strict=True):
            busy = st[key].get("device_busy")
            row += [f(st[key].get("device_peak_gb"), ".2f"), "–" if busy is None else f"{busy:.0%}"]
    where = fig["gpu"] or "CPU"
    dtype = f", {fig['dtype']}" if fig.get("dtype") else ""
    foot = (
        f"\nDevice: {fig['device']} ({where}{dtype}); {fig['parameters']:,} model parameters; "
        f"total {fig['total_s']:.1f} s; FedAttr overhead (SA + scoring + verdict) / training: "
        f"{100 * fig['overhead']:.1f}%"
    )
    head = ["stage", "seconds", "work", "throughput", "peak RSS GB"]
    head += ["device peak GB", "device busy"] if device else []
    return table(head, rows) + "\n" + foot


def bench_scoring(cfg: Any, candidates: int, repeats: int, say: Callable[[str], None]) -> list:
    """Seconds to read ``candidates`` candidate models (one round's reference, K estimates and
    the SA mean) with the KGW reading detector, one at a time vs stacked in one forward pass
    per probe batch, for candidates in FedIT's space (LoRA factors) and in FLoRA's (merged
    base weights). Also the largest difference between the two reads (float rounding only)."""
    from ..fl.federation import detection_records
    from ..models.loading import load_model
    from ..models.lora import (
        adapter_state,
        attach_lora,
        base_state,
        can_stack,
        load_state,
        lora_layers,
        stacked_candidates,
    )
    from ..models.text import encode_examples
    from ..watermarks.kgw import KGWScheme
    from ..watermarks.radioactivity import KGWReadingScorer

    if candidates < 2:
        raise UserError(f"--candidates: must be >= 2, got {candidates}")
    if repeats < 1:
        raise UserError(f"--repeats: must be >= 1, got {repeats}")
    model, tokenizer = load_model(cfg.model, say)
    model = attach_lora(model, cfg.lora, seed=cfg.fl.seed)
    if not can_stack(model):
        raise UserError("bench scoring: this model's LoRA layers cannot be stacked")
    device = next(model.parameters()).device
    examples = encode_examples(
        tokenizer, detection_records(cfg.data, cfg.watermark), cfg.data.max_len
    )
    scheme = KGWScheme(
        cfg.watermark.key_seed, len(tokenizer), cfg.watermark.kgw.gamma, cfg.watermark.kgw.delta
    )
    scorer = KGWReadingScorer(
        model,
        examples,
        {"kgw": scheme},
        load_state,
        pad_id=tokenizer.pad_token_id,
        stack=stacked_candidates,
    )
    gen = torch.Generator().manual_seed(0)

    def noisy(state: dict, keep: Callable[[str], bool]) -> dict:
        return {
            k: v if keep(k) else v + 1e-3 * torch.randn(v.shape, generator=gen).to(v)
            for k, v in state.items()
        }

    zero_b = {
        f"{n}.lora_B": torch.zeros_like(m.lora_B["default"].weight)
        for n, m in lora_layers(model).items()
    }
    spaces = {
        "FedIT (LoRA factors)": [
            noisy(adapter_state(model), lambda k: False) for _ in range(candidates)
        ],
        "FLoRA (merged weights)": [
            noisy({**base_state(model), **zero_b}, lambda k: "lora_B" in k)
            for _ in range(candidates)
        ],
    }
    rows = []
    for space, cands in spaces.items():
        timings: dict[str, list[float]] = {"one": [], "stacked": []}
        for _ in range(repeats + 1):  # the first pass of each warms up (not timed)
            for mode in ("one", "stacked"):
                synchronize(device)
                t0 = time.perf_counter()
                reads = (
                    scorer.observe_many(cands)
                    if mode == "stacked"
                    else [scorer.observe(c) for c in cands]
                )
                synchronize(device)
                timings[mode].append(time.perf_counter() - t0)
                if mode == "one":
                    single = reads
                else:
                    stacked = reads
        one, both = statistics.median(timings["one"][1:]), statistics.median(timings["stacked"][1:])
        diff = max(float((a - b).abs().max()) for a, b in zip(single, stacked, strict=True))
        say(f"bench scoring: {space}: one at a time {one:.2f} s, stacked {both:.2f} s")
        rows.append(
            {
                "space": space,
                "device": str(device),
                "candidates": candidates,
                "probes": len(examples),
                "one_at_a_time_s": one,
                "stacked_s": both,
                "speedup": one / both,
                "candidates_per_s_stacked": candidates / both,
                "max_abs_difference": diff,
            }
        )
    return rows


def format_scoring(rows: Sequence[dict]) -> str:
    """Markdown table of :func:`bench_scoring` rows."""
    return table(
        [
            "candidates in",
            "device",
            "candidates",
            "probes",
            "one at a time s",
            "stacked s",
            "speedup",
            "candidates/s stacked",
            "max |difference|",
        ],
        [
            [
                r["space"],
                r["device"],
                r["candidates"],
                r["probes"],
                f"{r['one_at_a_time_s']:.2f}",
                f"{r['stacked_s']:.2f}",
                f"{r['speedup']:.2f}x",
                f"{r['candidates_per_s_stacked']:.1f}",
                f"{r['max_abs_difference']:.1e}",
            ]
            for r in rows
        ],
    )
