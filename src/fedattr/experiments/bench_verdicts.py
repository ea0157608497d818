"""``fedattr bench verdicts``: the calibrated statistic's verdict, timed stage by stage with
each stage's peak memory, on synthetic changes of a run's size (no model trained)."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import UserError
from ..reporting.markdown import table
from ..runtime import PeakMemory, require_cuda
from .bench import synchronize


class _SyntheticChanges:
    """Random changes of a verdict's size, drawn a chunk of rows at a time from a generator
    seeded by (seed, round, client, chunk), so any block of rows reads the same values whether
    it is read whole or in blocks. Heavy-tailed cells (a normal over the square root of a
    uniform plus 0.05), and in the watermarked clients the owner's green cells raised by
    ``delta``: a key-aligned signal."""

    CHUNK_CELLS = 1 << 20

    def __init__(self, contexts: int, vocab: int, keys: _WindowKeys, seed: int) -> None:
        self.contexts, self.vocab, self.keys, self.seed = contexts, vocab, keys, seed
        self.chunk = max(1, self.CHUNK_CELLS // vocab)
        self.seconds = 0.0  # spent drawing (not the verdict's work)

    def rows(self, t: int, client: int, owner: int | None, delta: float, lo: int, hi: int):
        start = time.perf_counter()
        parts = []
        for c0 in range(lo - lo % self.chunk, hi, self.chunk):
            c1 = min(self.contexts, c0 + self.chunk)
            state = np.random.SeedSequence([self.seed, t, client, c0]).generate_state(1)
            gen = torch.Generator().manual_seed(int(state[0]))
            x = torch.randn(c1 - c0, self.vocab, generator=gen)
            x /= (torch.rand(c1 - c0, self.vocab, generator=gen) + 0.05).sqrt()
            if owner is not None:
                x += delta * self.keys.mask(owner, c0, c1)
            parts.append(x[max(lo, c0) - c0 : min(hi, c1) - c0])
        self.seconds += time.perf_counter() - start
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class _WindowKeys:
    """The owners' keys of the benchmark: in context ``x`` owner ``o``'s green tokens are the
    ``m`` consecutive ones (cyclically) from a random offset. Not a uniform ``m``-subset, but
    a fixed key read on exchangeable random cells has the same law, and it is cheap to apply by
    rows without holding ``owners x contexts x vocab`` masks."""

    def __init__(self, owners: int, contexts: int, vocab: int, m: int, seed: int) -> None:
        rng = np.random.default_rng([seed, 0xBE])
        self.offsets = torch.from_numpy(rng.integers(vocab, size=(owners, contexts)))
        self.vocab, self.m = vocab, m

    def mask(self, owner: int, lo: int, hi: int) -> torch.Tensor:
        cols = torch.arange(self.vocab)
        return (((cols[None, :] - self.offsets[owner, lo:hi, None]) % self.vocab) < self.m).float()

    def values(self, rows: torch.Tensor, lo: int) -> list[float]:
        """``<rows, G_o>`` for every owner: window sums from cumulative sums (float64)."""
        r = rows.detach().cpu().double().reshape(-1, self.vocab)
        cs = torch.cat([torch.zeros(len(r), 1, dtype=torch.float64), r, r], 1).cumsum(1)
        out = []
        for o in range(len(self.offsets)):
            off = self.offsets[o, lo : lo + len(r), None]
            out.append(float((cs.gather(1, off + self.m) - cs.gather(1, off)).sum()))
        return out


class _BenchScorer:
    """A :class:`~fedattr.attribution.contract.LinearKeyScorer` over the benchmark's keys (and
    :class:`~fedattr.attribution.contract.RowOwnerValues`: its owners read by rows)."""

    exchangeable_rounds = None

    def __init__(self, keys: _WindowKeys, law: Any, block_rows: int) -> None:
        self.keys, self.law, self.block_rows = keys, law, block_rows

    def observe(self, params: Any) -> Any:
        return params

    def change(self, reference: Any, candidate: Any) -> dict:
        return {"probes": candidate - reference}

    def key_laws(self) -> dict:
        return {"probes": self.law}

    def owner_values(self, part: str, W: torch.Tensor) -> dict[str, float]:
        W = W.reshape(-1, self.keys.vocab)
        total = [0.0] * len(self.keys.offsets)
        for lo in range(0, len(W), self.block_rows):  # by rows: cumulative sums are float64
            for o, v in enumerate(self.keys.values(W[lo : lo + self.block_rows], lo)):
                total[o] += v
        return {f"owner{o}": v for o, v in enumerate(total)}

    def owner_values_rows(self, part: str, rows: torch.Tensor, lo: int) -> dict[str, float]:
        return {f"owner{o}": v for o, v in enumerate(self.keys.values(rows, lo))}


def bench_verdicts(
    clients: int = 10,
    owners: int = 3,
    contexts: int = 550,
    vocab: int = 49_152,
    rounds: int = 5,
    null_keys: int = 200,
    device: str = "cpu",
    seed: int = 0,
    mode: str = "memory",
    signal: float = 8.0,
    spill: str | None = None,
    block_cells: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """The calibrated statistic's verdict, timed stage by stage with each stage's peak resident
    memory, on synthetic changes of a run's size (no model trained): ``rounds`` rounds of
    ``clients`` changes over ``contexts x vocab`` cells, cross-talk undone (the cell-wise median
    over clients), standardised and summed; then the exact tails of every client x owner, and
    the rank check (``null_keys`` random keys; the verdict's report reads both). The first
    ``owners`` clients each carry one owner's key, raised by ``signal`` standard deviations of
    one round's statistic.

    ``mode``: ``memory``, every change and sum held whole (a run's default); ``stream``, the
    sums spilled to float32 files in ``spill`` (a temporary folder by default) and the rounds
    standardised ``block_cells`` at a time (default
    :data:`~fedattr.attribution.calibrated.standardise.STANDARDISE_CELLS`), the tails and the
    rank check reading them by row blocks. Drawing the random changes is timed apart
    (``draw_s``): it is not the verdict's work."""
    import shutil
    import tempfile

    from ..attribution.calibrated.standardise import STANDARDISE_CELLS, ChangeRows
    from ..attribution.calibrated.sums import CalibratedNull
    from ..attribution.calibrated.verdict import rank_values, tails
    from ..attribution.design import own_update_design
    from ..watermarks.tail.laws import RowSubsets

    if device == "cuda":
        require_cuda("--device")
    for name, value, least in (
        ("--clients", clients, 1),
        ("--owners", owners, 1),
        ("--contexts", contexts, 1),
        ("--vocab", vocab, 8),
        ("--rounds", rounds, 1),
        ("--null-keys", null_keys, 0),
        ("--block-cells", block_cells if block_cells is not None else 1, 1),
    ):
        if value < least:
            raise UserError(f"{name}: must be >= {least}, got {value}")
    if mode not in ("memory", "stream"):
        raise UserError(f"--mode: unknown {mode!r}; allowed: memory, stream")
    if owners > clients:
        raise UserError(f"--owners: at most --clients ({clients}), got {owners}")
    say = progress or (lambda msg: print(msg, file=sys.stderr))
    law = RowSubsets(vocab // 4, vocab)
    keys = _WindowKeys(owners, contexts, vocab, law.m, seed)
    draws = _SyntheticChanges(contexts, vocab, keys, seed)
    # One round's owner statistic has sd sqrt(gamma (1 - gamma) C V) * sigma, sigma^2 =
    # E[1 / (u + 0.05)] = log(21): delta raises it by ``signal`` of them.
    cell_sd = math.sqrt(math.log(21.0))
    delta = signal * cell_sd / math.sqrt(law.gamma * (1 - law.gamma) * contexts * vocab)
    cells = block_cells or STANDARDISE_CELLS
    own = spill is None and mode == "stream"
    folder = tempfile.mkdtemp(prefix="fedattr-bench-") if own else spill
    null = CalibratedNull(
        alpha=0.01,
        null_keys=null_keys,
        seed=seed,
        spill=folder if mode == "stream" else None,
        block_cells=cells,
    )
    scorer = _BenchScorer(keys, law, max(1, cells // vocab))
    order = list(range(clients))
    designs = [own_update_design(c, order) for c in order]
    memory = PeakMemory()
    stages: dict[str, dict[str, float]] = {}
    try:
        memory.start()
        start, drawn = time.perf_counter(), draws.seconds
        for t in range(1, rounds + 1):
            say(f"bench verdicts: round {t} of {rounds} ({mode})")
            changes: list[dict[str, Any]] = []
            for c in order:
                owner = c if c < owners else None

                def read(lo: int, hi: int, t: int = t, c: int = c, owner: Any = owner):
                    return draws.rows(t, c, owner, delta, lo, hi)

                if mode == "memory":
                    changes.append({"probes": read(0, contexts).to(device)})
                else:
                    changes.append({"probes": ChangeRows(contexts, vocab, read)})
            null.add_round(null.plan(t, order, order, designs, scorer), changes, None, scorer)
            del changes
        synchronize(device)
        elapsed = time.perf_counter() - start
        draw_s = draws.seconds - drawn
        stages["rounds"] = {"seconds": elapsed - draw_s, "peak_gb": memory.peak_gb()}
        names = sorted(null.parts)
        memory.start()
        start = time.perf_counter()
        found = tails(null.evidence(), order, names)
        stages["tails"] = {"seconds": time.perf_counter() - start, "peak_gb": memory.peak_gb()}
        memory.start()
        start = time.perf_counter()
        ranks = rank_values(null.evidence(), order, null.null_keys, null.seed)
        synchronize(device)
        stages["rank_check"] = {
            "seconds": time.perf_counter() - start,
            "peak_gb": memory.peak_gb(),
        }
    finally:
        if own and folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    del ranks
    # Named as CalibratedNull.report names: below alpha / (clients x owners) for some owner.
    level = math.log10(null.alpha / (clients * owners))
    named = sorted({c for (c, _), t in found.items() if t.log10_p < level})
    methods = sorted({t.method for t in found.values()})
    return {
        "mode": mode,
        "clients": clients,
        "owners": owners,
        "contexts": contexts,
        "vocab": vocab,
        "cells_per_client": contexts * vocab,
        "rounds": rounds,
        "null_keys": null_keys,
        "device": device,
        "threads": torch.get_num_threads(),
        "block_cells": cells if mode == "stream" else None,
        "stages": stages,
        "peak_reset_per_stage": memory.resettable,
        "draw_s": draw_s,
        "sums_s": stages["rounds"]["seconds"],
        "rank_check_s": stages["rank_check"]["seconds"],
        "tails_s": stages["tails"]["seconds"],
        "tail_methods": methods,
        "log10_p": {
            f"{c}/{o}": found[(c, o)].log10_p for c in order for o in names if (c, o) in found
        },
        "named": named,
        "watermarked": list(range(owners)),
    }


def format_verdicts(fig: dict) -> str:
    """``fedattr bench verdicts`` as a Markdown table."""
    k, rounds = fig["clients"], fig["rounds"]
    per = {"rounds": k * rounds, "tails": k, "rank_check": k}
    label = {
        "rounds": "rounds: undo cross-talk, median, centre, standardise, sum",
        "tails": "exact tails (all clients x owners)",
        "rank_check": f"rank check ({fig['null_keys']} keys)",
    }
    rows = [
        ["changes", f"{k} clients x {fig['cells_per_client']:,} cells, {rounds} rounds"],
        ["mode, threads", f"{fig['mode']}, {fig['threads']}"],
    ]
    for name, st in fig["stages"].items():
        each = "client-round" if name == "rounds" else "client"
        rows.append(
            [
                label[name],
                f"{st['seconds']:.1f} s ({st['seconds'] / per[name]:.2f} s per {each}), "
                f"peak RSS {st['peak_gb']:.2f} GB",
            ]
        )
    rows.append(["drawing the random changes (not timed above)", f"{fig['draw_s']:.1f} s"])
    rows.append(["tail methods", ", ".join(fig["tail_methods"])])
    rows.append(
        ["named (watermarked)", f"{fig['named']} ({fig['watermarked']})"],
    )
    return table(["what", "value"], rows)
