"""Cumulant generating functions of ``<W, G>`` under a random key, as ``(K, K', K'')``.

:class:`BernoulliCells` (independent green cells: the saddlepoint's), :class:`RowDraws` (draws
per row), :class:`RowSubsetsBound` (an upper bound for fixed-size rows: Chernoff's), and
:class:`RowBlocksCGF`, any row-separable one summed over row blocks of a change too large to
hold.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Protocol

import numpy as np
from scipy.special import logsumexp

from ...rows import BLOCK_CELLS, Rows, block_rows, row_blocks


class CGF(Protocol):
    def __call__(self, s: float) -> tuple[float, float, float]:
        """``K(s), K'(s), K''(s)``."""
        ...


def _bernoulli_cumulants(gamma: float, order: int) -> np.ndarray:
    """``kappa_1 .. kappa_order`` of a Bernoulli(``gamma``) variable: ``kappa_1 = gamma`` and
    ``kappa_{n+1} = gamma (1 - gamma) d kappa_n / d gamma`` (polynomials in ``gamma``)."""
    poly = np.polynomial.Polynomial
    k, out = poly([0.0, 1.0]), []
    step = poly([0.0, 1.0, -1.0])  # gamma (1 - gamma)
    for _ in range(order):
        out.append(float(k(gamma)))
        k = step * k.deriv()
    return np.array(out)


class BernoulliCells:
    """CGF of ``<w, B>`` with independent ``B ~ Bernoulli(gamma)`` cells (``w`` centred).

    A change over a vocabulary has tens of millions of cells, nearly all far smaller than
    ``1 / s`` at the saddlepoint: their part of ``K`` is its cumulant series in ``s w``, from
    power sums taken once (:data:`SERIES_ORDER` terms; each left-out term is below ``1e-17`` of
    a cell's ``K`` while ``|s w| <= 0.1``), so each evaluation reads only the few large cells.
    Beyond ``|s| = 0.1 / tau`` every cell is read directly."""

    SERIES_ORDER = 12
    S_CAP = 50.0
    """The series serves ``|s| <= S_CAP``: cells with ``|w| <= 0.1 / S_CAP`` go into it."""

    def __init__(self, w: np.ndarray | Callable[[], Iterable[np.ndarray]], gamma: float) -> None:
        """``w``: the cells, or a callable that yields them a block at a time, again at each
        call (a change too large to hold: the power sums and large cells are taken block by
        block, and only an evaluation beyond :attr:`S_CAP` reads every cell again)."""
        self._blocks = None if isinstance(w, np.ndarray) else w
        self.log_odds = math.log(gamma) - math.log1p(-gamma)
        self.log_q = math.log1p(-gamma)
        self.tau = 0.1 / self.S_CAP
        order, self.power = self.SERIES_ORDER, np.zeros(self.SERIES_ORDER)
        total, large, self.n_small, self.size = 0.0, [], 0, 0
        for block in [w] if isinstance(w, np.ndarray) else w():
            b = block.reshape(-1)
            b = b[b != 0.0]
            total += float(b.sum())
            self.size += b.size
            small = np.abs(b) <= self.tau
            large.append(b[~small])
            self.n_small += int(small.sum())
            # Power sums sum w^n (n = 1..order) of the small cells, in chunks (memory).
            tiny = b[small]
            for lo in range(0, tiny.size, 1 << 22):
                x = tiny[lo : lo + (1 << 22)]
                acc = x.copy()
                for n in range(order):
                    if n:
                        acc *= x
                    self.power[n] += float(acc.sum())
            if self._blocks is None:
                self.w = b
        self.mean = gamma * total
        self.large = large[0] if len(large) == 1 else np.concatenate(large)
        kappa = _bernoulli_cumulants(gamma, order + 1)
        fact = np.array([math.factorial(n) for n in range(order + 2)], dtype=np.float64)
        # K_small(s) = sum_n kappa_n P_n s^n / n!, and its first two derivatives.
        n = np.arange(1, order + 1)
        self._c0 = kappa[:order] * self.power / fact[n]
        self._c1 = kappa[:order] * self.power / fact[n - 1]
        self._c2 = np.where(n >= 2, kappa[:order] * self.power / fact[np.maximum(n - 2, 0)], 0.0)

    def _cells(self, w: np.ndarray, s: float) -> tuple[float, float, float]:
        x = self.log_odds + s * w
        k = float(np.sum(np.logaddexp(0.0, x))) + w.size * self.log_q
        pi = 0.5 * (1.0 + np.tanh(0.5 * x))  # the tilted green probability, stable
        return k, float(np.dot(w, pi)), float(np.dot(w * w, pi * (1.0 - pi)))

    def __call__(self, s: float) -> tuple[float, float, float]:
        if abs(s) > self.S_CAP:
            if self._blocks is None:
                return self._cells(self.w, s)
            k = k1 = k2 = 0.0
            for block in self._blocks():
                b = block.reshape(-1)
                a, c1, c2 = self._cells(b[b != 0.0], s)
                k, k1, k2 = k + a, k1 + c1, k2 + c2
            return k, k1, k2
        k, k1, k2 = self._cells(self.large, s)
        n = np.arange(1, self.SERIES_ORDER + 1)
        k += float(np.sum(self._c0 * s**n))
        k1 += float(np.sum(self._c1 * s ** (n - 1)))
        k2 += float(np.sum(self._c2[1:] * s ** (n[1:] - 2)))
        return k, k1, k2


class RowDraws:
    """CGF of ``m`` independent uniform draws per row, summed over rows (``m = 1``: exactly a
    random pick per row; ``m > 1``: an upper bound on a uniform ``m``-subset's, Hoeffding)."""

    def __init__(self, W: np.ndarray, m: int) -> None:
        self.W, self.m = W, m
        self.log_cols = math.log(W.shape[1])
        self.mean = m * float(W.mean(axis=1).sum())

    def __call__(self, s: float) -> tuple[float, float, float]:
        x = s * self.W
        lse = logsumexp(x, axis=1, keepdims=True)
        pi = np.exp(x - lse)
        first = (pi * self.W).sum(1)
        second = (pi * self.W * self.W).sum(1) - first * first
        k = float((lse[:, 0] - self.log_cols).sum())
        return self.m * k, self.m * float(first.sum()), self.m * float(second.sum())


class RowSubsetsBound:
    """An upper bound on the CGF of ``sum_x <W_x, G_x>`` with each row ``G_x`` a uniform
    ``m``-subset of its columns (rows independent), tight where a few cells dominate a row.

    Each row's ``k`` largest cells (by ``|w|``) are read exactly: ``j`` of them are green with
    the hypergeometric probability ``C(V - k, m - j) / C(V, m)`` per pattern, and the patterns'
    sums enter through the elementary symmetric polynomials of ``exp(s w)``. The other ``m - j``
    green cells are a uniform subset of the rest, whose MGF is bounded by ``m - j`` draws *with*
    replacement (Hoeffding, 1963, Theorem 4). ``k = 0`` is :class:`RowDraws` with ``m`` draws.
    Drawing with replacement from the whole row lets a dominant cell be picked many times; here
    it is picked at most once, so the Chernoff bound comes far closer to the fixed-size tail on
    few effective cells while staying valid. Returns ``(K, K', K'')`` like the other CGFs."""

    def __init__(self, W: np.ndarray, m: int, k: int = 16) -> None:
        rows, cols = W.shape
        self.m = m
        self.k = k = max(0, min(k, m, cols - m))
        if k:
            top = np.argpartition(-np.abs(W), k - 1, axis=1)[:, :k]
            self.large = np.take_along_axis(W, top, axis=1)
            rest = np.ones(W.shape, dtype=bool)
            np.put_along_axis(rest, top, False, axis=1)
            self.small = W[rest].reshape(rows, cols - k)
        else:
            self.large, self.small = np.zeros((rows, 0)), W
        self.j = np.arange(k + 1)
        # log C(V - k, m - j) - log C(V, m): the probability of one pattern with j green.
        self.log_pattern = np.array(
            [_log_comb(cols - k, m - j) - _log_comb(cols, m) for j in range(k + 1)]
        )
        self.mean = 0.0  # rows centred: the fixed-size sum has mean m * (row mean) = 0

    def __call__(self, s: float) -> tuple[float, float, float]:
        rows = self.small.shape[0]
        # The small cells: log mean exp(s w) per row and its first two derivatives.
        x = s * self.small
        lse = logsumexp(x, axis=1, keepdims=True)
        q = np.exp(x - lse)
        ls = lse[:, 0] - math.log(self.small.shape[1])
        ls1 = (q * self.small).sum(1)
        ls2 = (q * self.small * self.small).sum(1) - ls1 * ls1
        # The large cells: log e_j of exp(s w) and the tilted mean and second moment of the
        # pattern's sum, built one cell at a time (normalised, so nothing overflows).
        J = self.k + 1
        le = np.full((rows, J), -np.inf)
        le[:, 0] = 0.0
        mu1, mu2 = np.zeros((rows, J)), np.zeros((rows, J))
        for i in range(self.k):
            w = self.large[:, i : i + 1]
            take = s * w + le[:, :-1]  # this cell green on top of a pattern with j - 1
            new = np.logaddexp(le[:, 1:], take)
            with np.errstate(invalid="ignore"):
                a = np.where(np.isfinite(new), np.exp(le[:, 1:] - new), 0.0)
                b = np.where(np.isfinite(new), np.exp(take - new), 0.0)
            m1 = a * mu1[:, 1:] + b * (mu1[:, :-1] + w)
            m2 = a * mu2[:, 1:] + b * (mu2[:, :-1] + 2 * w * mu1[:, :-1] + w * w)
            le[:, 1:], mu1[:, 1:], mu2[:, 1:] = new, m1, m2
        rest = (self.m - self.j)[None, :]
        terms = self.log_pattern[None, :] + le + rest * ls[:, None]
        k_row = logsumexp(terms, axis=1, keepdims=True)
        pi = np.exp(terms - k_row)
        d1 = mu1 + rest * ls1[:, None]
        d2 = (mu2 - mu1 * mu1) + rest * ls2[:, None]
        k1 = (pi * d1).sum(1)
        k2 = (pi * (d2 + d1 * d1)).sum(1) - k1 * k1
        return float(k_row.sum()), float(k1.sum()), float(k2.sum())


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


class RowBlocksCGF:
    """A row-separable CGF (:class:`RowSubsetsBound`) summed over row blocks, each block read
    and its CGF built again at every evaluation, so only one block is ever held. Where the
    change is one block it is built once (the in-memory CGF itself)."""

    def __init__(
        self,
        src: Rows,
        make: Callable[[np.ndarray], CGF],
        cells: int = BLOCK_CELLS,
        rows: np.ndarray | None = None,
    ) -> None:
        self.src, self.make, self.cells, self.rows = src, make, cells, rows
        self.mean = 0.0
        self._one: CGF | None = None
        if src.rows <= block_rows(src.cols, cells):
            (w,) = list(row_blocks(src, cells, rows)) or [np.zeros((0, src.cols))]
            self._one = make(w)

    def __call__(self, s: float) -> tuple[float, float, float]:
        if self._one is not None:
            return self._one(s)
        k = k1 = k2 = 0.0
        for w in row_blocks(self.src, self.cells, self.rows):
            a, b, c = self.make(w)(s)
            k, k1, k2 = k + a, k1 + b, k2 + c
        return k, k1, k2
