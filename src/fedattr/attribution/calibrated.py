"""Calibrated verdicts: p-values by key randomisation, cross-talk undone, family-wise flags.

The paper reads each round's differential score as N(0, 1) and adds rounds with Stouffer. On a
real model neither holds (README, *Findings 3-6*): the round's common learning direction
projects on a fixed key as one draw shared by every client and every round, a client's own
data drift does the same round after round, and each estimate carries alpha-weighted copies of
the watermarked clients' updates (cross-talk). So here:

1. **Key randomisation.** The detector's raw statistic (linear in small changes: the green mass
   a change moves, a margin in nats, a projection) is computed for every estimate under the
   owner's key and under ``n`` fresh random keys that never watermarked anything. Whatever in
   the estimate does not depend on the owner's key (common direction, data drift, noise)
   projects on the owner's key exactly as on a random one.
2. **Cross-talk undone.** When every participant of a round is a target, the round's estimates
   are ``Y = A X`` with ``A`` the known design matrix (row i: 1 for the target, alpha for the
   others), so ``X = A^{-1} Y`` is each client's own statistic, per key. This reveals, per key
   and round, one number per client (the projection of its update on that key's statistic):
   more than the paper's released estimates say individually, nothing they do not determine
   jointly. Hardened mode targets few clients per round, so there it is skipped.
3. **Common part removed.** With cross-talk undone, each key's median over the clients is
   subtracted (a minority of watermarked clients barely moves it); otherwise the statistic of
   the round's SA mean (which training aggregates anyway): ``x_i - x(mean)``.
4. **Rounds summed per key**, each round's row first divided by its spread over all keys (so
   every round weighs the same, as in Stouffer, and the owner's key stays exchangeable with the
   random ones): each random key is a full-run replicate of the null, with the cross-round
   correlation of a fixed key built in.
5. **p-value.** With ``T_0`` the owner's sum and ``T_1..T_n`` the random keys', the t prediction
   statistic ``(T_0 - mean) / (sd * sqrt(1 + 1/n))`` is Student-t with ``n - 1`` degrees of
   freedom when the null sums are normal: its tail gives ``p`` beyond the rank test's
   resolution ``1/(n+1)`` (``p_rank``, exact under exchangeability, is reported beside it).
   Over several owners ``p`` is Bonferroni-adjusted, and a client is named when it is below
   ``alpha / K``: family-wise level ``alpha`` over clients x owners.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from scipy.stats import t as student_t

from ..errors import UserError
from .design import QueryDesign
from .stouffer import AttributionReport, ClientAttribution

KeyStatistics = dict[str, tuple[float, np.ndarray]]
"""Owner -> (raw statistic under the owner's key, the same under each null key)."""

_LN10 = math.log(10.0)


def has_key_statistics(scorer: Any) -> bool:
    """Whether ``scorer`` can run under random keys (``observe`` and ``key_statistics``)."""
    return callable(getattr(scorer, "key_statistics", None)) and callable(
        getattr(scorer, "observe", None)
    )


def all_key_statistics(
    scorer: Any, reference: Any, observations: Sequence[Any], n: int, seed: int
) -> list[KeyStatistics]:
    """:meth:`key_statistics` of every observation against ``reference``, in one batched pass
    where the scorer offers ``key_statistics_many``."""
    many = getattr(scorer, "key_statistics_many", None)
    if callable(many):
        return many(reference, list(observations), n, seed)
    return [scorer.key_statistics(reference, obs, n, seed) for obs in observations]


def null_identity(scorer: Any) -> str | None:
    """The name of the random keys ``scorer`` last drew (its ``null_identity()``): where they
    depend on the machine that draws them (a device's generator), a run's rounds must all be
    summed over the same ones. ``None`` for a scorer whose null does not (decoy values,
    directions from a seeded CPU generator) or has drawn none yet."""
    get = getattr(scorer, "null_identity", None)
    return get() if callable(get) else None


def _design_matrix(designs: Sequence[QueryDesign], order: Sequence[int]) -> np.ndarray:
    """Row i: the weight of every participant (in ``order``) in target i's estimate."""
    rows = []
    for d in designs:
        coef = d.coefficients()
        rows.append([coef.get(p, 0.0) for p in order])
    return np.array(rows, dtype=np.float64)


RESUME_WHERE_STARTED = "resume a run on the kind of machine that started it, or start it over"
"""The remedy for a run scored in process (:class:`CalibratedNull`)."""


class CalibratedNull:
    """Accumulates, per client and owner, the summed statistic under the owner's key and under
    every null key; :meth:`report` turns them into calibrated p-values and flags."""

    def __init__(
        self, alpha: float = 0.01, decorrelate: bool = True, remedy: str = RESUME_WHERE_STARTED
    ) -> None:
        """``remedy``: what to tell the user when a round comes under other random keys than
        the earlier ones (:meth:`add_round`): it depends on who scored the rounds."""
        self.alpha, self.decorrelate, self.remedy = alpha, decorrelate, remedy
        # client -> owner -> [1 + n] sums over rounds (column 0: the owner's key)
        self.sums: dict[int, dict[str, np.ndarray]] = {}
        # client -> owner -> round -> that round's standardised statistic (for display)
        self.per_round: dict[int, dict[str, dict[int, float]]] = {}
        self.decorrelated: dict[int, bool] = {}
        self.keys: dict[str, str] = {}  # owner -> name of the random keys its sums are over

    def add_round(
        self,
        round_id: int,
        participants: Sequence[int],
        targets: Sequence[int],
        designs: Sequence[QueryDesign],
        stats: Sequence[KeyStatistics],
        center: KeyStatistics | None = None,
        keys: Mapping[str, str | None] | None = None,
    ) -> dict[int, dict[str, float]]:
        """One round's key statistics (one per target); returns each target's standardised
        per-round value per owner (``(x_0 - mean_null) / sd_null``, for display).

        ``keys``: per owner, the name of the random keys the statistics are under
        (:func:`null_identity`). A round under other keys than the owner's earlier rounds is
        refused before anything is added: each random key's sum over rounds is one replicate
        of the null only if it is the same key in every round."""
        self._same_keys(round_id, keys or {})
        if not targets:
            return {}
        owners = sorted(stats[0])
        Y = {o: np.array([[s[o][0], *s[o][1]] for s in stats]) for o in owners}
        A = self._cross_talk(participants, targets, designs)
        full = A is not None
        self.decorrelated[round_id] = full
        display: dict[int, dict[str, float]] = {t: {} for t in targets}
        for o in owners:
            if full:
                # Each client's own statistic: the common part is the clients' median, which a
                # minority of watermarked clients barely moves (the SA mean would carry r/K of
                # their watermark into every clean client's score and out of theirs).
                X = np.linalg.solve(A, Y[o])
                X = X - np.median(X, axis=0)
            elif center is not None:
                X = Y[o] - np.array([center[o][0], *center[o][1]])
            else:
                X = Y[o] - Y[o].mean(axis=0)
            for i, target in enumerate(targets):
                row = X[i]
                # Each round weighs the same (as in Stouffer): the row is divided by its spread
                # over ALL keys, a symmetric function of them, so the owner's key stays
                # exchangeable with the random ones. Raw sums would let the largest change (round
                # 1, the least watermarked) drown the later rounds.
                spread = float(row.std(ddof=1))
                acc = self.sums.setdefault(target, {})
                acc[o] = acc.get(o, 0.0) + (row / spread if spread > 0 else 0.0 * row)
                null = row[1:]
                sd = float(null.std(ddof=1))
                z = (row[0] - float(null.mean())) / sd if sd > 0 else 0.0
                display[target][o] = z
                self.per_round.setdefault(target, {}).setdefault(o, {})[round_id] = z
        return display

    def _same_keys(self, round_id: int, keys: Mapping[str, str | None]) -> None:
        for owner, name in keys.items():
            known = self.keys.get(owner)
            if name is not None and known is not None and name != known:
                raise UserError(
                    f"round {round_id} of owner {owner!r} was scored under other random keys "
                    f"({name}) than its earlier rounds ({known}): the keys depend on the device "
                    f"that draws them (CPU or CUDA, the GPU model) and the torch version; "
                    f"{self.remedy}"
                )
        for owner, name in keys.items():
            if name is not None:
                self.keys.setdefault(owner, name)

    def decorrelates(
        self, participants: Sequence[int], targets: Sequence[int], designs: Sequence[QueryDesign]
    ) -> bool:
        """Whether :meth:`add_round` undoes this round's cross-talk (every participant a target
        and a well-conditioned design); only a round that is not needs its SA mean's (the
        center's) statistics, so the caller can skip reading that model."""
        return self._cross_talk(participants, targets, designs) is not None

    def _cross_talk(
        self, participants: Sequence[int], targets: Sequence[int], designs: Sequence[QueryDesign]
    ) -> np.ndarray | None:
        """The round's design matrix where its cross-talk is undone, else ``None``."""
        if not (self.decorrelate and targets and sorted(targets) == sorted(participants)):
            return None
        A = _design_matrix(designs, targets)
        return A if np.linalg.cond(A) < 1e8 else None

    def report(self, truth: Mapping[int, bool] | None = None) -> AttributionReport:
        """Per client: the t statistic and p of its strongest owner, Bonferroni over owners,
        flagged at family-wise ``alpha`` over clients x owners."""
        clients = sorted(set(self.sums) | set(truth or {}))
        owners = sorted({o for per in self.sums.values() for o in per})
        n = min((len(v) - 1 for per in self.sums.values() for v in per.values()), default=0)
        S, K = max(1, len(owners)), max(1, len(clients))
        level = self.alpha / (K * S)
        threshold = float(student_t.isf(level, n - 1)) if n >= 2 else math.inf
        components = {o: AttributionReport(gamma=threshold) for o in owners}
        combined = AttributionReport(gamma=threshold, components=components)
        combined.statistic, combined.alpha, combined.null_keys = "calibrated", self.alpha, n
        for c in clients:
            watermarked = None if truth is None else bool(truth.get(c, False))
            rows = []
            for o in owners:
                row = self._client_owner(c, o, watermarked, level)
                components[o].clients.append(row)
                rows.append(row)
            if not rows:
                continue
            best = min(rows, key=lambda r: (r.log10_p, -r.Z))
            log10_p = min(0.0, math.log10(S) + best.log10_p)
            row = ClientAttribution(
                id=c, z=dict(best.z), Z=best.Z, p=min(1.0, S * best.p), log10_p=log10_p,
                flagged=any(r.flagged for r in rows), watermarked=watermarked,
                statistic=best.statistic, p_rank=min(1.0, S * (best.p_rank or 1.0)),
            )  # fmt: skip
            combined.clients.append(row)
        for rep in components.values():
            rep.statistic, rep.alpha, rep.null_keys = "calibrated", self.alpha, n
        return combined

    def _client_owner(
        self, client: int, owner: str, watermarked: bool | None, level: float
    ) -> ClientAttribution:
        sums = self.sums.get(client, {}).get(owner)
        z = dict(self.per_round.get(client, {}).get(owner, {}))
        if sums is None or len(sums) < 3:
            return ClientAttribution(client, z, 0.0, 1.0, 0.0, False, watermarked, owner, 1.0)
        t0, null = float(sums[0]), sums[1:]
        n = len(null)
        sd = float(null.std(ddof=1))
        score = (t0 - float(null.mean())) / (sd * math.sqrt(1 + 1 / n)) if sd > 0 else 0.0
        p = float(student_t.sf(score, n - 1))
        log10_p = float(student_t.logsf(score, n - 1)) / _LN10
        p_rank = (1 + int(np.sum(null >= t0))) / (n + 1)
        return ClientAttribution(
            client, z, score, p, log10_p, p < level, watermarked, owner, p_rank
        )

    def state(self) -> dict:
        """For checkpoints."""
        return {"sums": self.sums, "per_round": self.per_round, "decorrelated": self.decorrelated,
                "keys": self.keys}  # fmt: skip

    def load(self, state: Mapping) -> None:
        """Restore :meth:`state` (one saved before keys were named accepts any)."""
        self.sums = state["sums"]
        self.per_round = state["per_round"]
        self.decorrelated = state["decorrelated"]
        self.keys = dict(state.get("keys", {}))
