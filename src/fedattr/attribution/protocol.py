"""FedAttr round by round, in two phases: every SA query of the round, then every score.

Phase 1 (:meth:`FedAttr.query_round`) draws each target's design and asks secure aggregation
for its sums in one batch (``run_queries``: a remote runtime sends each client one message per
round); designs, the release policy and dropouts never depend on scores. Phase 2
(:meth:`FedAttr.score_round`) scores all estimates against the round's reference (a scorer with
``observe_many`` sees them in one batched pass). Stouffer then combines rounds per client.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from itertools import chain
from typing import Any

import numpy as np

from ..errors import UserError
from ..secagg.base import QueryGroup, SecureAggregator
from ..secagg.errors import QueryRefused
from ..updates import UpdateLayout, add_update, scale_update
from .calibrated import CalibratedNull, LinearKeyScorer, SpreadReporter
from .config import AttributionConfig
from .design import DesignError, QueryDesign, draw_design, validate_parameters
from .estimator import combine_answers, design_queries
from .scoring import (
    DEFAULT_STATISTIC,
    ApplyUpdate,
    DifferentialScorer,
    PairedScorer,
    Scorer,
    observe_all,
    observes_in_batches,
)
from .stouffer import AttributionReport, build_report, combine_reports, empirical_null


@dataclass
class TargetRecord:
    """What happened for one target in one round."""

    round: int
    target: int
    z: dict[str, float]
    c: float
    m_eff: float
    threshold: float
    redraws: int
    queries: int
    U: list[list[int]]
    V: list[list[int]]
    sa_seconds: float
    score_seconds: float
    fused: bool = False
    attempts: int = 1
    effective_contexts: float | None = None
    """Reading detectors: over how many contexts the change is spread (its normal tail is only
    trustworthy when this is large; see ``RoundRecord.warnings``)."""


@dataclass
class RoundRecord:
    """One round of attribution: the reference score and every target's record."""

    round: int
    participants: list[int]
    reference_score: dict[str, float]
    targets: list[TargetRecord] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    """Targets not attributed this round (release policy refused, or the target dropped out)."""
    dropouts: list[int] = field(default_factory=list)
    """Clients that failed to answer an SA query this round (excluded from later designs)."""
    decorrelated: bool | None = None
    """Calibrated statistic: whether cross-talk was undone with the design matrix."""
    warnings: list[str] = field(default_factory=list)
    models_scored: int = 0
    """Models the detector read this round (reference, candidates, the SA mean's)."""

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return asdict(self)



@dataclass
class Estimate:
    """One target's estimate from phase 1 (flat, in the SA layout)."""

    target: int
    flat: np.ndarray
    design: QueryDesign
    attempts: int
    sa_seconds: float
    fused: bool = False
    """Asked as one fused SA query (else as the design's ``2M`` subset sums)."""


@dataclass
class RoundEstimates:
    """Phase 1 of a round: every estimate, who was skipped, who failed to answer."""

    round: int
    participants: list[int]
    layout: UpdateLayout
    estimates: list[Estimate] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    dropouts: list[int] = field(default_factory=list)
    batches: int = 0
    """``run_queries`` calls (1 unless queries failed and targets were redrawn)."""


@dataclass
class _Target:
    rng: np.random.Generator
    missing: set[int]
    attempts: int = 0


def resolve_scorer_null(scorer: Any) -> str:
    """``empirical`` when the scorer's statistic has no null scale of its own, else
    ``theoretical``."""
    return "empirical" if getattr(scorer, "null", "theoretical") == "empirical" else "theoretical"


class FedAttr:
    """Runs FedAttr over rounds and accumulates per-client differential scores."""

    def __init__(self, config: AttributionConfig | None = None) -> None:
        self.config = config or AttributionConfig()
        # statistic -> client -> round -> differential score
        self.scores: dict[str, dict[int, dict[int, float]]] = {}
        self.scorer_null = "theoretical"
        """What the last scorer said about its null (``null`` attribute; see ``null``)."""
        cfg = self.config
        self.calibrated = CalibratedNull(cfg.alpha, cfg.decorrelate, cfg.null_keys, cfg.seed,
                                         cfg.name_uncalibrated, cfg.token_centring)  # fmt: skip
        """The calibrated statistic's sums (``statistic = "calibrated"``)."""

    @property
    def null(self) -> str:
        """The null in force: ``key-randomised`` for the calibrated statistic; for the paper's,
        the configured one, or the scorer's under ``auto``."""
        if self.config.statistic == "calibrated":
            return "key-randomised"
        return self.scorer_null if self.config.null == "auto" else self.config.null

    def state(self) -> dict:
        """Everything accumulated so far (for checkpoints)."""
        return {"scores": self.scores, "calibrated": self.calibrated.state()}

    def load(self, state: Mapping) -> None:
        """Restore :meth:`state`."""
        self.scores = state["scores"]
        self.calibrated.load(state["calibrated"])

    def attribute_round(
        self,
        round_id: int,
        sa: SecureAggregator,
        reference: Any,
        scorer: Scorer | PairedScorer,
        *,
        apply: ApplyUpdate | None = None,
        on_target: Any = None,
        center: Any = None,
    ) -> RoundRecord:
        """Both phases for the open SA round against ``reference`` = w^{t-1}: see
        :meth:`query_round` and :meth:`score_round`."""
        estimates = self.query_round(round_id, sa)
        return self.score_round(
            estimates, reference, scorer, apply=apply, on_target=on_target, center=center
        )

    def query_round(self, round_id: int, sa: SecureAggregator) -> RoundEstimates:
        """Phase 1: every target's estimate from the open SA round, through SA queries only.

        Each target's design is drawn from its own seeded stream; all designs go to SA in one
        ``run_queries`` batch. In hardened mode a target's group carries up to
        ``policy_attempts`` alternative designs, of which the party that unmasks answers the
        first its release policy admits. Targets whose queries failed (members that did not
        answer) are redrawn without those members in a further batch.
        """
        cfg = self.config
        participants = list(sa.clients)
        validate_parameters(len(participants), cfg.N, cfg.M, sa.min_members)
        hardened = cfg.mode == "hardened"
        if hardened and sa.release_budget is None:
            raise UserError(
                "attribution.mode=hardened: the secure aggregation has no release policy "
                "(secagg.release_budget = 0), so nothing would bound what the queries reveal; "
                "set secagg.release_budget > 0 (fedattr.attribution.harden() gives the paper's "
                "single-estimate bound)"
            )
        order = list(participants)
        if hardened:
            # Rotate who goes first, so that over rounds every client gets admitted.
            shift = int(np.random.default_rng([cfg.seed, round_id, 1]).integers(len(order)))
            order = order[shift:] + order[:shift]
        out = RoundEstimates(round_id, participants, sa.layout)
        # Offline clients are left out of every design; a client that failed to answer is left
        # out of that target's redraws (failures may be transient).
        targets = {
            t: _Target(np.random.default_rng([cfg.seed, round_id, t]), set(sa.offline))
            for t in order
        }
        done: dict[int, Estimate] = {}
        skipped: set[int] = set()
        seen_missing: set[int] = set()
        pending = order
        while pending:
            # (target, its alternative designs, whether each is asked as one fused query)
            plans: list[tuple[int, list[QueryDesign], list[bool]]] = []
            for target in pending:
                st = targets[target]
                available = [p for p in participants if p not in st.missing]
                if target in st.missing or st.attempts >= cfg.policy_attempts:
                    skipped.add(target)
                    continue
                try:
                    validate_parameters(len(available), cfg.N, cfg.M, sa.min_members)
                except DesignError:
                    skipped.add(target)  # too few clients answer for a valid design this round
                    continue
                n = cfg.policy_attempts - st.attempts if hardened else 1
                designs = [
                    draw_design(
                        available,
                        target,
                        cfg.N,
                        cfg.M,
                        st.rng,
                        min_members=sa.min_members,
                        max_redraws=cfg.max_redraws,
                    )
                    for _ in range(n)
                ]
                plans.append((target, designs, [self._fused(d, sa) for d in designs]))
            if not plans:
                break
            groups = [
                QueryGroup([design_queries(d, f) for d, f in zip(ds, fs, strict=True)])
                for _, ds, fs in plans
            ]
            answers = sa.run_queries(groups)
            out.batches += 1
            pending = []
            for (target, designs, fused), answer in zip(plans, answers, strict=True):
                st = targets[target]
                if answer.results is not None:
                    assert answer.chosen is not None  # an answered group says which design
                    st.attempts += answer.chosen + 1
                    design, as_one = designs[answer.chosen], fused[answer.chosen]
                    flat = combine_answers(design, answer.results, as_one)
                    done[target] = Estimate(
                        target, flat, design, st.attempts, answer.seconds, as_one
                    )
                elif answer.missing:
                    # Nothing was released; redraw without the clients that did not answer.
                    st.attempts += answer.refusals + 1
                    st.missing.update(answer.missing)
                    seen_missing.update(answer.missing)
                    pending.append(target)
                elif not hardened:
                    raise QueryRefused(answer.error)
                else:
                    skipped.add(target)  # the release policy refused every alternative
        out.estimates = [done[t] for t in order if t in done]
        out.skipped = [t for t in order if t in skipped]
        out.dropouts = sorted(seen_missing | set(sa.offline))
        return out

    def _fused(self, design: QueryDesign, sa: SecureAggregator) -> bool:
        """Whether ``design``'s estimate is asked as one fused query: always in hardened mode
        (its release policy picks among alternative designs); with ``queries = "fused"`` where
        SA admits the combination (:meth:`SecureAggregator.admits_combination`: enough clients
        with a nonzero coefficient, the ring holds up to M (2N + 1) values). Where it does not,
        the design's 2M subset sums give the same estimate, so the design is kept and the
        draws stay those of a subsets run."""
        if self.config.mode == "hardened":
            return True
        return self.config.queries == "fused" and sa.admits_combination(
            design.integer_coefficients()
        )

    def score_round(
        self,
        estimates: RoundEstimates,
        reference: Any,
        scorer: Scorer | PairedScorer,
        *,
        apply: ApplyUpdate | None = None,
        on_target: Any = None,
        center: Any = None,
    ) -> RoundRecord:
        """Phase 2: the differential score of every estimate against ``reference`` = w^{t-1}.

        With ``attribution.center``, ``center`` is the round's SA mean: both models then carry
        it and only each client's deviation from it is tested. ``on_target(record)`` is called
        after each target (progress reporting).
        """
        cfg = self.config
        self.scorer_null = resolve_scorer_null(scorer)
        apply = apply or add_update
        updates = [estimates.layout.unflatten(e.flat) for e in estimates.estimates]
        if cfg.statistic == "calibrated":
            return self._score_calibrated(estimates, updates, reference, scorer, apply, center,
                                          on_target)  # fmt: skip
        if cfg.center:
            if center is None:
                raise ValueError("attribution.center: needs the round's SA mean (center=...)")
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
            self._add_target(record, est, z, seconds, on_target)
        return record

    def _score_calibrated(
        self, estimates: RoundEstimates, updates: list, reference: Any, scorer: Any,
        apply: ApplyUpdate, center: Any, on_target: Any,
    ) -> RoundRecord:  # fmt: skip
        """Phase 2 under the calibrated statistic: every estimate's key-linear change, then
        :class:`CalibratedNull` (see its module)."""
        if not isinstance(scorer, LinearKeyScorer):
            raise UserError(
                "attribution.statistic=calibrated: this detector's statistic is not linear in "
                "the key; use watermark.detector=reading, or attribution.statistic=paper"
            )
        t0 = time.perf_counter()
        # The reference, every candidate and the SA mean: one batched read when the scorer
        # offers it (else lazily, one candidate's parameters at a time). The SA mean only
        # matters where the round's cross-talk cannot be undone: not read otherwise.
        targets = [e.target for e in estimates.estimates]
        designs = [e.design for e in estimates.estimates]
        if center is not None and self.calibrated.decorrelates(
            estimates.participants, targets, designs
        ):
            center = None
        extra = [] if center is None else [center]
        ref_obs, *observed = observe_all(
            scorer, chain([reference], (apply(reference, u) for u in [*updates, *extra]))
        )
        spread = []
        if isinstance(scorer, SpreadReporter):
            spread = [scorer.effective_contexts(ref_obs, obs) for obs in observed[: len(updates)]]
        changes = [scorer.change(ref_obs, obs) for obs in observed]
        del observed
        middle = changes.pop() if center is not None else None
        display = self.calibrated.add_round(
            estimates.round, estimates.participants, targets, designs, changes, middle, scorer
        )
        each = (time.perf_counter() - t0) / max(1, len(targets))
        record = RoundRecord(
            estimates.round, list(estimates.participants), {},
            skipped=list(estimates.skipped), dropouts=list(estimates.dropouts),
            decorrelated=self.calibrated.decorrelated.get(estimates.round),
            models_scored=1 + len(changes) + (middle is not None),
        )  # fmt: skip
        for k, est in enumerate(estimates.estimates):
            contexts = spread[k] if spread else None
            self._add_target(record, est, display[est.target], each, on_target, contexts)
        return record

    def _add_target(
        self, record: RoundRecord, est: Estimate, z: dict[str, float], seconds: float,
        on_target: Any, contexts: float | None = None,
    ) -> None:  # fmt: skip
        """Keep one target's scores (for Stouffer and display) and its record."""
        for stat, value in z.items():
            self.scores.setdefault(stat, {}).setdefault(est.target, {})[record.round] = value
        design = est.design
        fused = est.fused
        target = TargetRecord(
            round=record.round, target=est.target, z=z, c=design.stats.c,
            m_eff=design.stats.m_eff, threshold=design.stats.threshold, redraws=design.redraws,
            queries=1 if fused else design.queries, U=[list(u) for u in design.U],
            V=[list(v) for v in design.V], sa_seconds=est.sa_seconds, score_seconds=seconds,
            fused=fused, attempts=est.attempts, effective_contexts=contexts,
        )  # fmt: skip
        record.targets.append(target)
        if on_target is not None:
            on_target(target)

    @property
    def statistics(self) -> list[str]:
        """Names of the tracked statistics (one per corpus owner's key for KGW)."""
        return sorted(self.scores)

    def report(
        self, truth: Mapping[int, bool] | None = None, statistic: str | None = None
    ) -> AttributionReport:
        """Stouffer Z over each client's attributed rounds, flags, and TPR/FPR given ``truth``.

        With several statistics and no ``statistic`` named, the combined report is returned: see
        :func:`~fedattr.attribution.stouffer.combine_reports`.
        """
        if self.config.statistic == "calibrated" and statistic is None:
            return self.calibrated.report(truth)
        names = [statistic] if statistic is not None else self.statistics
        unknown = [n for n in names if n not in self.scores]
        if unknown:
            raise KeyError(f"statistic {unknown[0]!r} was not scored; have {self.statistics}")
        reports = []
        for name in names or [DEFAULT_STATISTIC]:
            scores = dict(self.scores.get(name, {}))
            if self.null == "empirical":
                scores = empirical_null(scores)
            for cid in truth or {}:
                scores.setdefault(cid, {})
            reports.append(build_report(scores, self.config.gamma, truth, statistic=name))
        return reports[0] if len(reports) == 1 else combine_reports(reports)
