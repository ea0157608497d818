"""The tail methods: ``log10 P(<W, G> >= t)`` under a random key, and how it was obtained.

Exact enumeration (:func:`exact_one_of_log10_sf`), the saddlepoint (:func:`saddlepoint_log10_sf`),
the valid upper bounds (:func:`chernoff_log10_sf`, :class:`RowPatternsBound`), the exact
randomization test over the owner's key shifted row by row (:func:`shifted_keys_p`), and
tilted Monte Carlo (:func:`tilted_monte_carlo`), the saddlepoint's check far in the tail. Which
method a change is read with is its key law's choice (:mod:`fedattr.watermarks.tail.laws`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy.signal import fftconvolve
from scipy.special import log_ndtr, logsumexp

from ...rows import BLOCK_CELLS, Rows, blocks_of, row_blocks
from .cgf import CGF, BernoulliCells, RowBlocksCGF, RowSubsetsBound

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
        src, one = blocks_of(W, cells)
        self.src, self.m, self.cells = src, m, cells
        cols = src.cols
        self.k = k = max(1, min(k, m, cols - m))
        if one:
            self.W: np.ndarray | None = src.block(0, src.rows)
            self.chernoff: CGF = RowSubsetsBound(self.W, m, k)
            total = float((self.W * self.W).sum())
        else:
            self.W = None
            self.chernoff = RowBlocksCGF(src, lambda b: RowSubsetsBound(b, m, k), cells)
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
        self.others: CGF | None = None
        if W is not None:
            if len(others):
                self.others = RowSubsetsBound(W[others], m, min(k, 2))
            large, small, log_pattern = large[chosen], small[chosen], chernoff.log_pattern
        else:
            if len(others):
                self.others = RowBlocksCGF(
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


def _saddle(cgf: CGF, t: float, mean: float) -> tuple[float, float, float]:
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


def saddlepoint_log10_sf(cgf: CGF, t: float, mean: float = 0.0) -> float:
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


def chernoff_log10_sf(cgf: CGF, t: float, mean: float = 0.0) -> float:
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
