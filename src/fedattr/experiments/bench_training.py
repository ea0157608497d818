"""``fedattr bench training``: one round of a configuration's local training, timed, beside
the least time its arithmetic can take on this machine.

The round is the run's own (the in-process pool, ``fl.batched`` and the clients' profiles
``fl.clients`` as configured, every client from the same global state, the clean shards of
``data``: the watermarked clients train on their clean records, no teacher runs): a warm-up
round, then ``repeats`` timed rounds. Its arithmetic is counted once more under
:class:`~torch.utils.flop_counter.FlopCounterMode` (untimed): the matrix products of the
forward and backward passes, exactly, as torch dispatches them (attention kernels it does not
count are left out, so the count is a lower bound on the work). The machine's rate is the best
of a few timed matrix products in the model's dtype, on its device and threads, of the model's
own shapes and one large square one. The *floor* is the counted work at that rate: no
scheduling of the same arithmetic (batching, fusion, compilation) trains the round faster, so
``round / floor`` bounds what any of them can gain; a larger gain needs less arithmetic (fewer
tokens, padding, rank, or a cheaper precision).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from ..errors import UserError
from ..reporting.markdown import table
from .bench import synchronize

ROWS = 2048
"""Rows of the probe's products: a pass of the embedded default holds about this many tokens."""
SQUARE = 1024
"""The large square product of the probe (the rate a BLAS reaches on big shapes)."""


def matmul_rate(
    shapes: list[tuple[int, int, int]], dtype: torch.dtype, device: torch.device
) -> dict[str, Any]:
    """The best FLOP/s of ``(m, k, n)`` products in ``dtype`` on ``device`` (each warmed up,
    then timed over at least 0.2 s), with the rate of every shape."""
    rates = {}
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device).to(dtype)
        b = torch.randn(k, n, device=device).to(dtype)
        for _ in range(2):
            a @ b
        reps, seconds = 0, 0.0
        synchronize(device)
        start = time.perf_counter()
        while seconds < 0.2:
            a @ b
            reps += 1
            synchronize(device)
            seconds = time.perf_counter() - start
        rates[f"{m}x{k}x{n}"] = 2.0 * m * k * n * reps / seconds
    best = max(rates, key=rates.__getitem__)
    return {"flops_per_s": rates[best], "shape": best, "by_shape": rates}


def _model_shapes(model) -> list[tuple[int, int, int]]:
    """The products a LoRA training step of ``model`` runs, at :data:`ROWS` rows, and one
    large square."""
    cfg = model.config
    hidden = cfg.hidden_size
    inner = getattr(cfg, "intermediate_size", 4 * hidden)
    from ..models.lora import lora_layers

    rank = next(iter(lora_layers(model).values())).lora_A["default"].weight.shape[0]
    dims = [(hidden, hidden), (hidden, rank), (rank, hidden), (hidden, inner), (inner, hidden)]
    dims.append((hidden, cfg.vocab_size))
    return [(ROWS, k, n) for k, n in dims] + [(SQUARE, SQUARE, SQUARE)]


def bench_training(cfg: Any, repeats: int, say: Callable[[str], None]) -> dict[str, Any]:
    """Time one round of ``cfg``'s local training (median of ``repeats``), count its matrix
    products, and set them against this machine's matrix-product rate (module docstring)."""
    from ..fl.clients import resolve_profiles
    from ..fl.federation import clean_data, partition_records, watermarked_clients
    from ..fl.inprocess import InProcessPool
    from ..fl.progress import Progress
    from ..fl.registry import make_strategy
    from ..fl.timing import Stopwatch
    from ..models.loading import load_model
    from ..models.lora import attach_lora
    from ..models.text import encode_examples
    from ..secagg import SecAggConfig, make_aggregator

    if repeats < 1:
        raise UserError(f"--repeats: must be >= 1, got {repeats}")
    model, tokenizer = load_model(cfg.model, say)
    records, _ = clean_data(cfg.data, cfg.watermark, cfg.fl.K)
    shards = partition_records(records, cfg.data, cfg.fl.K)
    examples = [encode_examples(tokenizer, s, cfg.data.max_len) for s in shards]
    model = attach_lora(model, cfg.lora, seed=cfg.fl.seed)
    server, client = make_strategy(cfg.fl, cfg.lora)
    state = server.initial_state(model)
    marked = watermarked_clients(cfg.watermark, cfg.fl.K, cfg.fl.seed)
    profiles = resolve_profiles(cfg.fl.clients, cfg.fl.K, marked, cfg.fl.seed)
    pool = InProcessPool.from_config(
        model, examples, client, cfg.fl, tokenizer.pad_token_id, profiles
    )
    device = next(model.parameters()).device
    participants = list(range(cfg.fl.K))
    quiet = Progress(lambda _m: None)
    watch = Stopwatch()

    def one_round() -> float:
        sa = make_aggregator(SecAggConfig(backend="plaintext", min_members=2))
        sa.open_round(1, participants)
        synchronize(device)
        start = time.perf_counter()
        pool.train_round(1, participants, state, sa, pool.scales(participants), quiet, watch)
        synchronize(device)
        seconds = time.perf_counter() - start
        sa.close_round()
        return seconds

    say("bench training: a warm-up round")
    one_round()
    seconds = []
    for i in range(repeats):
        seconds.append(one_round())
        say(f"bench training: round {i + 1}/{repeats}: {seconds[-1]:.2f} s")
    with FlopCounterMode(display=False) as counter:
        one_round()
    by_op = {str(op): int(n) for op, n in counter.get_flop_counts()["Global"].items()}
    flops = sum(by_op.values())
    dtype = next(model.parameters()).dtype
    rate = matmul_rate(_model_shapes(model), dtype, device)
    median = statistics.median(seconds)
    floor = flops / rate["flops_per_s"]
    return {
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "clients": cfg.fl.K,
        "batched": pool.batched,
        # Every round counted its tokens: the last one's share.
        "tokens": int(watch.counts.get("train_tokens", 0) / (repeats + 2)),
        "round_s": median,
        "rounds_s": seconds,
        "matmul_flops": flops,
        "matmul_flops_by_op": by_op,
        "achieved_flops_per_s": flops / median,
        "machine": rate,
        "floor_s": floor,
        "headroom": median / floor,
    }


def format_training(fig: dict[str, Any]) -> str:
    """Markdown table of :func:`bench_training`."""
    rate = fig["machine"]
    rows = [
        ["one round's training (median)", f"{fig['round_s']:.2f} s"],
        ["its matrix products (counted)", f"{fig['matmul_flops'] / 1e9:,.1f} GFLOP"],
        ["their rate in the round", f"{fig['achieved_flops_per_s'] / 1e9:,.1f} GFLOP/s"],
        [
            "this machine's best matrix-product rate",
            f"{rate['flops_per_s'] / 1e9:,.1f} GFLOP/s ({rate['shape']})",
        ],
        ["floor: the products alone at that rate", f"{fig['floor_s']:.2f} s"],
        ["round / floor (the most any scheduling can gain)", f"{fig['headroom']:.2f}x"],
    ]
    foot = (
        f"\n{fig['clients']} clients, {'trained together' if fig['batched'] else 'one by one'}, "
        f"{fig['tokens']:,} tokens a round (padding excluded); {fig['device']}, {fig['dtype']}, "
        f"{fig['threads']} thread(s)"
    )
    return table(["", "figure"], rows) + "\n" + foot
