"""Calibrated verdicts: a statistic linear in the owner's key, and its exact tail.

The paper reads each round's differential score as N(0, 1) and adds rounds with Stouffer. On a
real model neither holds (docs, *Findings*): the round's common learning direction projects on
a fixed key as one draw shared by every client and round, a client's own data drift does the
same round after round, and each estimate carries alpha-weighted copies of the watermarked
clients' updates (cross-talk). Here each client's evidence is kept as a *change matrix* that
does not depend on any key, and an owner's statistic is that matrix read with the owner's key:

1. **Changes.** The detector turns each estimate into a change that its statistic is linear in
   (KGW reading: the next-token distributions' change per previous token, ``[contexts,
   vocab]``; FK: the candidate values' log-probability change per attribute; the synthetic
   bed: the parameter change).
2. **Cross-talk undone.** When every participant of a round is a target, the round's changes
   are ``Y = A X`` with ``A`` the known design matrix (row i: 1 for the target, alpha for the
   others), so ``X = A^{-1} Y`` is each client's own change. Hardened mode targets few clients
   per round, so no round alone undoes it; there every such round is stacked and de-mixed
   across rounds instead (``attribution.across_rounds = "demix"``, :class:`DeMixer`): each
   client's mean change over the rounds by generalised least squares, centred by the
   cell-wise median over the clients, is read once as that client's ``W_i``.
3. **Centred without a key.** From each client's change, the cell-wise median over the
   round's clients is subtracted where cross-talk was undone (a minority of watermarked clients
   barely moves it), else the change the round's SA mean makes: a centre that is a function
   of the changes alone, the same whatever key reads it.
4. **Standardised and summed.** Each (client, round) change is divided by the standard
   deviation its statistic has under a random key (analytic, key-free), so every round weighs
   the same, as in Stouffer, and summed over rounds: ``W_i = sum_t (E_it - C_t) / sigma_it``.
5. **Exact tail.** The owner's statistic is ``<W_i, G>``; with ``W_i`` fixed, its law under a
   random key is known exactly (:mod:`fedattr.watermarks.tail`: exact enumeration, saddlepoint
   or a Chernoff bound; where it is a bound and the detector lends the owner's key, an
   exact randomization test over that key shifted row by row; the method is recorded).
   Over several owners ``p`` is
   Bonferroni-adjusted and a client is named when it is below ``alpha / K``: family-wise level
   ``alpha`` over clients x owners. ``null_keys`` random keys read ``W_i`` once at the end as a
   check (``p_rank``, resolution ``1 / (null_keys + 1)``).

A detector whose key is exchangeable with a random one only in the first rounds says so
(``exchangeable_rounds``; FK: 1, since from round 2 the reference model has learned the owner's
facts from the watermarked clients, and no decoy matches that). By default only those rounds
are read (``attribution.late_rounds = "skip"``), so its p-values stay exact; reading every round
makes them uncalibrated: reported, and no client is named by them unless
``attribution.name_uncalibrated`` asks for it. The same holds for a client with a round whose
cross-talk was kept and not de-mixed (``attribution.across_rounds = "keep"``, or a client the
stacked rounds do not identify): its estimate then carries alpha-weighted copies of the other
clients' updates, watermarked ones included, which the SA mean does not remove (measured on the
synthetic bed at r = 3: 6.3% of runs named a clean client at family-wise 1%). De-mixed, a
watermarked client's key-aligned change leaks into another client's only through its variation
across rounds (see :class:`DeMixer`): none on the synthetic bed, whose watermark signal is the
same every round.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.stats import norm

from ..errors import UserError
from ..linalg import StackedGLS
from ..rows import DiskRows, Rows, TemporaryFolder
from ..watermarks.tail.laws import KeyLaw, RowSubsets, law_from_dict
from ..watermarks.tail.methods import SHIFT_MAX_CELLS, Tail, shifted_keys_p
from .config import AttributionConfig
from .contract import (
    LinearKeyScorer,
    OwnerKeys,
    Parts,
    ReferenceProbabilities,
    RowOwnerValues,
)
from .design import QueryDesign, own_update_design
from .stouffer import AttributionReport, ClientAttribution

SHIFTED_FLOOR = 0.01
"""The shifted-key test's p is read above ``level x`` this (see :meth:`CalibratedNull._shifted`)."""
BOUNDS = ("patterns", "chernoff")
"""Tail methods that are upper bounds, not the tail itself."""


def taper_weights(scorer: Any, reference: Any, exponent: float, start: float) -> Parts | None:
    """Each cell's weight ``min(1, start / p) ** exponent`` from its reference probability
    ``p`` (``None`` where ``exponent`` is 0 or the detector has no such probabilities).

    The change of a likely token is mostly the client's own drift (the model growing more or
    less sure of what it already predicts), while a key's green lists move every token of a
    context in proportion to its probability: above ``start``, a cell's change is read on a
    scale that grows more slowly than ``p`` (``exponent = 0.5``: its change over ``sqrt(p)``,
    the Fisher-information scale of a probability). Below ``start`` every cell keeps weight
    1, so rare tokens, whose changes follow shared embeddings rather than any key, are never
    amplified. The weights depend on the reference model only (the same for every client of
    the round and every key), so the round stays linear in each estimate and the exact tail
    under a random key still holds."""
    if exponent == 0.0 or not isinstance(scorer, ReferenceProbabilities):
        return None
    return {
        part: (start / p.double().clamp_min(1e-30)).clamp(max=1.0).pow(exponent).float()
        for part, p in scorer.reference_probabilities(reference).items()
    }


def _design_matrix(designs: Sequence[QueryDesign], order: Sequence[int]) -> np.ndarray:
    """Row i: the weight of every participant (in ``order``) in target i's estimate."""
    rows = []
    for d in designs:
        coef = d.coefficients()
        rows.append([coef.get(p, 0.0) for p in order])
    return np.array(rows, dtype=np.float64)


def cross_talk(
    participants: Sequence[int],
    targets: Sequence[int],
    designs: Sequence[QueryDesign],
    decorrelate: bool = True,
) -> np.ndarray | None:
    """The round's design matrix where its cross-talk is undone (every participant a target,
    a well-conditioned design), else ``None``."""
    if not (decorrelate and targets and sorted(targets) == sorted(participants)):
        return None
    A = _design_matrix(designs, targets)
    return A if np.linalg.cond(A) < 1e8 else None


def undo_updates(
    participants: Sequence[int],
    targets: Sequence[int],
    designs: Sequence[QueryDesign],
    updates: Sequence[Any],
    decorrelate: bool = True,
) -> tuple[Sequence[Any], list[QueryDesign]]:
    """Each target's own update from the round's estimates, ``A^{-1}`` applied to the estimates
    themselves (``attribution.undo = "updates"``), with the designs that now describe them (each
    its client's update alone); the estimates and designs as they are where the round's
    cross-talk cannot be undone.

    Undoing cross-talk on the changes instead (``A^{-1}`` over the read changes) is exact only
    for the part of a change that is linear in the estimate: read as applied, a curved detector
    (a softmax) keeps second-order traces of the other clients' updates in each recovered
    change, and loses part of the client's own. Undone here, every model read is
    ``w^{t-1} + Delta_i`` exactly (up to float rounding), as a perfect estimator would give.
    This reveals nothing the released estimates do not already determine jointly: ``A`` is
    invertible exactly when they do (Finding 1)."""
    A = cross_talk(participants, targets, designs, decorrelate)
    if A is None:
        return list(updates), list(designs)
    own = UndoneUpdates(np.linalg.inv(A), updates)
    return own, [own_update_design(t, targets) for t in targets]


class UndoneUpdates(Sequence):
    """Each target's own update, ``A^{-1}`` row ``i`` applied to the round's estimates, formed
    when it is read: a round holds the estimates and the update being read, not K more
    updates (0.3 GB for SmolLM2)."""

    def __init__(self, inv: np.ndarray, updates: Sequence[Any]) -> None:
        self.inv, self.updates = inv, updates

    def __len__(self) -> int:
        return len(self.inv)

    def __getitem__(self, i):
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        first = self.updates[0]
        if isinstance(first, Mapping):
            return {
                name: _combination(self.inv[i], [u[name] for u in self.updates]).to(t.dtype)
                for name, t in first.items()
            }
        return _combination(self.inv[i], list(self.updates)).to(first.dtype)


def _combination(weights: np.ndarray, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sum_k weights[k] * tensors[k]`` in float64, term by term in a fixed order (not a matrix
    product, whose summation order depends on the threads that run it): the same bits in a
    background scorer as in line."""
    total = torch.zeros_like(tensors[0], dtype=torch.float64)
    for w, t in zip(weights, tensors, strict=True):
        total = total + float(w) * t.double()
    return total


def _combine(inv: np.ndarray, Y: torch.Tensor, at_once: bool = False) -> torch.Tensor:
    """``inv @ Y`` (float32), row ``i`` being :func:`_combination` ``(inv[i], Y)``: the same bits.
    ``at_once`` converts ``Y`` to float64 once and sums in place (twice as fast; memory: ``Y``
    in float64), for a block of rows; else each term is converted as it is added (a change held
    whole, where a float64 copy of every client's change would double the round's memory)."""
    if not at_once:
        return torch.stack([_combination(inv[i], list(Y)).float() for i in range(len(Y))])
    Yd = Y.double()
    out = torch.empty_like(Y)
    total, term = torch.empty_like(Yd[0]), torch.empty_like(Yd[0])
    for i in range(len(Y)):
        total.zero_()
        for k in range(len(Y)):
            # w * t rounded, then added: _combination's two roundings, in its order.
            torch.mul(Yd[k], float(inv[i][k]), out=term)
            total.add_(term)
        out[i] = total
    return out


_AT_ONCE_CELLS = 1 << 23
"""Cells of a round's changes (every target's) that :func:`_combine` converts to float64 at
once when a change is held whole (64 MB in float64; a part of an embedded-default round is
3M)."""

_MEDIAN_BLOCK = 1 << 24
"""Elements sorted at once by :func:`_median` off the CPU (0.2 GB of float32 values and their
int64 indices)."""


def _middle(s: torch.Tensor) -> torch.Tensor:
    k = s.shape[0]
    return s[k // 2] if k % 2 else 0.5 * (s[k // 2 - 1] + s[k // 2])


def _median(X: torch.Tensor, block: int = _MEDIAN_BLOCK) -> torch.Tensor:
    """Cell-wise median over dim 0 (the mean of the two middle values for an even count)."""
    k = X.shape[0]
    if X.device.type == "cpu" and k > 1 and X.dtype in (torch.float32, torch.float64):
        # A partial sort finds the same middle values as a full sort, several times faster
        # than sorting a strided dim 0 (a round's centring and spread weights at every cell).
        middle = [k // 2] if k % 2 else [k // 2 - 1, k // 2]
        return _middle(torch.from_numpy(np.partition(X.numpy(), middle, axis=0)))
    # Elsewhere (a GPU) one sort of the whole of X would hold its values and int64 indices at
    # once, 8 GB for a SmolLM2 round read on 128 probes: sort blocks of columns instead.
    flat = X.reshape(k, -1)
    out = torch.empty(flat.shape[1], dtype=X.dtype, device=X.device)
    step = max(1, block // max(1, k))
    for lo in range(0, flat.shape[1], step):
        out[lo : lo + step] = _middle(flat[:, lo : lo + step].sort(dim=0).values)
    return out.reshape(X.shape[1:])


def spread_weights(D: torch.Tensor, cols: int, exponent: float) -> torch.Tensor:
    """Key-free weight per cell of a round's centred changes ``D`` (``[targets, cells]``, rows
    of ``cols`` cells): ``max(S, S_row) ** -exponent``, ``S`` the cell's median over the targets
    of ``|D|`` and ``S_row`` its row's median of ``S``; a cell no target moves (``0``) gets 0.

    Where the clients' changes spread widely (a likely token, a context every client drifts
    on) a cell carries more of their drift than of a key's signal, and a few such cells would
    dominate the sum and thicken its tail. Row by row (the floor is the row's own), so the
    weights of a block of rows do not depend on the other rows."""
    S = _median(D.abs()).reshape(-1, cols)
    floor = _median(S.T).unsqueeze(1)
    m = torch.maximum(S, floor)
    w = torch.where(m > 0, m.clamp_min(torch.finfo(m.dtype).tiny) ** -exponent, 0.0)
    return w.reshape(-1)


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
for ten clients (0.45 GB at 2^20 cells, a SmolLM2 round's peak on the CPU on 2026-11-27)."""


def _over_vocabulary(law: KeyLaw) -> bool:
    """Whether ``law``'s rows each mark several columns (KGW's green lists over a vocabulary):
    only there are per-token drift and the clients' spread over cells things a key can miss."""
    return isinstance(law, RowSubsets) and law.m > 1


def _row_shape(law: KeyLaw, change: Change) -> tuple[int, int]:
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
    participants: Sequence[int],
    targets: Sequence[int],
    designs: Sequence[QueryDesign],
    changes: Sequence[Mapping[str, Change]],
    center: Mapping[str, Change] | None,
    laws: Mapping[str, KeyLaw],
    sink: Callable[[str, int, list[torch.Tensor]], None],
    decorrelate: bool = True,
    token_centring: bool = False,
    weights: Mapping[str, Change] | None = None,
    cells: int | None = STANDARDISE_CELLS,
    spread: float = 0.0,
) -> bool:
    """:func:`standardise_round` a block of rows at a time, each block handed to ``sink(part,
    first row, [each target's standardised rows])`` (float32, ``[rows, cols]``); returns
    whether cross-talk was undone. ``cells``: cells per block (``None``: one block).

    Every step is cell-wise (weights, ``A^{-1}``, the median over clients) or row-wise (the
    centring), except two sums over the whole change: the null variance (a sum of squares) and
    token centring's column means. Where the change is more than one block those are taken in
    a first pass and the blocks are computed again in the second, so at most one block of every
    change is held at once. In one block the result is :func:`standardise_round`'s bit for bit;
    in several the variance and column means are summed block by block in float64 (the same up
    to float rounding). ``spread``: the exponent of :func:`spread_weights`, applied after
    centring, for laws whose rows each mark several columns (KGW); 0 leaves every cell's
    weight as it is."""
    A = cross_talk(participants, targets, designs, decorrelate)
    inv = np.linalg.inv(A) if A is not None else None

    def one_part(part: str, law: KeyLaw) -> None:
        rows, cols = _row_shape(law, changes[0][part])
        step = rows if cells is None else max(1, min(rows, cells // max(1, cols)))
        starts = list(range(0, rows, step))
        tokens = token_centring and _over_vocabulary(law)
        by_spread = spread > 0 and _over_vocabulary(law)

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
            if inv is not None:
                # Row by row in float64 (see _combination): the same bits wherever it runs.
                # At once where a float64 copy of Y is small: the same bits, 3x faster.
                X = _combine(inv, Y, at_once=cells is not None or Y.numel() <= _AT_ONCE_CELLS)
                C = _median(X)
            else:
                X = Y
                C = center_part if center_part is not None else Y.mean(dim=0)
            D = X - C
            if by_spread:
                D = D * spread_weights(D, cols, spread).to(D)
            return [D[i].reshape(hi - lo, cols) for i in range(len(targets))]

        drift: list[torch.Tensor] | None = None
        if tokens and len(starts) > 1:  # pass 0: each target's mean change per token
            sums = torch.zeros(len(targets), cols, dtype=torch.float64)
            for lo in starts:
                for i, d in enumerate(differences(lo)):
                    sums[i] += d.sum(dim=0, dtype=torch.float64)
            drift = [(sums[i] / rows).float() for i in range(len(targets))]

        def centred(lo: int) -> list[torch.Tensor]:
            out = []
            for i, d in enumerate(differences(lo)):
                if tokens:
                    d = d - (d.mean(dim=0) if drift is None else drift[i])
                out.append(law.centre(d))
            return out

        # Pass 1: the null variance of each target's change (a sum over its cells).
        var = [0.0] * len(targets)
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
    return A is not None


def standardise_round(
    participants: Sequence[int],
    targets: Sequence[int],
    designs: Sequence[QueryDesign],
    changes: Sequence[Parts],
    center: Parts | None,
    laws: Mapping[str, KeyLaw],
    decorrelate: bool = True,
    token_centring: bool = False,
    weights: Parts | None = None,
    spread: float = 0.0,
) -> tuple[list[Parts], bool]:
    """Steps 2-4 of the module: each target's own change, centred without a key and divided by
    its null standard deviation; and whether cross-talk was undone. Key-free throughout.

    ``weights``: per part, a key-free weight per cell (:func:`taper_weights`), the same for
    every change of the round, applied before anything else (so undoing cross-talk stays
    exact).

    ``token_centring``: also remove what a change does to a token in every context alike (its
    mean over the rows, per column: a client's drift towards or away from a token, which no
    per-context green list is aligned with), before the rows are centred; only for laws whose
    rows each mark several columns (KGW).

    ``spread``: see :func:`spread_weights` (after centring; key-free like the rest).

    Held whole, in one block; :func:`standardise_blocks` does the same a block of rows at a
    time."""
    out: list[Parts] = [{} for _ in targets]

    def keep(part: str, lo: int, blocks: list[torch.Tensor]) -> None:
        for i, b in enumerate(blocks):
            out[i][part] = b

    undone = standardise_blocks(
        participants,
        targets,
        designs,
        changes,
        center,
        laws,
        keep,
        decorrelate,
        token_centring,
        weights,
        cells=None,
        spread=spread,
    )
    return out, undone


class DeMixer:
    """Rounds whose cross-talk is kept (hardened mode), stacked and de-mixed across rounds.

    Round t's changes are ``Y_t = A_t X^t`` (rows: the round's targets, ``A_t`` their known
    design rows over every client). Under a persistent-mean model ``X_j^t = m_j + e_j^t``, the
    generalised least squares estimate of every client's mean change solves

        F m = sum_t A_t^+ Y_t,    F = sum_t A_t^+ A_t,

    the stack :class:`~fedattr.linalg.StackedGLS` that :mod:`fedattr.attribution.crossround`
    reads for the updates: ``m_j`` is identifiable when
    ``e_j`` is in the range of ``F``. Then ``m_hat = F^+ sum_t P_t X^t = m + sum_t B_t e^t``
    with ``B_t = F^+ P_t`` and ``sum_t B_t = I``: each client's mean change exactly, plus the
    round deviations with known coefficients whose sum over rounds vanishes off the diagonal.
    So a watermarked client's key-aligned change leaks into another client's de-mixed change
    only through its *variation* across rounds; where it is the same every round (the
    synthetic bed) it cancels exactly and a clean client's de-mixed change does not depend on
    the owner's key. The designs are drawn independently of any key, and ``F`` and the sums
    are functions of the released answers only: the de-mixed means are what the cross-round
    audit already shows the answers determine."""

    def __init__(self) -> None:
        self.gls = StackedGLS()
        """``F = sum_t A_t^+ A_t`` over every client in a stacked round's design row."""
        self.b: dict[str, dict[int, torch.Tensor]] = {}
        """Part -> client -> ``[sum_t A_t^+ Y_t]_client`` (flat, float64)."""
        self.shapes: dict[str, tuple[int, ...]] = {}

    @property
    def ids(self) -> list[int]:
        """Every client in a stacked round's design row (the order of ``F``)."""
        return self.gls.ids

    def add(
        self,
        targets: Sequence[int],
        designs: Sequence[QueryDesign],
        changes: Sequence[Parts],
        laws: Mapping[str, KeyLaw],
        weights: Parts | None = None,
        mean: tuple[Sequence[int], Parts] | None = None,
    ) -> None:
        """One round: each target's raw change and design (``weights``: the round's key-free
        cell weights, applied first as :func:`standardise_round` does). ``mean``: the round's
        participants and the change of its SA mean, the equal-weight mean of their (submitted)
        updates: the public row. With it in every round, a term common to all clients passes
        into every de-mixed change alike (the median removes it); without it, it leaks with
        client-specific coefficients and swamps the key's signal."""
        if not targets:
            return
        members = {p for d in designs for p in d.coefficients()} | set(targets)
        if mean is not None:
            members |= set(mean[0])
        self.gls.extend(sorted(members))
        A = _design_matrix(designs, self.ids)
        if mean is not None:
            row = np.zeros((1, len(self.ids)))
            row[0, [self.ids.index(p) for p in mean[0]]] = 1.0 / len(mean[0])
            A = np.vstack([A, row])
            changes = [*changes, mean[1]]
        pinv = self.gls.add(A)
        for part in laws:
            Y = [c[part].reshape(-1).double() for c in changes]
            if weights is not None and part in weights:
                w = weights[part].reshape(-1).double()
                Y = [y * w for y in Y]
            self.shapes[part] = tuple(changes[0][part].shape)
            acc = self.b.setdefault(part, {})
            for k, c in enumerate(self.ids):
                if not np.any(pinv[k]):
                    continue
                term = _combination(pinv[k], Y)
                acc[c] = acc[c] + term if c in acc else term

    def solve(self) -> tuple[dict[str, dict[int, torch.Tensor]], list[int]]:
        """Part -> client -> its de-mixed mean change ``m_hat``, and the identifiable clients
        (``||P e_j||^2 >= 1 - 1e-9``, P the projector onto ``F``'s range)."""
        if not self.ids:
            return {}, []
        fplus = self.gls.inverse()
        identifiable = [c for c, ok in zip(self.ids, self.gls.identifiable(), strict=True) if ok]
        own: dict[str, dict[int, torch.Tensor]] = {}
        for part, acc in self.b.items():
            zero = torch.zeros_like(next(iter(acc.values())))
            terms = [acc.get(c, zero) for c in self.ids]
            own[part] = {c: _combination(fplus[self.ids.index(c)], terms) for c in identifiable}
        return own, identifiable

    def state(self) -> dict:
        """For checkpoints."""
        return {"ids": list(self.ids), "f": self.gls.f, "b": self.b, "shapes": self.shapes}

    @classmethod
    def from_state(cls, state: Mapping | None) -> DeMixer:
        """Restore :meth:`state` (an empty one where the checkpoint has none)."""
        out = cls()
        if state:
            out.gls.ids, out.gls.f = list(state["ids"]), np.array(state["f"], dtype=np.float64)
            out.b, out.shapes = dict(state["b"]), dict(state["shapes"])
        return out


class CalibratedNull:
    """Accumulates each client's standardised changes ``W_i`` (per part) and its owners'
    values ``<W_i, G>``; :meth:`report` turns them into exact p-values and flags."""

    def __init__(
        self,
        alpha: float = 0.01,
        decorrelate: bool = True,
        null_keys: int = 200,
        seed: int = 0,
        name_uncalibrated: bool = False,
        token_centring: bool = False,
        late_rounds: str = "skip",
        few_cells: str = "shifted-keys",
        spill: str | Path | TemporaryFolder | None = None,
        block_cells: int = STANDARDISE_CELLS,
        across_rounds: str = "demix",
        spread: float = 0.0,
    ) -> None:
        """``spill``: a folder where each client's sums ``W_i`` over a row-centred key law
        (KGW's) are kept as float32 files (:class:`~fedattr.rows.DiskRows`) and
        read by row blocks, rounds standardised ``block_cells`` at a time where the detector
        reads its owners' values by rows (:class:`~fedattr.attribution.contract.RowOwnerValues`):
        memory no longer grows with clients x contexts x vocabulary (a
        :class:`~fedattr.rows.TemporaryFolder` is removed after the last of its files).
        ``None``: every sum in memory, in float64."""
        self.alpha, self.decorrelate, self.token_centring = alpha, decorrelate, token_centring
        self.few_cells = few_cells
        self.across_rounds = across_rounds
        self.spread = spread  # spread_weights' exponent (rounds read within the round)
        # Rounds whose cross-talk is kept, stacked for de-mixing across rounds (see DeMixer).
        self.mixed = DeMixer()
        # Each de-mixed client's W and owners' values (recomputed by settle(); not summed).
        self.demixed_W: dict[int, dict[str, torch.Tensor]] = {}
        self.demixed_values: dict[int, dict[str, float]] = {}
        self._reader: LinearKeyScorer | None = None  # reads the de-mixed changes (settle)
        # owner -> its key as a matrix, where the detector lends it (see _shifted)
        self.keys: dict[str, torch.Tensor] = {}
        # A temporary folder is kept alive by the files in it (removed after the last).
        self._folder = spill if isinstance(spill, TemporaryFolder) else None
        where = spill.path if isinstance(spill, TemporaryFolder) else spill
        self.spill: Path | None = None if where is None else Path(where)
        self.block_cells = block_cells
        self.late_rounds = late_rounds
        self.null_keys, self.seed, self.name_uncalibrated = null_keys, seed, name_uncalibrated
        # client -> part -> sum over rounds (in memory, or on disk where spilled)
        self.W: dict[int, dict[str, torch.Tensor | Rows]] = {}
        self.values: dict[int, dict[str, float]] = {}  # client -> owner -> <W, G>
        # client -> owner -> round -> that round's standardised statistic (display)
        self.per_round: dict[int, dict[str, dict[int, float]]] = {}
        self.decorrelated: dict[int, bool] = {}
        self.laws: dict[str, dict] = {}  # part -> KeyLaw.describe()
        self.parts: dict[str, str] = {}  # owner -> part
        self.valid: dict[str, bool] = {}  # owner -> is its key exchangeable with a random one
        self.cross_talk: set[int] = set()  # clients with a round whose cross-talk was kept
        self.rounds_read: dict[str, int] = {}  # owner -> only rounds 1..n read (late skipped)
        # Where the changes were computed (a GPU for an LLM): the rank check's random keys are
        # drawn there. The sums themselves are kept on the CPU (checkpoints load anywhere).
        self.device = torch.device("cpu")

    @classmethod
    def of(cls, config: AttributionConfig) -> CalibratedNull:
        """The sums and verdicts ``config`` (the ``attribution`` section) asks for."""
        c = config
        return cls(
            c.alpha,
            c.decorrelate,
            c.null_keys,
            c.seed,
            c.name_uncalibrated,
            c.token_centring,
            c.late_rounds,
            c.few_cells,
            TemporaryFolder() if c.spill else None,
            across_rounds=c.across_rounds,
            spread=c.spread,
        )

    def decorrelates(
        self, participants: Sequence[int], targets: Sequence[int], designs: Sequence[QueryDesign]
    ) -> bool:
        """Whether this round's cross-talk is undone; only a round that is not needs its SA
        mean's (the center's) change, so the caller can skip reading that model."""
        return cross_talk(participants, targets, designs, self.decorrelate) is not None

    def by_rows(
        self,
        participants: Sequence[int],
        targets: Sequence[int],
        designs: Sequence[QueryDesign],
        scorer: LinearKeyScorer,
    ) -> bool:
        """Whether :meth:`add_round` reads this round a block of rows at a time (spilled sums
        and a detector that reads its owners by rows); a round de-mixed across rounds is kept
        whole (:class:`DeMixer` holds it in memory)."""
        return (
            self.spill is not None
            and isinstance(scorer, RowOwnerValues)
            and (self.across_rounds != "demix" or self.decorrelates(participants, targets, designs))
        )

    def hold(self, round_id: int, name: str, change: Parts, laws: Mapping[str, KeyLaw]) -> dict:
        """``change`` with each part over a row-centred law written to a float32 file in the
        spill folder and read back by row blocks (:class:`ChangeRows`): a round read by rows
        then holds none of its K changes whole (a SmolLM2 round's eleven: 1.4 GB). The values
        read back are the float32 values written, so the round's result is the same bits.
        :meth:`release` removes the round's files."""
        if self.spill is None:
            return dict(change)
        folder = self.spill / f"round-{round_id}"
        folder.mkdir(parents=True, exist_ok=True)
        out: dict[str, Change] = {}
        for part, c in change.items():
            law = laws.get(part)
            if not isinstance(law, RowSubsets) or not isinstance(c, torch.Tensor):
                out[part] = c
                continue
            rows = c.numel() // law.cols
            disk = DiskRows(folder / f"{name}-{part}.f32", rows, law.cols)
            disk.write(c.reshape(rows, law.cols))
            out[part] = ChangeRows(rows, law.cols, disk.rows_as_tensor)
        return out

    def release(self, round_id: int) -> None:
        """Remove the files :meth:`hold` wrote for round ``round_id``."""
        if self.spill is not None:
            shutil.rmtree(self.spill / f"round-{round_id}", ignore_errors=True)

    @staticmethod
    def _exchangeable(round_id: int, scorer: LinearKeyScorer) -> bool:
        """Whether ``scorer``'s key is exchangeable with a random one in round ``round_id``."""
        n = scorer.exchangeable_rounds
        return n is None or round_id <= n

    def reads(self, round_id: int, scorer: LinearKeyScorer) -> bool:
        """Whether round ``round_id`` is read with ``scorer`` at all: not a round past the
        detector's exchangeable ones when ``late_rounds`` skips them (the caller then reads no
        model either)."""
        return self._exchangeable(round_id, scorer) or self.late_rounds != "skip"

    def add_round(
        self,
        round_id: int,
        participants: Sequence[int],
        targets: Sequence[int],
        designs: Sequence[QueryDesign],
        changes: Sequence[Parts],
        center: Parts | None,
        scorer: LinearKeyScorer,
        weights: Parts | None = None,
        mean_row: bool = True,
    ) -> dict[int, dict[str, float]]:
        """One round's raw changes (one per target; ``center``: the SA mean's, needed only
        where cross-talk is not undone; ``weights``: key-free cell weights, see
        :func:`standardise_round`); returns each target's per-round statistic per owner.
        ``mean_row``: whether ``center`` is the equal-weight mean of every participant's
        submitted update (no dropouts), so that de-mixing may stack it as the round's public
        row (:meth:`DeMixer.add`)."""
        if not targets or not self.reads(round_id, scorer):
            return {}
        laws = scorer.key_laws()
        if isinstance(scorer, OwnerKeys) and self.few_cells == "shifted-keys":
            for part in laws:
                self.keys.update({o: G.cpu() for o, G in scorer.owner_keys(part).items()})
        if self.by_rows(participants, targets, designs, scorer):
            return self._add_round_by_rows(
                round_id, participants, targets, designs, changes, center, scorer, weights
            )
        standard, decorrelated = standardise_round(
            participants,
            targets,
            designs,
            changes,
            center,
            laws,
            self.decorrelate,
            self.token_centring,
            weights,
            spread=self.spread,
        )
        self.decorrelated[round_id] = decorrelated
        display: dict[int, dict[str, float]] = {}
        valid = self._exchangeable(round_id, scorer)
        n = scorer.exchangeable_rounds
        demix = not decorrelated and self.across_rounds == "demix"
        if demix:
            # Kept raw (weighted) for de-mixing across rounds; the round's own (mixed) values
            # are for display only.
            self.read_with(scorer)
            mean = (participants, center) if center is not None and mean_row else None
            self.mixed.add(targets, designs, changes, laws, weights, mean)
        for target, parts in zip(targets, standard, strict=True):
            values: dict[str, float] = {}
            owners: dict[str, str] = {}
            for part, c in parts.items():
                for owner, value in scorer.owner_values(part, c).items():
                    values[owner], owners[owner] = value, part
            self.add(
                round_id, target, parts, values, laws, owners, valid, decorrelated, keep=not demix
            )
            display[target] = values
            if n is not None and self.late_rounds == "skip":
                self.rounds_read.update(dict.fromkeys(owners, n))
        return display

    def _add_round_by_rows(
        self,
        round_id: int,
        participants: Sequence[int],
        targets: Sequence[int],
        designs: Sequence[QueryDesign],
        changes: Sequence[Mapping[str, Change]],
        center: Mapping[str, Change] | None,
        scorer: LinearKeyScorer,
        weights: Mapping[str, Change] | None,
    ) -> dict[int, dict[str, float]]:
        """:meth:`add_round` a block of rows at a time (spilled sums): each target's standardised
        rows are added to its file and read by the detector's owners as they come, so no
        change is held whole."""
        assert isinstance(scorer, RowOwnerValues)
        laws = scorer.key_laws()
        self._check_laws(round_id, laws)
        values: list[dict[str, float]] = [{} for _ in targets]  # this round's (display)
        increments: list[dict[str, float]] = [{} for _ in targets]  # what <W, G> moved by
        owners: dict[str, str] = {}

        def sink(part: str, lo: int, blocks: list[torch.Tensor]) -> None:
            total = _row_shape(laws[part], changes[0][part])[0]
            for i, (target, rows) in enumerate(zip(targets, blocks, strict=True)):
                stored = self._accumulate(target, part, lo, rows, laws[part], total)
                for owner, v in scorer.owner_values_rows(part, rows, lo).items():
                    values[i][owner] = values[i].get(owner, 0.0) + v
                    owners[owner] = part
                if stored is not None:
                    # The owners' sums follow the stored (float32) W itself: the value and the
                    # tail then read the same W, whatever its precision.
                    moved = torch.from_numpy(stored).to(rows.device)
                    for owner, v in scorer.owner_values_rows(part, moved, lo).items():
                        increments[i][owner] = increments[i].get(owner, 0.0) + v

        decorrelated = standardise_blocks(
            participants,
            targets,
            designs,
            changes,
            center,
            laws,
            sink,
            self.decorrelate,
            self.token_centring,
            weights,
            self.block_cells,
            spread=self.spread,
        )
        self.decorrelated[round_id] = decorrelated
        valid = self._exchangeable(round_id, scorer)
        n = scorer.exchangeable_rounds
        for target, v, moved in zip(targets, values, increments, strict=True):
            self._add_values(round_id, target, v, owners, valid, decorrelated, moved or None)
            if n is not None and self.late_rounds == "skip":
                self.rounds_read.update(dict.fromkeys(owners, n))
        return dict(zip(targets, values, strict=True))

    def _check_laws(self, round_id: int, laws: Mapping[str, KeyLaw]) -> None:
        for part, law in laws.items():
            desc = law.describe()
            if self.laws.setdefault(part, desc) != desc:
                raise UserError(
                    f"round {round_id}: part {part!r} is read under another key law ({desc}) "
                    f"than the earlier rounds ({self.laws[part]})"
                )

    def _accumulate(
        self, target: int, part: str, lo: int, rows: torch.Tensor, law: KeyLaw, total: int
    ) -> np.ndarray | None:
        """``W[target][part][lo : lo + len(rows)] += rows`` (``total``: the change's rows): on
        disk where spilled (row-centred laws; returns what the stored rows moved by), else in
        memory in float64 (returns ``None``)."""
        acc = self.W.setdefault(target, {})
        self.device = rows.device
        held = acc.get(part)
        if self.spill is not None and isinstance(law, RowSubsets):
            if not isinstance(held, DiskRows):
                self.spill.mkdir(parents=True, exist_ok=True)
                name = f"W-{target}-{part}.f32"
                disk = DiskRows(self.spill / name, total, law.cols, self._folder)
                if held is not None:  # restored from a checkpoint in memory: moved to disk
                    assert isinstance(held, torch.Tensor)
                    disk.add(0, held.reshape(total, law.cols))
                acc[part] = held = disk
            return held.add(lo, rows.reshape(-1, law.cols))
        # On the CPU, in float64: a checkpoint loads on any machine, and the sum over rounds
        # matches the owners' values (summed in float64) to the last digits.
        c = rows.detach().to("cpu", torch.float64)
        assert held is None or isinstance(held, torch.Tensor)
        acc[part] = held + c if held is not None else c.clone()
        return None

    def add(
        self,
        round_id: int,
        target: int,
        parts: Parts,
        values: Mapping[str, float],
        laws: Mapping[str, KeyLaw],
        owner_parts: Mapping[str, str],
        valid: bool = True,
        decorrelated: bool = True,
        keep: bool = True,
    ) -> None:
        """Add one (target, round)'s standardised changes and its owners' values (each owner's
        value has unit null variance: it is also the round's displayed statistic). ``keep =
        False``: display only (a round de-mixed across rounds: its evidence is in
        :attr:`mixed`, read by :meth:`settle`)."""
        self._check_laws(round_id, laws)
        if keep:
            for part, c in parts.items():
                law = laws.get(part)
                total = _row_shape(law, c)[0] if law is not None else 1
                self._accumulate(target, part, 0, c, law, total)  # type: ignore[arg-type]
        self._add_values(round_id, target, values, owner_parts, valid, decorrelated, keep=keep)

    def _add_values(
        self,
        round_id: int,
        target: int,
        values: Mapping[str, float],
        owner_parts: Mapping[str, str],
        valid: bool,
        decorrelated: bool,
        increments: Mapping[str, float] | None = None,
        keep: bool = True,
    ) -> None:
        """Record the round's values (``per_round``) and add them to the owners' sums, or add
        ``increments`` there instead (what ``<W, G>`` of the stored sums moved by); ``keep =
        False`` records the display only."""
        if not decorrelated and keep:
            self.cross_talk.add(target)
        sums = self.values.setdefault(target, {}) if keep else {}
        for owner, value in values.items():
            # An owner of a part held in memory has no increment: its value is the round's.
            step = value if increments is None else increments.get(owner, value)
            sums[owner] = sums.get(owner, 0.0) + float(step)
            self.parts[owner] = owner_parts[owner]
            self.valid[owner] = self.valid.get(owner, True) and valid
            self.per_round.setdefault(target, {}).setdefault(owner, {})[round_id] = float(value)

    def read_with(self, scorer: LinearKeyScorer) -> None:
        """The detector that reads the de-mixed changes with the owners' keys (:meth:`settle`;
        set by :meth:`add_round`, and after a checkpoint is loaded by the caller)."""
        self._reader = scorer

    def settle(self) -> None:
        """Read the rounds kept for de-mixing (:class:`DeMixer`): each identifiable client's
        de-mixed change, centred, standardised and read with its owners' keys, into
        :attr:`demixed_W` and :attr:`demixed_values`; a client whose mean is not identifiable
        from the stacked rounds gets no de-mixed evidence and is marked as cross-talk
        (uncalibrated). Idempotent: recomputed from the stacked sums each time."""
        if self._reader is None or not self.mixed.ids:
            return
        own, identifiable = self.mixed.solve()
        self.demixed_W, self.demixed_values = {}, {}
        laws = {part: law_from_dict(d) for part, d in self.laws.items()}
        for c in self.mixed.ids:
            if c not in identifiable:
                self.cross_talk.add(c)
        if not identifiable:
            return
        for part, law in laws.items():
            if part not in own:
                continue
            X = torch.stack([own[part][c] for c in identifiable])
            # Key-free centre as where cross-talk is undone: a minority of watermarked clients
            # barely moves the cell-wise median.
            C = _median(X) if len(identifiable) > 2 else X.mean(dim=0)
            tokens = self.token_centring and _over_vocabulary(law)
            for k, c in enumerate(identifiable):
                d = (X[k] - C).reshape(self.mixed.shapes[part])
                if tokens:
                    d = d - d.reshape(-1, d.shape[-1]).mean(dim=0)
                centred = law.centre(d)
                var = law.variance(centred)
                W = centred / math.sqrt(var) if var > 0 else torch.zeros_like(centred)
                self.demixed_W.setdefault(c, {})[part] = W.to(torch.float64)
                vals = self._reader.owner_values(part, W.float())
                self.demixed_values.setdefault(c, {}).update({o: float(v) for o, v in vals.items()})

    def merged(
        self,
    ) -> tuple[dict[int, dict[str, torch.Tensor | Rows]], dict[int, dict[str, float]]]:
        """Every client's ``W`` and owners' values: the sums over rounds whose cross-talk was
        undone plus the de-mixed evidence (:meth:`settle`), each term key-free."""
        W = {c: dict(parts) for c, parts in self.W.items()}
        values = {c: dict(v) for c, v in self.values.items()}
        for c, parts in self.demixed_W.items():
            acc = W.setdefault(c, {})
            for part, w in parts.items():
                held = acc.get(part)
                if isinstance(held, Rows):  # spilled: this client's sum is read whole here
                    held = torch.from_numpy(held.block(0, held.rows)).reshape(w.shape)
                acc[part] = w if held is None else held + w
        for c, vals in self.demixed_values.items():
            acc_v = values.setdefault(c, {})
            for o, v in vals.items():
                acc_v[o] = acc_v.get(o, 0.0) + v
        return W, values

    def report(self, truth: Mapping[int, bool] | None = None) -> AttributionReport:
        """Per client: Z, exact p and tail method of its strongest owner, Bonferroni over
        owners, named at family-wise ``alpha`` over clients x owners (rounds kept for
        de-mixing are read first, :meth:`settle`)."""
        self.settle()
        if not self.demixed_W:
            return self._report(truth)
        kept = self.W, self.values
        self.W, self.values = self.merged()
        try:
            return self._report(truth)
        finally:
            self.W, self.values = kept

    def _report(self, truth: Mapping[int, bool] | None = None) -> AttributionReport:
        clients = sorted(set(self.W) | set(truth or {}))
        owners = sorted(self.parts)
        S, K = max(1, len(owners)), max(1, len(clients))
        level = self.alpha / (K * S)
        threshold = float(norm.isf(level))
        components = {o: AttributionReport(gamma=threshold) for o in owners}
        combined = AttributionReport(gamma=threshold, components=components)
        ranks = self._rank_values(clients)
        tails = self._shifted(self._tails(clients, owners), level)
        for c in clients:
            watermarked = None if truth is None else bool(truth.get(c, False))
            rows = []
            for o in owners:
                row = self._client_owner(c, o, watermarked, level, ranks, tails.get((c, o)))
                components[o].clients.append(row)
                rows.append(row)
            if not rows:
                continue
            best = min(rows, key=lambda r: (r.log10_p, -r.Z))
            log10_p = min(0.0, math.log10(S) + best.log10_p)
            p_rank = None if best.p_rank is None else min(1.0, S * best.p_rank)
            row = ClientAttribution(
                id=c,
                z=dict(best.z),
                Z=best.Z,
                p=min(1.0, S * best.p),
                log10_p=log10_p,
                flagged=any(r.flagged for r in rows),
                watermarked=watermarked,
                statistic=best.statistic,
                p_rank=p_rank,
                tail=best.tail,
                calibrated=best.calibrated,
            )
            combined.clients.append(row)
        for rep in [combined, *components.values()]:
            rep.statistic, rep.alpha, rep.null_keys = "calibrated", self.alpha, self.null_keys
            rep.level = level
            rep.uncalibrated = sorted(o for o in owners if not self.valid.get(o, True))
            rep.cross_talk = sorted(self.cross_talk)
            rep.rounds_read = dict(sorted(self.rounds_read.items()))
        return combined

    def _rank_values(self, clients: Sequence[int]) -> dict[str, dict[int, np.ndarray]]:
        """Part -> client -> ``<W_i, key_k>`` for ``null_keys`` random keys (one draw for all
        clients, at the end)."""
        out: dict[str, dict[int, np.ndarray]] = {}
        if self.null_keys < 1:
            return out
        for part, desc in self.laws.items():
            have = [c for c in clients if part in self.W.get(c, {})]
            if not have:
                continue

            # On a GPU: 200 keys over ten vocabulary-sized changes are ~1e11 cells, minutes
            # on a CPU (it reads every change once per key), a second there.
            def where(W: torch.Tensor | Rows) -> torch.Tensor | Rows:
                if self.device.type == "cpu" or isinstance(W, Rows):
                    return W
                return W.to(self.device, torch.float32)

            Ws = [where(self.W[c][part]) for c in have]
            values = law_from_dict(desc).random_values(Ws, self.null_keys, self.seed)
            out[part] = {c: values[i] for i, c in enumerate(have)}
        return out

    def _tails(self, clients: Sequence[int], owners: Sequence[str]) -> dict[tuple[int, str], Tail]:
        """The exact tail of every (client, owner) statistic. Owners reading the same part
        share its CGF (built once per client); clients run in threads (the work is numpy
        over ``W``, which releases the GIL): a vocabulary-sized ``W`` takes seconds."""
        jobs: dict[tuple[int, str], list[str]] = {}
        for c in clients:
            for o in owners:
                if self.parts[o] in self.W.get(c, {}) and o in self.values.get(c, {}):
                    jobs.setdefault((c, self.parts[o]), []).append(o)

        def one(job: tuple[int, str]) -> list[tuple[tuple[int, str], Tail]]:
            c, part = job
            law, names = law_from_dict(self.laws[part]), jobs[job]
            found = law.tails(self.W[c][part], [self.values[c][o] for o in names])
            return [((c, o), t) for o, t in zip(names, found, strict=True)]

        workers = min(len(jobs), max(1, torch.get_num_threads()))
        if workers <= 1:
            return dict(pair for job in jobs for pair in one(job))
        with ThreadPoolExecutor(workers) as pool:
            return dict(pair for pairs in pool.map(one, jobs) for pair in pairs)

    def _shifted(
        self, tails: dict[tuple[int, str], Tail], level: float
    ) -> dict[tuple[int, str], Tail]:
        """Where a tail is only a bound (a change on few cells) and the owner's key is at hand,
        p by the randomization test over shifted keys, exact at any number of keys.

        The bound is kept where it is already below ``floor = level / 100`` (a client the
        bound names with room to spare keeps its small p); elsewhere p is the test's p plus
        ``floor``. That sum is a valid p-value whatever the bound and the test's correlation:
        ``P(p <= u) <= P(bound <= floor) + P(test <= u - floor) <= u``. Keys are drawn up to
        ``1 / floor``, so the test alone resolves p down to the floor."""
        floor = level * SHIFTED_FLOOR
        owners = sorted(self.parts)
        out = dict(tails)
        for (client, owner), tail in tails.items():
            G = self.keys.get(owner)
            W = self.W[client][self.parts[owner]]
            cells = W.rows * W.cols if isinstance(W, Rows) else W.numel()
            if (
                G is None
                or tail.method not in BOUNDS
                or tail.log10_p <= math.log10(floor)
                or cells > SHIFT_MAX_CELLS
            ):
                continue
            p, _ = shifted_keys_p(
                W.block(0, W.rows) if isinstance(W, Rows) else W.cpu().numpy(),
                G.numpy(),
                [self.seed, client, owners.index(owner), 0x5E1F],
                max_keys=math.ceil(1.0 / floor),
            )
            out[(client, owner)] = Tail(math.log10(min(1.0, p + floor)), "shifted-keys")
        return out

    def _client_owner(
        self,
        client: int,
        owner: str,
        watermarked: bool | None,
        level: float,
        ranks: Mapping[str, Mapping[int, np.ndarray]],
        tail: Tail | None,
    ) -> ClientAttribution:
        z = dict(self.per_round.get(client, {}).get(owner, {}))
        part = self.parts[owner]
        W = self.W.get(client, {}).get(part)
        valid = self.valid.get(owner, True) and client not in self.cross_talk
        if W is None or tail is None:
            return ClientAttribution(
                client,
                z,
                0.0,
                1.0,
                0.0,
                False,
                watermarked,
                owner,
                None,
                tail=None,
                calibrated=valid,
            )
        law = law_from_dict(self.laws[part])
        value = self.values[client][owner]
        sd = math.sqrt(law.variance(W))
        score = value / sd if sd > 0 else 0.0
        p_rank = None
        null = ranks.get(part, {}).get(client)
        if null is not None:
            p_rank = (1 + int(np.sum(null >= value))) / (len(null) + 1)
        named = tail.log10_p < math.log10(level) and (valid or self.name_uncalibrated)
        return ClientAttribution(
            client,
            z,
            score,
            tail.p,
            tail.log10_p,
            named,
            watermarked,
            owner,
            p_rank,
            tail=tail.method,
            calibrated=valid,
        )

    @classmethod
    def from_results(
        cls,
        results: Mapping[str, Any],
        changes: Mapping[str, torch.Tensor | Rows],
        seed: int = 0,
        name_uncalibrated: bool = False,
    ) -> CalibratedNull:
        """The sums of a finished run, from its ``results.json`` and ``changes.safetensors``:
        :meth:`report` then reads its verdicts again with this fedattr's tails (no training,
        no model). Each owner's value is its ``Z`` times the change's null standard deviation;
        the saved changes are float32, so p agrees with the run's own to about six digits where
        the tail method is the same. They are kept in float32 (read as float64 a block at a
        time: the same values as converting them whole, in half the memory), or read from the
        file by row blocks (:class:`~fedattr.rows.Rows`, e.g.
        :func:`~fedattr.rows.open_changes` of a large file: the rank check then
        draws its keys by rows, other keys than the run's). ``seed``: the rank check's
        (``attribution.seed``)."""
        laws = results.get("key_laws") or {}
        if results.get("statistic") != "calibrated" or not laws:
            raise UserError(
                "RUN_DIR: the run was not read with the calibrated statistic (no key laws in "
                "its results.json); there is nothing to read again"
            )
        # One law: every owner reads the same part. Several: each owner reads its own part,
        # named as the owner (FK's entities, KGW read on each owner's documents).
        unread = [o for o in results["by_statistic"] if len(laws) > 1 and o not in laws]
        if unread:
            raise UserError(
                f"RUN_DIR: the run's owners read {len(laws)} key laws ({', '.join(laws)}), none "
                f"named as owner {unread[0]}; results.json does not say which it read"
            )
        null = cls(
            float(results["alpha"]),
            null_keys=int(results.get("null_keys") or 0),
            seed=seed,
            name_uncalibrated=name_uncalibrated,
        )
        null.laws = {part: dict(desc) for part, desc in laws.items()}
        uncalibrated = set(results.get("uncalibrated", []))
        for owner, rows in results["by_statistic"].items():
            part = next(iter(laws)) if len(laws) == 1 else owner
            law = law_from_dict(laws[part])
            null.parts[owner], null.valid[owner] = part, owner not in uncalibrated
            for cid, row in rows.items():
                W = changes.get(f"{cid}/{part}")
                if W is None:
                    continue
                if isinstance(W, Rows) and not isinstance(law, RowSubsets):
                    W = torch.from_numpy(W.block(0, W.rows))  # only row-centred laws by rows
                null.W.setdefault(int(cid), {})[part] = W
                sd = math.sqrt(law.variance(W))
                null.values.setdefault(int(cid), {})[owner] = float(row["Z"]) * sd
        for row in results["clients"]:  # the per-round display of each client's best owner
            null.per_round.setdefault(row["id"], {})[row["statistic"]] = {
                int(t): v for t, v in row.get("z", {}).items()
            }
        null.cross_talk = set(results.get("cross_talk", []))
        null.rounds_read = dict(results.get("rounds_read", {}))
        return null

    def state(self) -> dict:
        """For checkpoints."""
        return {
            "format": 2,
            # Spilled sums are read back whole (a checkpoint holds them in memory).
            "W": {
                c: {p: W.tensor() if isinstance(W, DiskRows) else W for p, W in parts.items()}
                for c, parts in self.W.items()
            },
            "values": self.values,
            "per_round": self.per_round,
            "decorrelated": self.decorrelated,
            "laws": self.laws,
            "parts": self.parts,
            "valid": self.valid,
            "cross_talk": sorted(self.cross_talk),
            "rounds_read": self.rounds_read,
            "keys": self.keys,
            "mixed": self.mixed.state(),
        }

    def load(self, state: Mapping) -> None:
        """Restore :meth:`state`."""
        if state.get("format") != 2:
            raise UserError(
                "the checkpoint holds the calibrated statistic of an earlier fedattr (sums over "
                "random keys, not change matrices); start the run over"
            )
        self.W, self.values = state["W"], state["values"]
        self.per_round, self.decorrelated = state["per_round"], state["decorrelated"]
        self.laws, self.parts, self.valid = state["laws"], state["parts"], state["valid"]
        self.cross_talk = set(state.get("cross_talk", []))
        self.rounds_read = dict(state.get("rounds_read", {}))
        self.keys = dict(state.get("keys", {}))
        self.mixed = DeMixer.from_state(state.get("mixed"))
