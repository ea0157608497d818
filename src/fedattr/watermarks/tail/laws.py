"""Key laws: how a random key is distributed over a change, for a statistic ``<W, key>``.

:class:`RowSubsets` (rows independent uniform ``m``-subsets: KGW's green lists, FK's true
value) and :class:`Directions` (a uniformly random unit vector: the synthetic bed). Each law
centres a change without a key, gives its null variance, picks the tail method that reads it
(:mod:`fedattr.watermarks.tail.methods`) and draws the rank check's random keys; it is written
to ``results.json`` as :meth:`KeyLaw.describe` and rebuilt by :func:`law_from_dict`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from scipy.stats import beta as beta_dist

from ...rows import BLOCK_CELLS, DenseRows, Rows, block_rows, row_blocks
from .cgf import BernoulliCells, RowDraws
from .methods import (
    EXACT_COMBINATIONS,
    LN10,
    MIN_EFFECTIVE_CELLS,
    RowPatternsBound,
    Tail,
    effective_cells,
    exact_one_of_log10_sf,
    saddlepoint_log10_sf,
)


def _whole(W: torch.Tensor | Rows) -> torch.Tensor:
    """``W`` as one float64 tensor (a law whose changes are small reads a :class:`Rows` whole)."""
    return torch.from_numpy(W.block(0, W.rows)) if isinstance(W, Rows) else W.double()


@runtime_checkable
class KeyLaw(Protocol):
    """How a random key is distributed, for a statistic ``<W, key>`` linear in the key."""

    def centre(self, change: torch.Tensor) -> torch.Tensor:
        """The change with what no key can see removed (key-free), null mean exactly 0."""
        ...

    def variance(self, W: torch.Tensor | Rows) -> float:
        """The null variance of ``<W, key>`` (``W`` centred)."""
        ...

    def tail(self, W: torch.Tensor | Rows, value: float) -> Tail:
        """``P(<W, key> >= value)`` under a random key."""
        ...

    def tails(self, W: torch.Tensor | Rows, values: Sequence[float]) -> list[Tail]:
        """:meth:`tail` at several values of one ``W`` (several owners' keys reading one
        client's change): what depends on ``W`` alone is computed once."""
        ...

    def random_values(self, Ws: Sequence[torch.Tensor | Rows], n: int, seed: int) -> np.ndarray:
        """``<W, key_k>`` for ``n`` random keys (``[len(Ws), n]``): the rank check."""
        ...

    def describe(self) -> dict:
        """JSON-ready parameters (:func:`law_from_dict` rebuilds the law)."""
        ...


class RowSubsets:
    """Rows independent, each a uniform ``m``-subset of its ``cols`` columns (KGW green
    lists: ``m = gamma V``; FK: the true value among the candidates, ``m = 1``)."""

    kind = "row-subsets"

    def __init__(self, m: int, cols: int) -> None:
        if not 1 <= m < cols:
            raise ValueError(f"RowSubsets: need 1 <= m < cols, got m={m}, cols={cols}")
        self.m, self.cols = m, cols
        self.v = m * (cols - m) / (cols * (cols - 1))  # null variance per unit of sum w^2

    def centre(self, change: torch.Tensor) -> torch.Tensor:
        change = change.double().reshape(-1, self.cols)
        return change - change.mean(dim=1, keepdim=True)

    def variance(self, W: torch.Tensor | Rows) -> float:
        if isinstance(W, Rows):
            return self.v * sum(float((b * b).sum()) for b in row_blocks(W))
        return self.v * float((W.double() ** 2).sum())

    def tail(self, W: torch.Tensor | Rows, value: float) -> Tail:
        return self.tails(W, [value])[0]

    def tails(
        self, W: torch.Tensor | Rows, values: Sequence[float], cells: int = BLOCK_CELLS
    ) -> list[Tail]:
        """Also of a change read by row blocks (:class:`Rows`, ``cells`` at a time): every
        quantity the tails need is a sum over cells or rows, so it is accumulated block by
        block. A change held in memory (a tensor), or of one block, is read whole, as before."""
        src = W if isinstance(W, Rows) else DenseRows(W, self.cols)
        one = src.rows <= block_rows(self.cols, cells)
        if self.m == 1 or one or not isinstance(W, Rows):
            # One pick per row (FK: questions x candidates, small) or one block: held whole.
            return self._tails_dense(src.block(0, src.rows), values)
        # One pass: is there any change, over how many effective cells.
        s2 = s4 = 0.0
        for b in row_blocks(src, cells):
            sq = (b * b).reshape(-1)
            s2, s4 = s2 + float(sq.sum()), s4 + float(np.dot(sq, sq))
        if s2 <= 0.0:
            return [Tail(0.0, "exact") for _ in values]  # no change: every key reads 0
        if s2 * s2 / s4 >= MIN_EFFECTIVE_CELLS:
            scale = math.sqrt(self.cols / (self.cols - 1))
            cgf = BernoulliCells(lambda: (scale * b for b in row_blocks(src, cells)), self.gamma)
            return [Tail(saddlepoint_log10_sf(cgf, v), "saddlepoint") for v in values]
        bound = RowPatternsBound(src, self.m, cells=cells)
        return [bound.tail(v) for v in values]

    def _tails_dense(self, w: np.ndarray, values: Sequence[float]) -> list[Tail]:
        if not np.any(w):
            return [Tail(0.0, "exact") for _ in values]  # no change: every key reads 0
        if self.m == 1 and len(w) * math.log(self.cols) <= math.log(EXACT_COMBINATIONS):
            return [Tail(exact_one_of_log10_sf(w, v), "exact") for v in values]
        if effective_cells(w) >= MIN_EFFECTIVE_CELLS:
            # Independent cells, scaled so that their variance is the fixed-size rows' exactly.
            scale = math.sqrt(self.cols / (self.cols - 1))
            cgf = (
                RowDraws(w, 1) if self.m == 1 else BernoulliCells(scale * w.reshape(-1), self.gamma)
            )
            return [Tail(saddlepoint_log10_sf(cgf, v), "saddlepoint") for v in values]
        bound = RowPatternsBound(w, self.m)
        return [bound.tail(v) for v in values]

    @property
    def gamma(self) -> float:
        """The share of a row the key marks."""
        return self.m / self.cols

    def random_values(self, Ws: Sequence[torch.Tensor | Rows], n: int, seed: int) -> np.ndarray:
        """Changes held as tensors: :class:`~fedattr.watermarks.nullkeys.RandomGreenLists`
        over every cell at once. Any change read by row blocks (:class:`Rows`): the same law,
        keys drawn a block of rows at a time (:func:`random_values_by_rows`), so other keys."""
        if any(isinstance(W, Rows) for W in Ws):
            return random_values_by_rows(
                [W if isinstance(W, Rows) else DenseRows(W, self.cols) for W in Ws],
                n,
                seed,
                self.m,
            )
        if self.m == 1:
            ws = [W.double().reshape(-1, self.cols).cpu().numpy() for W in Ws]
            rows = np.arange(len(ws[0]))
            # Key k: one column per row; the same keys read every W.
            picks = np.random.default_rng([seed, 0x0F1]).integers(self.cols, size=(n, len(rows)))
            return np.stack([w[rows, picks].sum(axis=1) for w in ws])
        from ..nullkeys import RandomGreenLists

        flat = torch.stack([W.float().reshape(-1) for W in Ws])
        keys = RandomGreenLists(n, seed, flat.shape[1], self.gamma, flat.device)
        return keys.sums(flat).double().cpu().numpy()

    def describe(self) -> dict:
        return {"kind": self.kind, "m": self.m, "cols": self.cols}


class Directions:
    """A uniformly random unit vector (the synthetic bed's key): ``<W, u> / |W|`` is the first
    coordinate of a uniform point on the sphere, ``(x + 1) / 2 ~ Beta((d-1)/2, (d-1)/2)``."""

    kind = "directions"

    def __init__(self, dim: int) -> None:
        if dim < 2:
            raise ValueError(f"Directions: dim must be >= 2, got {dim}")
        self.dim = dim

    def centre(self, change: torch.Tensor) -> torch.Tensor:
        return change.double().reshape(1, -1)

    def variance(self, W: torch.Tensor | Rows) -> float:
        return float((_whole(W) ** 2).sum()) / self.dim

    def tail(self, W: torch.Tensor | Rows, value: float) -> Tail:
        norm = float(_whole(W).norm())
        if norm == 0.0:
            return Tail(0.0 if value <= 0 else -math.inf, "exact")
        x = min(1.0, max(-1.0, value / norm))
        a = 0.5 * (self.dim - 1)
        return Tail(float(beta_dist.logsf(0.5 * (x + 1.0), a, a)) / LN10, "exact")

    def tails(self, W: torch.Tensor | Rows, values: Sequence[float]) -> list[Tail]:
        return [self.tail(W, v) for v in values]

    def random_values(self, Ws: Sequence[torch.Tensor | Rows], n: int, seed: int) -> np.ndarray:
        start = int(np.random.default_rng([seed, 0xD1]).integers(2**62))
        gen = torch.Generator().manual_seed(start)
        dirs = torch.randn(n, self.dim, generator=gen, dtype=torch.float64)
        dirs = dirs / dirs.norm(dim=1, keepdim=True)
        flat = torch.stack([_whole(W).reshape(-1).cpu() for W in Ws])
        return (flat @ dirs.T).numpy()

    def describe(self) -> dict:
        return {"kind": self.kind, "dim": self.dim}


RANK_BLOCK_BYTES = 256 << 20
"""Transient memory of one row block of the rank check's keys (uniforms and masks)."""


def random_values_by_rows(
    srcs: Sequence[Rows], n: int, seed: int, m: int, block_bytes: int = RANK_BLOCK_BYTES
) -> np.ndarray:
    """``<W, key_k>`` (``[len(srcs), n]``) for ``n`` random keys drawn a block of rows at a time,
    the same keys for every change: cells green independently with probability ``m / cols``
    (as :class:`~fedattr.watermarks.nullkeys.RandomGreenLists`; ``m = 1``: one column per row).
    Each block's keys come from a generator seeded by ``(seed, first row)``, its rows fixed by
    ``n``, the columns and ``block_bytes``: the keys do not depend on which changes, or how many,
    are read together. Memory: ``block_bytes`` of keys and the same rows of every change."""
    first = srcs[0]
    cols = first.cols
    if any((s.rows, s.cols) != (first.rows, cols) for s in srcs):
        raise ValueError("random_values_by_rows: the changes differ in shape")
    # The keys of a block (uniforms, masks, floats: 9 bytes a cell each) within block_bytes; the
    # blocks depend on n and cols only, so the keys do not depend on the changes read.
    step = max(1, block_bytes // max(1, 9 * n * cols))
    out = np.zeros((len(srcs), n))
    for lo in range(0, first.rows, step):
        hi = min(first.rows, lo + step)
        gen = torch.Generator().manual_seed((seed * 1_000_003 + lo) % (1 << 63))
        block = torch.from_numpy(np.stack([s.block(lo, hi).reshape(-1) for s in srcs]))
        if m == 1:
            picks = torch.randint(cols, (n, hi - lo), generator=gen)
            cells = picks + cols * torch.arange(hi - lo)
            out += block[:, cells].sum(dim=2).numpy()
        else:
            keys = torch.rand((n, (hi - lo) * cols), generator=gen) < m / cols
            out += (block.float() @ keys.float().T).double().numpy()
    return out


def law_from_dict(data: Mapping) -> KeyLaw:
    """The law :meth:`KeyLaw.describe` wrote."""
    if data.get("kind") == RowSubsets.kind:
        return RowSubsets(int(data["m"]), int(data["cols"]))
    if data.get("kind") == Directions.kind:
        return Directions(int(data["dim"]))
    raise ValueError(f"unknown key law {data!r}")
