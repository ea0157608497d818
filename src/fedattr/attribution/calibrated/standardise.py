"""Steps 2-4 of the calibrated statistic over one round: each target's own change, centred
without a key and divided by its null standard deviation.

A round is standardised whole (:func:`standardise_round`) or a block of rows at a time
(:func:`standardise_blocks`, a change too large to hold: :class:`ChangeRows`), with the same
result bit for bit in one block. How the round's cross-talk is handled is its
:class:`~.plan.RoundPlan`'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ...watermarks.tail.laws import KeyLaw, RowSubsets
from ..contract import Parts
from .crosstalk import AT_ONCE_CELLS, combine
from .plan import RoundPlan
from .weights import median, over_vocabulary, spread_weights


@dataclass(frozen=True)
class ChangeRows:
    """A change read a block of rows at a time, where it is too large to hold whole (a
    vocabulary-sized change over thousands of contexts): ``read(lo, hi)`` gives rows ``lo:hi``
    as ``[hi - lo, cols]``, the same values at every call."""

    rows: int
    cols: int
    read: Callable[[int, int], torch.Tensor]


Change = torch.Tensor | ChangeRows
"""One part of a change: held whole, or read by row blocks."""

STANDARDISE_CELLS = 1 << 18
"""Cells per row block where a round is standardised by blocks (:func:`standardise_blocks`):
its K changes, their float64 combination and the sort for the median take 40-50 bytes a cell
per client (measured: 1.3 GB for ten clients' blocks of 4M cells), so about 0.12 GB a block
for ten clients (0.45 GB at 2^20 cells, a SmolLM2 round's peak on the CPU)."""


def row_shape(law: KeyLaw, change: Change) -> tuple[int, int]:
    """``(rows, cols)`` the law reads a change as (its rows are centred independently)."""
    if isinstance(change, ChangeRows):
        return change.rows, change.cols
    if isinstance(law, RowSubsets):
        return change.numel() // law.cols, law.cols
    return 1, change.numel()  # one row: the change is centred (and read) whole


def _rows_of(change: Change, cols: int, lo: int, hi: int) -> torch.Tensor:
    if isinstance(change, ChangeRows):
        return change.read(lo, hi)
    return change.reshape(-1, cols)[lo:hi]


def standardise_blocks(
    plan: RoundPlan,
    changes: Sequence[Mapping[str, Change]],
    center: Mapping[str, Change] | None,
    laws: Mapping[str, KeyLaw],
    sink: Callable[[str, int, list[torch.Tensor]], None],
    *,
    token_centring: bool = False,
    weights: Mapping[str, Change] | None = None,
    cells: int | None = STANDARDISE_CELLS,
    spread: float = 0.0,
    frozen_spread: Mapping[str, torch.Tensor] | None = None,
    keep_spread: Callable[[str, int, torch.Tensor], None] | None = None,
) -> None:
    """:func:`standardise_round` a block of rows at a time, each block handed to ``sink(part,
    first row, [each target's standardised rows])`` (float32, ``[rows, cols]``). ``cells``:
    cells per block (``None``: one block).

    Every step is cell-wise (weights, ``A^{-1}``, the median over clients) or row-wise (the
    centring), except two sums over the whole change: the null variance (a sum of squares) and
    token centring's column means. Where the change is more than one block those are taken in
    a first pass and the blocks are computed again in the second, so at most one block of every
    change is held at once. In one block the result is :func:`standardise_round`'s bit for bit;
    in several the variance and column means are summed block by block in float64 (the same up
    to float rounding). ``spread``: the exponent of :func:`~.weights.spread_weights`, applied
    after centring, for laws whose rows each mark several columns (KGW); 0 leaves every cell's
    weight as it is. ``frozen_spread``: per part, the spread weights of an earlier round
    (``[rows, cols]``) to read with instead of this round's; ``keep_spread(part, first row,
    weights)`` hears the weights this round computes.

    A round whose plan is not ``centred`` subtracts no centre made of its clients (its rows are
    still centred by the law)."""
    inv = plan.on_changes
    count = len(changes)

    def one_part(part: str, law: KeyLaw) -> None:
        rows, cols = row_shape(law, changes[0][part])
        step = rows if cells is None else max(1, min(rows, cells // max(1, cols)))
        starts = list(range(0, rows, step))
        tokens = token_centring and over_vocabulary(law)
        by_spread = spread > 0 and over_vocabulary(law)

        def differences(lo: int) -> list[torch.Tensor]:
            """Rows ``lo:lo + step`` of each target's change less the round's centre."""
            hi = min(rows, lo + step)
            Y = torch.stack([_rows_of(c[part], cols, lo, hi).reshape(-1).float() for c in changes])
            center_part = None
            if center is not None:
                center_part = _rows_of(center[part], cols, lo, hi).reshape(-1).to(Y)
            if weights is not None and part in weights:
                w = _rows_of(weights[part], cols, lo, hi).reshape(-1).to(Y)
                Y = Y * w
                center_part = None if center_part is None else center_part * w
            X = Y
            if inv is not None:
                # Row by row in float64 (see combination): the same bits wherever it runs.
                # At once where a float64 copy of Y is small: the same bits, 3x faster.
                X = combine(inv, Y, at_once=cells is not None or Y.numel() <= AT_ONCE_CELLS)
            if not plan.centred:
                # A reference that may have learned a key: nothing of the other clients'.
                D = X
            elif plan.undone:
                # Each client's own change (undone here or on the updates): centred on the
                # cell-wise median, which a minority of watermarked clients barely moves.
                D = X - median(X)
            else:
                D = X - (center_part if center_part is not None else Y.mean(dim=0))
            if by_spread:
                if frozen_spread is not None and part in frozen_spread:
                    sw = frozen_spread[part][lo:hi].reshape(-1)
                else:
                    sw = spread_weights(D, cols, spread)
                    if keep_spread is not None:
                        keep_spread(part, lo, sw.reshape(hi - lo, cols))
                D = D * sw.to(D)
            return [D[i].reshape(hi - lo, cols) for i in range(count)]

        drift: list[torch.Tensor] | None = None
        if tokens and len(starts) > 1:  # pass 0: each target's mean change per token
            sums = torch.zeros(count, cols, dtype=torch.float64)
            for lo in starts:
                for i, d in enumerate(differences(lo)):
                    sums[i] += d.sum(dim=0, dtype=torch.float64)
            drift = [(sums[i] / rows).float() for i in range(count)]

        def centred(lo: int) -> list[torch.Tensor]:
            out = []
            for i, d in enumerate(differences(lo)):
                if tokens:
                    d = d - (d.mean(dim=0) if drift is None else drift[i])
                out.append(law.centre(d))
            return out

        # Pass 1: the null variance of each target's change (a sum over its cells).
        var = [0.0] * count
        kept: list[torch.Tensor] | None = None
        for lo in starts:
            cs = centred(lo)
            var = [v + law.variance(c) for v, c in zip(var, cs, strict=True)]
            if len(starts) == 1:
                kept = cs  # one block: kept, not computed again
        # Pass 2: each block divided by its change's null standard deviation.
        for lo in starts:
            cs = kept if kept is not None else centred(lo)
            sink(
                part,
                lo,
                [
                    (c / math.sqrt(v) if v > 0 else torch.zeros_like(c)).float()
                    for c, v in zip(cs, var, strict=True)
                ],
            )

    for part, law in laws.items():
        one_part(part, law)


def standardise_round(
    plan: RoundPlan,
    changes: Sequence[Parts],
    center: Parts | None,
    laws: Mapping[str, KeyLaw],
    *,
    token_centring: bool = False,
    weights: Parts | None = None,
    spread: float = 0.0,
    frozen_spread: Mapping[str, torch.Tensor] | None = None,
    keep_spread: Callable[[str, int, torch.Tensor], None] | None = None,
) -> list[Parts]:
    """Steps 2-4 of the statistic: each target's own change (``plan``: how its cross-talk is
    handled), centred without a key and divided by its null standard deviation. Key-free
    throughout. ``center``: the SA mean's change, read where cross-talk is not undone.

    ``weights``: per part, a key-free weight per cell (:func:`~.weights.taper_weights`), the
    same for every change of the round, applied before anything else (so undoing cross-talk
    stays exact).

    ``token_centring``: also remove what a change does to a token in every context alike (its
    mean over the rows, per column: a client's drift towards or away from a token, which no
    per-context green list is aligned with), before the rows are centred; only for laws whose
    rows each mark several columns (KGW).

    ``spread``: see :func:`~.weights.spread_weights` (after centring; key-free like the rest);
    ``frozen_spread``, ``keep_spread``: see :func:`standardise_blocks`.

    Held whole, in one block; :func:`standardise_blocks` does the same a block of rows at a
    time."""
    out: list[Parts] = [{} for _ in changes]

    def keep(part: str, lo: int, blocks: list[torch.Tensor]) -> None:
        for i, b in enumerate(blocks):
            out[i][part] = b

    standardise_blocks(
        plan,
        changes,
        center,
        laws,
        keep,
        token_centring=token_centring,
        weights=weights,
        cells=None,
        spread=spread,
        frozen_spread=frozen_spread,
        keep_spread=keep_spread,
    )
    return out
