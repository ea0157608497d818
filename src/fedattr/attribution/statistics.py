"""The statistics a round's estimates are read with, one class each behind one interface
(``attribution.statistic``):

- :class:`PaperStatistic` (``paper``): the published differential score per round and target,
  ``z_i^t = Score(w^{t-1} + Δ̂_i) − Score(w^{t-1})``, combined by Stouffer and flagged above γ;
- :class:`CalibratedStatistic` (``calibrated``): each target's key-linear change, summed over
  rounds and read with the owner's key against its exact tail under a random key
  (:mod:`fedattr.attribution.calibrated`).

Both keep each round's per-target value for display (``scores``) and build the round's
:class:`~fedattr.attribution.records.RoundRecord`; :class:`~fedattr.attribution.protocol.FedAttr`
draws the designs and asks SA, and hands each round's estimates to its statistic.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from ..errors import UserError
from ..updates import add_update, scale_update
from .calibrated.reading import read_round
from .calibrated.sums import CalibratedNull
from .config import AttributionConfig
from .contract import LinearKeyScorer
from .records import Estimate, RoundEstimates, RoundRecord, TargetRecord
from .scoring import (
    DEFAULT_STATISTIC,
    ApplyUpdate,
    DifferentialScorer,
    observes_in_batches,
    scorer_null,
)
from .stouffer import AttributionReport, build_report, combine_reports, empirical_null

OnTarget = Callable[[TargetRecord], Any]


class Statistic(ABC):
    """How one FedAttr configuration turns each round's estimates into evidence, and the
    rounds into a report."""

    name: ClassVar[str]

    def __init__(self, config: AttributionConfig) -> None:
        self.config = config
        self.scores: dict[str, dict[int, dict[int, float]]] = {}
        """Statistic name -> client -> round -> the round's value (Stouffer's input for the
        paper statistic; for display under the calibrated one)."""
        self.scorer_null = "theoretical"
        """What the scorer says of its null (``null`` attribute; :func:`scorer_null`)."""

    @property
    @abstractmethod
    def null(self) -> str:
        """The null the verdicts are read under (``results.json`` ``null``)."""

    def use_scorer(self, scorer: Any) -> None:
        """Note what the scorer says of its null (before scoring, and for a finished run)."""
        self.scorer_null = scorer_null(scorer)

    @abstractmethod
    def score_round(
        self,
        estimates: RoundEstimates,
        updates: list,
        reference: Any,
        scorer: Any,
        apply: ApplyUpdate,
        center: Any,
        on_target: OnTarget | None,
    ) -> RoundRecord:
        """One round: every estimate scored, each target kept and recorded."""

    def report(
        self, truth: Mapping[int, bool] | None = None, statistic: str | None = None
    ) -> AttributionReport:
        """Stouffer over each client's rounds of the kept values (all statistics combined, or
        the one named): see :func:`~fedattr.attribution.stouffer.combine_reports`."""
        names = [statistic] if statistic is not None else sorted(self.scores)
        unknown = [n for n in names if n not in self.scores]
        if unknown:
            raise KeyError(f"statistic {unknown[0]!r} was not scored; have {sorted(self.scores)}")
        reports = []
        for name in names or [DEFAULT_STATISTIC]:
            scores = dict(self.scores.get(name, {}))
            if self.null == "empirical":
                scores = empirical_null(scores)
            for cid in truth or {}:
                scores.setdefault(cid, {})
            reports.append(build_report(scores, self.config.paper.threshold, truth, statistic=name))
        return reports[0] if len(reports) == 1 else combine_reports(reports)

    def changes(self) -> tuple[dict[str, Any], dict[str, dict]]:
        """The summed key-free changes (``"<client>/<part>"`` -> tensor) and their key laws,
        where the statistic keeps them (the calibrated one); else empty."""
        return {}, {}

    def state(self) -> dict:
        """Everything accumulated so far (for checkpoints)."""
        return {"scores": self.scores}

    def load(self, state: Mapping) -> None:
        """Restore :meth:`state`."""
        self.scores = state["scores"]

    def _keep(
        self,
        record: RoundRecord,
        est: Estimate,
        z: dict[str, float],
        seconds: float,
        on_target: OnTarget | None,
        contexts: float | None = None,
    ) -> None:
        """Keep one target's values (for Stouffer and display) and its record."""
        for stat, value in z.items():
            self.scores.setdefault(stat, {}).setdefault(est.target, {})[record.round] = value
        design = est.design
        fused = est.fused
        target = TargetRecord(
            round=record.round,
            target=est.target,
            z=z,
            c=design.stats.c,
            m_eff=design.stats.m_eff,
            threshold=design.stats.threshold,
            redraws=design.redraws,
            queries=1 if fused else design.queries,
            U=[list(u) for u in design.U],
            V=[list(v) for v in design.V],
            sa_seconds=est.sa_seconds,
            score_seconds=seconds,
            fused=fused,
            attempts=est.attempts,
            effective_contexts=contexts,
        )
        record.targets.append(target)
        if on_target is not None:
            on_target(target)


class PaperStatistic(Statistic):
    """The published statistic: differential scores, Stouffer, flag above γ."""

    name = "paper"

    @property
    def null(self) -> str:
        """The configured null, or the scorer's under ``attribution.paper.null = auto``."""
        null = self.config.paper.null
        return self.scorer_null if null == "auto" else null

    def score_round(
        self,
        estimates: RoundEstimates,
        updates: list,
        reference: Any,
        scorer: Any,
        apply: ApplyUpdate,
        center: Any,
        on_target: OnTarget | None,
    ) -> RoundRecord:
        if self.config.paper.mean_reference:
            if center is None:
                raise ValueError(
                    "attribution.paper.mean_reference: needs the round's SA mean (center=...)"
                )
            reference = apply(reference, center)
            minus_center = scale_update(center, -1.0)
            updates = [add_update(u, minus_center) for u in updates]
        t0 = time.perf_counter()
        differential = DifferentialScorer(scorer, reference, apply)
        record = RoundRecord(
            estimates.round,
            list(estimates.participants),
            differential.reference_score,
            skipped=list(estimates.skipped),
            dropouts=list(estimates.dropouts),
        )
        record.models_scored = 1 + len(updates)
        batched = differential.paired and observes_in_batches(scorer)
        if batched:
            scored = differential.score_many(updates)
            each = (time.perf_counter() - t0) / max(1, len(updates))
        for k, (est, update) in enumerate(zip(estimates.estimates, updates, strict=True)):
            t1 = time.perf_counter()
            z = scored[k] if batched else differential(update)
            seconds = each if batched else time.perf_counter() - t1
            self._keep(record, est, z, seconds, on_target)
        return record


class CalibratedStatistic(Statistic):
    """Each client's summed key-linear change, read against its exact tail under a random key
    (see :mod:`fedattr.attribution.calibrated`)."""

    name = "calibrated"

    def __init__(self, config: AttributionConfig) -> None:
        super().__init__(config)
        self.calibrated = CalibratedNull.of(config)
        """The sums and the verdicts."""

    @property
    def null(self) -> str:
        """The owner's key against random keys (its exact tail)."""
        return "key-randomised"

    def use_scorer(self, scorer: Any) -> None:
        """Also lend the scorer to the de-mixed reading (a run resumed after its last round
        reads its stacked rounds with it)."""
        super().use_scorer(scorer)
        if isinstance(scorer, LinearKeyScorer):
            self.calibrated.read_with(scorer)

    def score_round(
        self,
        estimates: RoundEstimates,
        updates: Sequence[Any],
        reference: Any,
        scorer: Any,
        apply: ApplyUpdate,
        center: Any,
        on_target: OnTarget | None,
    ) -> RoundRecord:
        """Every estimate's key-linear change, read into :class:`CalibratedNull` with the
        round's plan (:func:`~fedattr.attribution.calibrated.reading.read_round`)."""
        if not isinstance(scorer, LinearKeyScorer):
            raise UserError(
                "attribution.statistic=calibrated: this detector's statistic is not linear in "
                "the key; use watermark.detector=reading, or attribution.statistic=paper"
            )
        if not self.calibrated.reads(estimates.round, scorer):
            return self._unread(estimates, scorer, on_target)
        t0 = time.perf_counter()
        plan = self.calibrated.plan(
            estimates.round,
            estimates.participants,
            [e.target for e in estimates.estimates],
            [e.design for e in estimates.estimates],
            scorer,
        )
        read = read_round(
            self.calibrated,
            plan,
            updates,
            reference,
            scorer,
            apply,
            center,
            config=self.config,
            mean_row=not estimates.dropouts,
        )
        each = (time.perf_counter() - t0) / max(1, len(plan.targets))
        record = RoundRecord(
            estimates.round,
            list(estimates.participants),
            {},
            skipped=list(estimates.skipped),
            dropouts=list(estimates.dropouts),
            decorrelated=self.calibrated.decorrelated.get(estimates.round),
            models_scored=read.models,
        )
        for k, est in enumerate(estimates.estimates):
            contexts = read.contexts[k] if read.contexts else None
            self._keep(record, est, read.display[est.target], each, on_target, contexts)
        return record

    def _unread(
        self, estimates: RoundEstimates, scorer: Any, on_target: OnTarget | None
    ) -> RoundRecord:
        """A round past the detector's exchangeable ones (``calibrated.late_rounds = "skip"``): no
        model is read, every target is recorded without a value."""
        record = RoundRecord(
            estimates.round,
            list(estimates.participants),
            {},
            skipped=list(estimates.skipped),
            dropouts=list(estimates.dropouts),
            models_scored=0,
        )
        record.notes.append(
            "not read: the detector's key is exchangeable with a random one up to round "
            f"{scorer.exchangeable_rounds} only (attribution.calibrated.late_rounds = skip)"
        )
        for est in estimates.estimates:
            self._keep(record, est, {}, 0.0, on_target)
        return record

    def report(
        self, truth: Mapping[int, bool] | None = None, statistic: str | None = None
    ) -> AttributionReport:
        """The exact-tail verdicts; with ``statistic`` named, Stouffer over that statistic's
        per-round values (for display)."""
        if statistic is None:
            return self.calibrated.report(truth)
        return super().report(truth, statistic)

    def changes(self) -> tuple[dict[str, Any], dict[str, dict]]:
        kept = self.calibrated
        kept.settle()  # rounds kept for de-mixing: their de-mixed change is in each W
        merged = kept.evidence().W
        flat = {f"{c}/{p}": W for c, parts in merged.items() for p, W in parts.items()}
        return flat, dict(kept.laws)

    def state(self) -> dict:
        return {**super().state(), "calibrated": self.calibrated.state()}

    def load(self, state: Mapping) -> None:
        super().load(state)
        self.calibrated.load(state["calibrated"])


STATISTICS: dict[str, type[Statistic]] = {s.name: s for s in (PaperStatistic, CalibratedStatistic)}
"""``attribution.statistic`` -> its class."""
