"""Exact tails of a detection statistic that is linear in the key.

An owner's statistic over a change ``W`` (rows: probe contexts or questions, columns: the
vocabulary or the candidate values) is ``T = <W, G>``, with ``G`` the owner's key: row ``x``
of ``G`` marks the ``m`` green tokens of context ``x`` (KGW: a uniform ``m``-subset of the
``V`` tokens, ``m = gamma V``) or the true value among the candidates (Fictitious Knowledge:
``m = 1``). Under the null that ``W`` does not depend on the owner's key, ``G`` is a random
key: its rows are independent uniform ``m``-subsets. Each row of ``W`` is centred first (a
function of ``W`` alone), which changes ``T`` by a constant for fixed-size rows and makes its
null mean exactly 0. The tail ``P(T >= t)`` then follows from ``W`` alone, with no random key
drawn:

- **exact** where every row picks one column and the rows' combinations are few (FK): all
  ``prod(cols)`` sums, enumerated half against half (meet in the middle);
- **saddlepoint** (Barndorff-Nielsen's ``r*``, equivalent to Lugannani-Rice) on the cumulant
  generating function of independent cells, each green with probability ``gamma``, where the
  change is spread over at least :data:`MIN_EFFECTIVE_CELLS` effective cells (30). Fixed-size rows
  differ from independent cells by ``O(1 / V)`` in every cumulant of a centred row (the
  variance by the factor ``V / (V - 1)``); the tail check (``experiment calibration``) measures
  the agreement by tilted Monte Carlo;
- elsewhere a valid upper bound, the smaller of two: **chernoff**, ``P(T >= t) <= exp(min_s
  K(s) - s t)`` with ``K`` an upper bound on the fixed-size rows' CGF (:class:`RowSubsetsBound`:
  each row's 16 largest cells exactly (hypergeometric), the rest as draws *with* replacement,
  Hoeffding, 1963, Theorem 4); and **patterns** (:class:`RowPatternsBound`): the rows that carry
  the change read pattern by pattern and convolved, Chernoff's bound kept only for what is left
  over, which removes most of the factor ``z sqrt(2 pi)`` Chernoff's bound stays above the tail.

Where the owner's key itself is at hand, :func:`shifted_keys_p` replaces such a bound by an
exact randomization test over the key shifted row by row (the verdict's ``shifted-keys``).

Every tail is returned as ``log10 p`` (finite far below 1e-300) with the method that gave it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from scipy.signal import fftconvolve
from scipy.special import log_ndtr, logsumexp
from scipy.stats import beta as beta_dist

LN10 = math.log(10.0)
MIN_EFFECTIVE_CELLS = 30.0
"""Below this many effective cells (``(sum w^2)^2 / sum w^4``) the tail is a Chernoff bound.
The saddlepoint reads independent cells: it agrees with tilted Monte Carlo over such keys within
±13% from p = 1e-3 to 1e-6 on the embedded default's changes (13 to 79 effective cells,
``fedattr experiment tail-check``), but where a few cells dominate, fixed-size green lists put
the owner's own value on an atom that independent cells smear: on one dominant cell per row
(10-20 effective cells) their tail was about 2x lighter than the fixed-size lists' exact one.
So the verdict reads it only where no cell carries more than a fifth of the change's mass."""
EXACT_COMBINATIONS = 1 << 22
"""One-column rows are enumerated exactly up to this many combinations."""

BLOCK_CELLS = 1 << 22
"""Cells of one row block where a change is read by blocks (a stored ``W``): 32 MB as float64,
so the tails of a 1e9-cell change hold a few such blocks (and their temporaries) at a time."""


@runtime_checkable
class Rows(Protocol):
    """A ``[rows, cols]`` change read by row blocks (a stored ``W``, e.g. on disk): the tails,
    the variance and the rank check read it a block at a time, never whole."""

    rows: int
    cols: int

    def block(self, lo: int, hi: int) -> np.ndarray:
        """Rows ``lo:hi`` as float64 (a new array the caller may keep)."""
        ...


class DenseRows:
    """:class:`Rows` over a tensor or array held in memory (float64 blocks of it)."""

    def __init__(self, W: torch.Tensor | np.ndarray, cols: int) -> None:
        self.W = W.reshape(-1, cols)
        self.rows, self.cols = int(self.W.shape[0]), cols

    def block(self, lo: int, hi: int) -> np.ndarray:
        b = self.W[lo:hi]
        if isinstance(b, torch.Tensor):
            return b.detach().double().cpu().numpy()
        return np.asarray(b, dtype=np.float64)


def block_rows(cols: int, cells: int = BLOCK_CELLS) -> int:
    """Rows per block of at most ``cells`` cells (at least one row)."""
    return max(1, cells // max(1, cols))


def row_blocks(
    src: Rows, cells: int = BLOCK_CELLS, rows: np.ndarray | None = None
) -> Iterator[np.ndarray]:
    """``src`` a block of rows at a time, in order (``rows``: only these, sorted)."""
    step = block_rows(src.cols, cells)
    for lo in range(0, src.rows, step):
        hi = min(src.rows, lo + step)
        b = src.block(lo, hi)
        if rows is not None:
            b = b[rows[(rows >= lo) & (rows < hi)] - lo]
            if not len(b):
                continue
        yield b


def _blocks_of(W: np.ndarray | Rows, cells: int) -> tuple[Rows, bool]:
    """``W`` as :class:`Rows`, and whether it is one block (then read once and kept)."""
    src = W if isinstance(W, Rows) else DenseRows(W, W.shape[-1])
    return src, src.rows <= block_rows(src.cols, cells)


class _RowBlocksCGF:
    """A row-separable CGF (:class:`RowSubsetsBound`) summed over row blocks, each block read
    and its CGF built again at every evaluation, so only one block is ever held. Where the
    change is one block it is built once (the in-memory CGF itself)."""

    def __init__(
        self,
        src: Rows,
        make: Callable[[np.ndarray], _CGF],
        cells: int = BLOCK_CELLS,
        rows: np.ndarray | None = None,
    ) -> None:
        self.src, self.make, self.cells, self.rows = src, make, cells, rows
        self.mean = 0.0
        self._one: _CGF | None = None
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


@dataclass(frozen=True)
class Tail:
    """``P(T >= t)`` as ``log10 p``, and how it was obtained."""

    log10_p: float
    method: str
    """``exact``, ``saddlepoint``, or an upper bound: ``patterns`` or ``chernoff``."""

    @property
    def p(self) -> float:
        """The p-value (0.0 where it underflows; ``log10_p`` stays finite)."""
        return 10.0**self.log10_p if self.log10_p > -300 else 0.0


class _CGF(Protocol):
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


class RowPatternsBound:
    """A valid upper bound on ``P(sum_x <W_x, G_x> >= t)`` (rows uniform ``m``-subsets,
    independent), near the exact tail where a few rows carry the change.

    Chernoff's bound ``exp(K(s) - s t)`` stays a factor of about ``z sqrt(2 pi)`` above the tail
    even with an exact CGF. Here the rows that carry the change (at most :attr:`MAX_ROWS`, by
    the mass of their ``k`` largest cells) are read by their patterns: every subset of a row's
    ``k`` largest cells has the hypergeometric probability ``C(V - k, m - j) / C(V, m)``, and
    given it the rest of the row is a uniform ``(m - j)``-subset of the other cells, with mean
    ``(m - j) mu`` exactly. ``A``, the patterns' sums plus these conditional means, has a
    discrete law: each row's values are rounded *up* to a grid (:attr:`BINS_PER_SD` steps per
    standard deviation of ``T``) and the rows convolved by FFT. What is left, ``B`` (each chosen
    row's rest about its mean, and every other row), is independent across rows given the
    patterns, with an MGF bounded whatever the patterns (``m`` draws with replacement,
    Hoeffding, 1963; the other rows as in :class:`RowSubsetsBound`). So

        P(T >= t) <= sum_a P(A = a) min(1, min_s exp(K_B(s) - s (t - a))),

    Chernoff's bound on ``B`` alone, at each value of ``A``. Rounding ``A`` up only raises it,
    the minimum runs over a fixed grid of ``s`` (each ``s`` gives a bound), and
    :attr:`FFT_MARGIN` covers the FFT's rounding. Where ``B`` is small against ``A`` this is
    close to the exact tail; where it is not, it is never worse than Chernoff's bound on ``T``
    (the smaller of the two is returned; the patterns are read only where Chernoff's bound is
    below :attr:`READ_BELOW`)."""

    MAX_ROWS = 128
    BINS_PER_SD = 4000
    MAX_BINS = 1 << 21
    FFT_MARGIN = 1e-10
    """Added to the bound for the FFT's rounding (measured: 1e-15 summed over a real change's
    60,000 bins, against direct convolution)."""
    READ_BELOW = 0.1
    """Read the patterns only where Chernoff's bound is below this: above it no verdict is near,
    and on a vocabulary-sized change the patterns take seconds."""
    S_GRID = np.geomspace(1e-2, 1e3, 61)
    """Values of ``s`` (in units of ``1 / sd(T)``) over which Chernoff's bound on ``B`` is read."""

    def __init__(self, W: np.ndarray | Rows, m: int, k: int = 16, cells: int = BLOCK_CELLS) -> None:
        """``W``: the change, or :class:`Rows` read ``cells`` at a time where it is larger
        (then Chernoff's CGF reads every block again at each evaluation, and only the chosen
        rows are held; the bounds are those of the change held whole, up to float rounding)."""
        src, one = _blocks_of(W, cells)
        self.src, self.m, self.cells = src, m, cells
        cols = src.cols
        self.k = k = max(1, min(k, m, cols - m))
        if one:
            self.W: np.ndarray | None = src.block(0, src.rows)
            self.chernoff: _CGF = RowSubsetsBound(self.W, m, k)
            total = float((self.W * self.W).sum())
        else:
            self.W = None
            self.chernoff = _RowBlocksCGF(src, lambda b: RowSubsetsBound(b, m, k), cells)
            total = sum(float((b * b).sum()) for b in row_blocks(src, cells))
        self.sd = math.sqrt(m * (cols - m) / (cols * (cols - 1)) * total)
        self._built = False

    def _build(self) -> None:
        """The chosen rows' patterns and their convolution (once, on the first tail read)."""
        W, m, k = self.W, self.m, self.k
        if W is not None:
            # Chernoff's bound already split each row into its k largest cells and the rest.
            chernoff = self.chernoff
            assert isinstance(chernoff, RowSubsetsBound)
            large, small = chernoff.large, chernoff.small
            energy = (large * large).sum(axis=1)
        else:  # the energy of each row's k largest cells, a block at a time
            energy = np.concatenate(
                [
                    (
                        np.take_along_axis(b, np.argpartition(-np.abs(b), k - 1, axis=1)[:, :k], 1)
                        ** 2
                    ).sum(axis=1)
                    for b in row_blocks(self.src, self.cells)
                ]
            )
        chosen = np.argsort(-energy, kind="stable")[: self.MAX_ROWS]
        chosen = chosen[energy[chosen] > 0]
        others = np.setdiff1d(np.arange(self.src.rows), chosen)
        # The other rows carry little of the change: their largest few cells read exactly suffice.
        self.others: _CGF | None = None
        if W is not None:
            if len(others):
                self.others = RowSubsetsBound(W[others], m, min(k, 2))
            large, small, log_pattern = large[chosen], small[chosen], chernoff.log_pattern
        else:
            if len(others):
                self.others = _RowBlocksCGF(
                    self.src, lambda b: RowSubsetsBound(b, m, min(k, 2)), self.cells, others
                )
            order = np.argsort(chosen)  # read in row order, put back in the order chosen
            rows = np.zeros((len(chosen), self.src.cols))
            if len(chosen):
                rows[order] = np.concatenate(list(row_blocks(self.src, self.cells, chosen[order])))
            sub = RowSubsetsBound(rows, m, k)
            large, small, log_pattern = sub.large, sub.small, sub.log_pattern
        mu = small.mean(axis=1)
        self.rest = small - mu[:, None]
        # Every pattern of the chosen rows' k largest cells: its sum plus the rest's mean.
        sums, count = np.zeros((len(chosen), 1)), np.zeros(1, dtype=np.int64)
        for i in range(k):
            sums = np.concatenate([sums, sums + large[:, i : i + 1]], axis=1)
            count = np.concatenate([count, count + 1])
        A = sums + (m - count)[None, :] * mu[:, None]
        prob = np.exp(log_pattern[count])
        self.P, self.lo, self.h = self._convolve(A, prob) if len(chosen) else (None, 0.0, 0.0)
        self._K: np.ndarray | None = None
        self._built = True

    def _convolve(self, A: np.ndarray, prob: np.ndarray) -> tuple[np.ndarray, float, float]:
        """The law of ``sum_rows A`` with each row rounded up to the grid: (masses, the grid's
        first value, its step)."""
        lo = A.min(axis=1)
        span = float((A.max(axis=1) - lo).sum())
        h = max(self.sd / self.BINS_PER_SD, span / (self.MAX_BINS - len(A)))
        bins = np.ceil((A - lo[:, None]) / h).astype(np.int64)
        laws = [np.bincount(row, weights=prob) for row in bins]
        # Pairwise, so that most products are short: rows x (total length) would not be.
        while len(laws) > 1:
            pairs = [fftconvolve(a, b) for a, b in zip(laws[::2], laws[1::2], strict=False)]
            laws = pairs + ([laws[-1]] if len(laws) % 2 else [])
        return np.clip(laws[0], 0.0, None), float(lo.sum()), h

    def _cgf_rest(self) -> np.ndarray:
        """``K_B(s)`` on :attr:`S_GRID` (computed once)."""
        if self._K is None:
            out = []
            for s in self.S_GRID / self.sd:
                k = self.m * float(
                    (logsumexp(s * self.rest, axis=1) - math.log(self.rest.shape[1])).sum()
                )
                out.append(k + (self.others(s)[0] if self.others is not None else 0.0))
            self._K = np.array(out)
        return self._K

    def patterns_log10_sf(self, t: float) -> float:
        """``log10`` of the patterns' bound at ``t`` alone (0 where it does not apply)."""
        if self.sd <= 0 or t <= 0:
            return 0.0
        if not self._built:
            self._build()
        if self.P is None:
            return 0.0
        x = t - (self.lo + self.h * np.arange(len(self.P)))  # below the true gap: rounded up
        K, s = self._cgf_rest(), self.S_GRID / self.sd
        keep = (self.P > 0) & (x > 0)
        log_b = np.zeros(len(x))
        if keep.any():
            log_b[keep] = np.minimum(0.0, (K[None, :] - s[None, :] * x[keep, None]).min(axis=1))
        # Mass the grid lost to rounding in the pattern probabilities may lie anywhere: above t.
        lost = max(0.0, 1.0 - float(self.P.sum()))
        bound = float(np.dot(self.P, np.exp(log_b))) + self.FFT_MARGIN + lost
        return math.log10(min(1.0, bound)) + 1e-9

    def tail(self, t: float) -> Tail:
        """The smaller of the two bounds at ``t``, and which it was (``patterns`` or
        ``chernoff``)."""
        chernoff = chernoff_log10_sf(self.chernoff, t)
        if chernoff >= math.log10(self.READ_BELOW):
            return Tail(chernoff, "chernoff")
        patterns = self.patterns_log10_sf(t)
        return Tail(patterns, "patterns") if patterns < chernoff else Tail(chernoff, "chernoff")


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def _saddle(cgf: _CGF, t: float, mean: float) -> tuple[float, float, float]:
    """``(s, K(s), K''(s))`` at ``K'(s) = t`` (safeguarded Newton on the convex ``K``)."""
    lo, hi = (0.0, math.inf) if t >= mean else (-math.inf, 0.0)
    s = 0.0
    _, _, k2 = cgf(0.0)
    s = (t - mean) / k2 if k2 > 0 else 0.0
    for _ in range(200):
        k, k1, k2 = cgf(s)
        if k1 < t:
            lo = max(lo, s)
        else:
            hi = min(hi, s)
        step = (t - k1) / k2 if k2 > 0 else math.inf
        nxt = s + step
        if not (lo < nxt < hi) or not math.isfinite(nxt):
            if math.isinf(hi):
                nxt = 2.0 * s if s > 0 else 1.0
            elif math.isinf(lo):
                nxt = 2.0 * s if s < 0 else -1.0
            else:
                nxt = 0.5 * (lo + hi)
        if abs(nxt - s) <= 1e-12 * max(1.0, abs(s)):
            s = nxt
            break
        s = nxt
    k, _, k2 = cgf(s)
    return s, k, k2


def saddlepoint_log10_sf(cgf: _CGF, t: float, mean: float = 0.0) -> float:
    """``log10 P(T >= t)`` by Barndorff-Nielsen's ``r* = r + log(u / r) / r`` (the
    Lugannani-Rice approximation in a form that never leaves ``[0, 1]``)."""
    _, _, var0 = cgf(0.0)
    if var0 <= 0.0:
        return 0.0 if t <= mean else -math.inf
    if abs(t - mean) < 1e-6 * math.sqrt(var0):
        return math.log10(0.5)
    s, k, k2 = _saddle(cgf, t, mean)
    r = math.copysign(math.sqrt(max(0.0, 2.0 * (s * t - k))), s)
    u = s * math.sqrt(k2)
    if abs(r) < 1e-4:
        return float(log_ndtr(-(t - mean) / math.sqrt(var0))) / LN10
    if u / r <= 0:  # at the edge of the support (K'' underflowed): Chernoff's bound, valid
        return min(0.0, (k - s * t) / LN10)
    rstar = r + math.log(u / r) / r
    return float(log_ndtr(-rstar)) / LN10


def chernoff_log10_sf(cgf: _CGF, t: float, mean: float = 0.0) -> float:
    """``log10`` of Chernoff's bound ``min_{s >= 0} exp(K(s) - s t)`` (1 for ``t <= mean``)."""
    if t <= mean:
        return 0.0
    s, k, _ = _saddle(cgf, t, mean)
    # Where the bound is exact (at the support's edge, every dominant cell green) rounding can
    # put it a few ulps below the truth: a margin far below any reported digit keeps it above.
    return min(0.0, (k - s * t) / LN10 + 1e-9)


def exact_one_of_log10_sf(W: np.ndarray, t: float) -> float:
    """``log10 P(sum_x W[x, c_x] >= t)`` with every ``c_x`` uniform and independent, by
    enumerating both halves of the rows (``prod(cols)`` at most :data:`EXACT_COMBINATIONS`)."""

    def sums(rows: np.ndarray) -> np.ndarray:
        out = np.zeros(1)
        for row in rows:
            out = (out[:, None] + row[None, :]).reshape(-1)
        return out

    half = len(W) // 2
    a, b = sums(W[:half]), np.sort(sums(W[half:]))
    # Tolerance: the owner's own sum must count as reaching itself despite float rounding.
    tol = 1e-6 * max(1.0, float(np.abs(W).sum()))
    hits = int((len(b) - np.searchsorted(b, t - a - tol, side="left")).sum())
    # The owner's own combination is one of them: at least one, whatever the rounding.
    return math.log10(max(hits, 1) / (len(a) * len(b)))


SHIFT_HITS = 100
"""A shifted-key test stops once this many shifted keys reach the owner's value (Besag and
Clifford's sequential rule): p is then known to about 10% where it is far from any cut."""
SHIFT_MAX_KEYS = 1_000_000
"""At most this many shifted keys per (client, owner): p down to ``1 / (1 + 10^6)``."""
SHIFT_MAX_CELLS = 1 << 28
"""The test holds one float32 value per cell of the change (1 GB at this many cells); larger
changes keep their bound."""


def shifted_keys_p(
    W: np.ndarray,
    G: np.ndarray,
    seed: int | Sequence[int],
    max_keys: int = SHIFT_MAX_KEYS,
    hits: int = SHIFT_HITS,
) -> tuple[float, int]:
    """An exact p-value of ``<W, G>`` by a randomization test over the owner's key shifted row
    by row; returns ``(p, keys drawn)``.

    Under the null (``W`` independent of the key, every row of ``G`` a uniform ``m``-subset of
    the columns) the key's law is invariant under shifting each row's columns cyclically, so
    the owner's value is exchangeable with its values under keys ``g G``, ``g`` a uniformly
    random shift per row; counting the owner's own key among them gives a p-value that is
    exact at any number of keys (Hemerik and Goeman, 2018). Shifted keys are cheap: with
    ``c[x, s] = sum_v W[x, v] G[x, v - s]`` (one FFT per row), a key is one value per row, so
    a million keys cost a read of ``rows x 10^6`` numbers, not of ``rows x vocab x 10^6``.

    Sequential (Besag and Clifford, 1991): keys are drawn until ``hits`` of them reach the
    owner's value, ``p = hits / keys``, or ``max_keys`` were drawn, ``p = (1 + reached) /
    (1 + max_keys)``; both are valid p-values, and a p far above any cut costs few keys."""
    G = np.asarray(G).reshape(-1, np.asarray(G).shape[-1])
    W = np.asarray(W, dtype=np.float64).reshape(G.shape)
    rows = np.flatnonzero(np.any(W != 0.0, axis=1))
    if len(rows) == 0:
        return 1.0, 0
    cols = W.shape[1]
    # float32: the test is exact for whatever statistic of the shifted key it computes, as long
    # as the owner's own key goes through the same arithmetic (shift 0 of the same table).
    c = np.empty((len(rows), cols), dtype=np.float32)
    step = max(1, (1 << 22) // cols)  # rows per FFT: about 64 MB of spectra at a time
    for start in range(0, len(rows), step):
        block = rows[start : start + step]
        spectrum = np.fft.rfft(W[block], axis=1) * np.conj(
            np.fft.rfft(G[block].astype(np.float64), axis=1)
        )
        c[start : start + len(block)] = np.fft.irfft(spectrum, n=cols, axis=1)
    observed = float(c[:, 0].sum(dtype=np.float64))
    # Sums of the same float32 values in another order differ by rounding: a key within this of
    # the owner's value counts as reaching it (which can only raise p).
    tol = 1e-5 * float(np.abs(c).max(axis=1).astype(np.float64).sum())
    rng = np.random.default_rng(seed)
    table = c.reshape(-1)
    offsets = (np.arange(len(rows), dtype=np.int64) * cols)[None, :]
    reached, drawn, chunk = 0, 0, 256
    cap = max(256, int(4e6 // len(rows)))  # shifts held at once: about 32 MB
    while drawn < max_keys:
        n = min(chunk, cap, max_keys - drawn)
        shifts = rng.integers(cols, size=(n, len(rows)), dtype=np.int32) + offsets
        values = np.take(table, shifts).sum(axis=1, dtype=np.float64)
        cum = np.cumsum(values >= observed - tol)
        if reached + int(cum[-1]) >= hits:
            stop = int(np.searchsorted(cum, hits - reached))  # the key that makes ``hits``
            return hits / (drawn + stop + 1), drawn + stop + 1
        reached += int(cum[-1])
        drawn += n
        chunk *= 2
    return (1 + reached) / (1 + drawn), drawn


def effective_cells(W: np.ndarray) -> float:
    """``(sum w^2)^2 / sum w^4``: over how many cells the change is spread."""
    w = W.reshape(-1)
    total = float(np.dot(w, w))
    if total <= 0:
        return 0.0
    sq = w * w
    return total * total / float(np.dot(sq, sq))


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
        from .nullkeys import RandomGreenLists

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


def tilted_monte_carlo(
    W: np.ndarray,
    gamma: float,
    t: float,
    n: int,
    seed: int = 0,
    cgf: BernoulliCells | None = None,
    device: str | torch.device | None = None,
) -> tuple[float, float]:
    """``(p, relative standard error)`` of ``P(<w, B> >= t)`` for independent Bernoulli(gamma)
    cells (the random keys' law), by importance sampling from the CGF's exponential tilt at the
    saddlepoint: the check of :func:`saddlepoint_log10_sf` far in the tail.

    ``cgf``: ``BernoulliCells`` of the same nonzero cells, when the caller has it (building it
    reads every cell). ``device``: draw the keys with torch there (a GPU draws a vocabulary-sized
    key in a millisecond); ``None`` draws them with numpy."""
    w = W.reshape(-1)
    w = w[w != 0.0]
    if cgf is None:
        cgf = BernoulliCells(w, gamma)
    s, k, _ = _saddle(cgf, t, cgf.mean)
    pi = 0.5 * (1.0 + np.tanh(0.5 * (cgf.log_odds + s * w)))
    if device is None:
        rng = np.random.default_rng(seed)
        T = np.empty(n)
        chunk = max(1, int(4e7 // max(1, w.size)))
        for start in range(0, n, chunk):
            count = min(chunk, n - start)
            draws = rng.random((count, w.size)) < pi
            T[start : start + count] = draws.astype(np.float64) @ w
    else:
        T = _tilted_sums_torch(w, pi, n, seed, torch.device(device))
    weights = np.where(t <= T, np.exp(k - s * T), 0.0)
    p = float(weights.mean())
    se = float(weights.std(ddof=1) / math.sqrt(n)) if n > 1 else math.inf
    return p, se / p if p > 0 else math.inf


def _tilted_sums_torch(
    w: np.ndarray, pi: np.ndarray, n: int, seed: int, device: torch.device
) -> np.ndarray:
    """``n`` sums ``<w, B>`` with ``B_c ~ Bernoulli(pi_c)``, drawn with torch on ``device``."""
    wt = torch.from_numpy(w).to(device)
    pt = torch.from_numpy(pi).to(device=device, dtype=torch.float32)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = torch.empty(n, dtype=torch.float64, device=device)
    chunk = max(1, int(2.5e8 // max(1, w.size)))  # ~1 GB of uniforms at a time
    for start in range(0, n, chunk):
        count = min(chunk, n - start)
        u = torch.rand((count, w.size), generator=gen, device=device)
        out[start : start + count] = torch.where(u < pt, wt, 0.0).sum(dim=1)
    return out.cpu().numpy()
