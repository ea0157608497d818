"""FedAttr round by round, in two phases: every SA query of the round, then every score.

Phase 1 (:meth:`FedAttr.query_round`) draws each target's design and asks secure aggregation
for its sums in one batch (``run_queries``: a remote runtime sends each client one message per
round); designs, the release policy and dropouts never depend on scores. Phase 2
(:meth:`FedAttr.score_round`) scores all estimates against the round's reference (a scorer with
``observe_many`` sees them in one batched pass). Stouffer then combines rounds per client.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import UserError
from ..secagg.aggregator import SecureAggregator
from ..secagg.batches import QueryGroup
from ..secagg.errors import QueryRefused
from ..updates import add_update
from .config import AttributionConfig
from .contract import PairedScorer, Scorer
from .design import DesignError, QueryDesign, draw_design, validate_parameters
from .estimator import design_queries, design_reduction
from .records import Estimate, RoundEstimates, RoundRecord
from .scoring import ApplyUpdate
from .statistics import STATISTICS, OnTarget, Statistic
from .stouffer import AttributionReport


@dataclass
class _Target:
    rng: np.random.Generator
    missing: set[int]
    attempts: int = 0


def _float32_estimate(_group: int, _chosen: int, results: list[np.ndarray]) -> np.ndarray:
    """A group's summed answers (its :func:`~.estimator.design_reduction`) as the estimate kept:
    float32, since every model it is read into computes in float32 or less (add_update casts it
    so), and a round holds K of them (0.3 GB for SmolLM2)."""
    (total,) = results
    return total.astype(np.float32)


class FedAttr:
    """Runs FedAttr over rounds and accumulates per-client differential scores."""

    def __init__(self, config: AttributionConfig | None = None) -> None:
        self.config = config or AttributionConfig()
        self.statistic: Statistic = STATISTICS[self.config.statistic](self.config)
        """How the estimates are read (``attribution.statistic``)."""

    @property
    def scores(self) -> dict[str, dict[int, dict[int, float]]]:
        """Statistic name -> client -> round -> that round's value."""
        return self.statistic.scores

    @property
    def null(self) -> str:
        """The null in force: ``key-randomised`` for the calibrated statistic; for the paper's,
        the configured one, or the scorer's under ``auto``."""
        return self.statistic.null

    def use_scorer(self, scorer: Any) -> None:
        """Note what ``scorer`` says of its null (``null`` reads it)."""
        self.statistic.use_scorer(scorer)

    def state(self) -> dict:
        """Everything accumulated so far (for checkpoints)."""
        return self.statistic.state()

    def load(self, state: Mapping) -> None:
        """Restore :meth:`state`."""
        self.statistic.load(state)

    def attribute_round(
        self,
        round_id: int,
        sa: SecureAggregator,
        reference: Any,
        scorer: Scorer | PairedScorer,
        *,
        apply: ApplyUpdate | None = None,
        on_target: OnTarget | None = None,
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
        proto = cfg.protocol
        participants = list(sa.clients)
        validate_parameters(len(participants), proto.N, proto.M, sa.min_members)
        hardened = proto.mode == "hardened"
        if hardened and sa.release_budget is None:
            raise UserError(
                "attribution.protocol.mode=hardened: the secure aggregation has no release policy "
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
                if target in st.missing or st.attempts >= proto.policy_attempts:
                    skipped.add(target)
                    continue
                try:
                    validate_parameters(len(available), proto.N, proto.M, sa.min_members)
                except DesignError:
                    skipped.add(target)  # too few clients answer for a valid design this round
                    continue
                n = proto.policy_attempts - st.attempts if hardened else 1
                designs = [
                    draw_design(
                        available,
                        target,
                        proto.N,
                        proto.M,
                        st.rng,
                        min_members=sa.min_members,
                        max_redraws=proto.max_redraws,
                    )
                    for _ in range(n)
                ]
                plans.append((target, designs, [self._fused(d, sa) for d in designs]))
            if not plans:
                break
            # Each group's 2M answers summed into its estimate as they arrive.
            groups = [
                QueryGroup(
                    [design_queries(d, f) for d, f in zip(ds, fs, strict=True)],
                    reduce=[design_reduction(d, f) for d, f in zip(ds, fs, strict=True)],
                )
                for _, ds, fs in plans
            ]
            answers = sa.run_queries(groups, combine=_float32_estimate)
            out.batches += 1
            pending = []
            for (target, designs, fused), answer in zip(plans, answers, strict=True):
                st = targets[target]
                if answer.results is not None:
                    assert answer.chosen is not None  # an answered group says which design
                    st.attempts += answer.chosen + 1
                    design, as_one = designs[answer.chosen], fused[answer.chosen]
                    (flat,) = answer.results
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
        if self.config.protocol.mode == "hardened":
            return True
        return self.config.protocol.queries == "fused" and sa.admits_combination(
            design.integer_coefficients()
        )

    def score_round(
        self,
        estimates: RoundEstimates,
        reference: Any,
        scorer: Scorer | PairedScorer,
        *,
        apply: ApplyUpdate | None = None,
        on_target: OnTarget | None = None,
        center: Any = None,
    ) -> RoundRecord:
        """Phase 2: the differential score of every estimate against ``reference`` = w^{t-1}.

        With ``attribution.paper.mean_reference``, ``center`` is the round's SA mean: both models
        then carry it and only each client's deviation from it is tested. ``on_target(record)`` is
        called after each target (progress reporting).
        """
        self.statistic.use_scorer(scorer)
        updates = [estimates.layout.unflatten(e.flat) for e in estimates.estimates]
        return self.statistic.score_round(
            estimates, updates, reference, scorer, apply or add_update, center, on_target
        )

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
        return self.statistic.report(truth, statistic)
