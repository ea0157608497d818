"""Stouffer combination of per-round differential scores, and the attribution report."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.stats import norm

_LN10 = math.log(10.0)


def stouffer(scores: Iterable[float]) -> float:
    """``Z = sum_t z_t / sqrt(T)`` over the given scores (0.0 for none)."""
    values = list(scores)
    return sum(values) / math.sqrt(len(values)) if values else 0.0


def upper_tail(z: float) -> tuple[float, float]:
    """``(p, log10 p)`` with ``p = 1 - Phi(z)``, accurate far into the tail.

    ``norm.sf`` is exact down to about 1e-300; ``log10 p`` (from ``norm.logsf``) stays finite
    beyond that, where ``p`` itself underflows to 0.
    """
    return float(norm.sf(z)), float(norm.logsf(z) / _LN10)


@dataclass(kw_only=True)
class ClientAttribution:
    """One client's attribution result (built by keyword: nine of its fields are numbers or
    flags that a positional call would let slip into each other's place)."""

    id: int
    z: dict[int, float]
    Z: float
    p: float
    log10_p: float
    flagged: bool
    watermarked: bool | None = None
    statistic: str = "score"
    """Which statistic these numbers belong to (in a combined report: the client's strongest)."""
    p_rank: float | None = None
    """Calibrated statistic only: the rank p-value among the null keys (resolution
    ``1 / (null_keys + 1)``; Bonferroni-adjusted over owners in a combined report)."""
    tail: str | None = None
    """Calibrated statistic only: how ``p`` was obtained (``exact``, ``saddlepoint``, or
    an upper bound: ``patterns`` or ``chernoff``; see :mod:`fedattr.watermarks.tail`)."""
    calibrated: bool = True
    """Whether ``p`` is calibrated: ``False`` for a detector whose key is not exchangeable with
    a random one after the first round (FK); such a client is not named by default."""

    def to_dict(self) -> dict:
        """JSON-ready form (round keys become strings, as JSON requires)."""
        extra: dict[str, object] = {} if self.p_rank is None else {"p_rank": self.p_rank}
        if self.tail is not None:
            extra.update(tail=self.tail, calibrated=self.calibrated)
        return {
            **extra,
            "id": self.id,
            "statistic": self.statistic,
            "watermarked": self.watermarked,
            "Z": self.Z,
            "p": self.p,
            "log10_p": self.log10_p,
            "flagged": self.flagged,
            "z": {str(t): v for t, v in sorted(self.z.items())},
        }


@dataclass
class AttributionReport:
    """Per-client per-round scores, Stouffer Z, p-values, flags and (with ground truth) TPR/FPR."""

    gamma: float
    clients: list[ClientAttribution] = field(default_factory=list)
    components: dict[str, AttributionReport] = field(default_factory=dict)
    """For a combined report: the report of each statistic (e.g. each owner's key)."""
    statistic: str = "paper"
    """``paper`` (Stouffer, flag ``Z > gamma``) or ``calibrated`` (key randomisation; ``gamma``
    is then the t threshold that family-wise level ``alpha`` implies)."""
    alpha: float | None = None
    null_keys: int | None = None
    level: float | None = None
    """Calibrated statistic: the per-(client, owner) cut ``alpha / (K x owners)`` that a p-value
    must fall below for the client to be named."""
    uncalibrated: list[str] = field(default_factory=list)
    """Calibrated statistic: owners whose p-values are not calibrated (FK)."""
    cross_talk: list[int] = field(default_factory=list)
    """Calibrated statistic: clients with a round whose cross-talk was kept (hardened mode) and
    not de-mixed across rounds (``attribution.calibrated.across_rounds = "keep"``, or a client the
    stacked rounds do not identify): their p-values are not calibrated either."""
    rounds_read: dict[str, int] = field(default_factory=dict)
    """Calibrated statistic: owners whose evidence is read from rounds 1..n only (a key that
    stays exchangeable with a random one only until the reference model learns the owner's
    secret: FK, ``attribution.calibrated.late_rounds = "skip"``)."""

    @property
    def flagged(self) -> list[int]:
        """Ids of flagged clients."""
        return [c.id for c in self.clients if c.flagged]

    def _rate(self, truth: bool) -> float | None:
        group = [c for c in self.clients if c.watermarked is truth]
        return sum(c.flagged for c in group) / len(group) if group else None

    @property
    def tpr(self) -> float | None:
        """Share of watermarked clients flagged (``None`` without watermarked clients)."""
        return self._rate(True)

    @property
    def fpr(self) -> float | None:
        """Share of clean clients flagged (``None`` without clean clients)."""
        return self._rate(False)

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {
            "statistic": self.statistic,
            "alpha": self.alpha,
            "null_keys": self.null_keys,
            "gamma": self.gamma,
            "level": self.level,
            "uncalibrated": self.uncalibrated,
            "cross_talk": self.cross_talk,
            "rounds_read": self.rounds_read,
            "tpr": self.tpr,
            "fpr": self.fpr,
            "flagged": self.flagged,
            "clients": [c.to_dict() for c in self.clients],
            "by_statistic": {
                name: {
                    str(c.id): {
                        "Z": c.Z,
                        "p": c.p,
                        "log10_p": c.log10_p,
                        "tail": c.tail,
                        "flagged": c.flagged,
                    }
                    for c in r.clients
                }
                for name, r in self.components.items()
            },
        }


def empirical_null(
    scores: Mapping[int, Mapping[int, float]], min_clients: int = 4
) -> dict[int, dict[int, float]]:
    """Standardise each round's scores by that round's robust centre and spread over clients.

    ``z' = (z - median_j z_j) / (1.4826 MAD_j z_j)`` per round (Efron's empirical null): when
    most targets are benign, the bulk of a round's scores *is* the null, whatever cross-talk
    did to its location and scale (*Finding 3*: under FedAttr's estimator a benign client's
    score is not N(0, 1)). Rounds with fewer than ``min_clients`` scores, or no spread, are
    left as they are.
    """
    rounds: dict[int, dict[int, float]] = {}
    for cid, per in scores.items():
        for t, z in per.items():
            rounds.setdefault(t, {})[cid] = z
    out: dict[int, dict[int, float]] = {cid: {} for cid in scores}
    for t, per in rounds.items():
        vals = np.array(list(per.values()), dtype=float)
        centre = float(np.median(vals))
        spread = 1.4826 * float(np.median(np.abs(vals - centre)))
        ok = len(vals) >= min_clients and spread > 0
        for cid, z in per.items():
            out[cid][t] = (z - centre) / spread if ok else z
    return out


def build_report(
    scores: Mapping[int, Mapping[int, float]],
    gamma: float,
    truth: Mapping[int, bool] | None = None,
    statistic: str = "score",
) -> AttributionReport:
    """Combine ``scores[client][round]`` per client with Stouffer and flag ``Z > gamma``.

    Clients appear in id order; a client with no scored round gets ``Z = 0``.
    """
    report = AttributionReport(gamma=gamma)
    for cid in sorted(scores):
        z = dict(scores[cid])
        Z = stouffer(z.values())
        p, log10_p = upper_tail(Z)
        report.clients.append(
            ClientAttribution(
                id=cid,
                z=z,
                Z=Z,
                p=p,
                log10_p=log10_p,
                flagged=gamma < Z,
                watermarked=None if truth is None else bool(truth.get(cid, False)),
                statistic=statistic,
            )
        )
    return report


def over_statistics(
    best: ClientAttribution, rows: Sequence[ClientAttribution], S: int
) -> ClientAttribution:
    """One client's row over ``S`` statistics (owners): the numbers of ``best``, its strongest
    row, with ``p`` (and the rank p) Bonferroni-adjusted over the ``S``; flagged when any row
    is."""
    return ClientAttribution(
        id=best.id,
        z=dict(best.z),
        Z=best.Z,
        p=min(1.0, S * best.p),
        log10_p=min(0.0, math.log10(S) + best.log10_p),
        flagged=any(r.flagged for r in rows),
        watermarked=best.watermarked,
        statistic=best.statistic,
        p_rank=None if best.p_rank is None else min(1.0, S * best.p_rank),
        tail=best.tail,
        calibrated=best.calibrated,
    )


def combine_reports(reports: Sequence[AttributionReport]) -> AttributionReport:
    """One report over several statistics (e.g. several corpus owners' KGW keys).

    A client is flagged when any statistic flags it (each owner tests for their own data);
    its row shows its strongest statistic, and ``p`` is Bonferroni-adjusted over the ``S``
    statistics (``min(1, S * min_s p_s)``), since taking the best of S tests multiplies the
    chance of a false flag by up to S at the nominal level.
    """
    if not reports:
        raise ValueError("combine_reports: no reports")
    S = len(reports)
    out = AttributionReport(
        gamma=reports[0].gamma,
        components={
            r.clients[0].statistic if r.clients else str(i): r for i, r in enumerate(reports)
        },
    )
    by_id = [{c.id: c for c in r.clients} for r in reports]
    for cid in sorted(by_id[0]):
        rows = [b[cid] for b in by_id]
        out.clients.append(over_statistics(max(rows, key=lambda c: c.Z), rows, S))
    return out
