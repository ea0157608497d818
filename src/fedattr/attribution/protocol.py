"""FedAttr round by round: design, estimate through SA, differential score, Stouffer."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..secagg.base import SecureAggregator
from ..secagg.errors import QueryFailed, QueryRefused
from ..updates import add_update
from .design import DesignError, draw_design, validate_parameters
from .estimator import estimate_update, estimate_update_fused
from .scoring import DEFAULT_STATISTIC, ApplyUpdate, DifferentialScorer, PairedScorer, Scorer
from .stouffer import AttributionReport, build_report, combine_reports, empirical_null


@dataclass
class AttributionConfig:
    """FedAttr protocol parameters (paper defaults)."""

    N: int = 5
    """Size of the V-subsets (U-subsets have N+1 members)."""
    M: int = 5
    """Query pairs per target and round."""
    gamma: float = 4.0
    """Flag a client when its Stouffer Z exceeds gamma."""
    max_redraws: int = 10_000
    """Give up on a target after this many rejected designs in a row."""
    seed: int = 0
    """Seed of the design draws (each round and target gets its own stream)."""
    mode: str = "paper"
    """``paper``: 2M subset-sum queries per target, every target every round (as published).
    ``hardened``: one fused query per target, and only targets the SA release policy admits
    (rotating, seeded order); Stouffer runs over each client's targeted rounds."""
    policy_attempts: int = 20
    """Designs tried per target (after release-policy refusals or failed queries) before the
    target is skipped for the round."""
    center: bool = False
    """``False`` (the paper): score ``w^{t-1} + Delta_hat_i`` against ``w^{t-1}``. ``True``:
    score ``w^{t-1} + Delta_bar + (Delta_hat_i - Delta_bar)`` against ``w^{t-1} + Delta_bar``
    (``Delta_bar`` = the round's SA mean, passed as ``center``), so that the round's common
    learning direction is in both models and only the client's deviation from it is tested."""
    null: str = "auto"
    """``theoretical`` (the paper): each differential score is taken as N(0, 1) under the null.
    ``empirical``: each round's scores per statistic are standardised by their median and MAD
    over the round's targets before Stouffer (see ``stouffer.empirical_null``). ``auto``:
    empirical for a scorer whose statistic has no null scale of its own (it says so with
    ``null = "empirical"``, e.g. the FK margin), theoretical otherwise."""

    def __post_init__(self) -> None:
        if self.null not in ("auto", "theoretical", "empirical"):
            raise DesignError(
                f"attribution.null: must be auto, theoretical or empirical, got {self.null!r}"
            )
        if self.mode not in ("paper", "hardened"):
            raise DesignError(f"attribution.mode: must be paper or hardened, got {self.mode!r}")
        if not isinstance(self.policy_attempts, int) or self.policy_attempts < 1:
            raise DesignError(
                "attribution.policy_attempts: must be an integer >= 1, "
                f"got {self.policy_attempts!r}"
            )
        if not isinstance(self.M, int) or self.M < 1:
            raise DesignError(f"attribution.M: must be an integer >= 1, got {self.M!r}")
        if not isinstance(self.N, int) or self.N < 1:
            raise DesignError(f"attribution.N: must be an integer >= 1, got {self.N!r}")
        if not np.isfinite(self.gamma):
            raise DesignError(f"attribution.gamma: must be a finite number, got {self.gamma!r}")
        if not isinstance(self.max_redraws, int) or self.max_redraws < 0:
            raise DesignError(
                f"attribution.max_redraws: must be an integer >= 0, got {self.max_redraws!r}"
            )


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

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return asdict(self)


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
        self.rounds: list[RoundRecord] = []
        self.scorer_null = "theoretical"
        """What the last scorer said about its null (``null`` attribute; see ``null``)."""

    @property
    def null(self) -> str:
        """The null in force: the configured one, or the scorer's under ``auto``."""
        return self.scorer_null if self.config.null == "auto" else self.config.null

    def attribute_round(
        self,
        round_id: int,
        sa: SecureAggregator,
        reference: Any,
        scorer: Scorer | PairedScorer,
        *,
        targets: Iterable[int] | None = None,
        apply: ApplyUpdate | None = None,
        on_target: Any = None,
        center: Any = None,
    ) -> RoundRecord:
        """Attribute every target of the open SA round against ``reference`` = w^{t-1}.

        ``sa`` must hold this round's submitted updates; only its subset-sum interface is used.
        ``on_target(record)`` is called after each target (progress reporting).
        """
        cfg = self.config
        participants: Sequence[int] = sa.clients
        validate_parameters(len(participants), cfg.N, cfg.M, sa.min_members)
        self.scorer_null = resolve_scorer_null(scorer)
        apply = apply or add_update
        if cfg.center:
            if center is None:
                raise ValueError("attribution.center: needs the round's SA mean (center=...)")
            reference = apply(reference, center)
            minus_center = (
                {k: -v for k, v in center.items()} if isinstance(center, Mapping) else -center
            )
        differential = DifferentialScorer(scorer, reference, apply)
        record = RoundRecord(round_id, list(participants), differential.reference_score)
        hardened = cfg.mode == "hardened"
        order = list(participants if targets is None else targets)
        if hardened and targets is None:
            # Rotate who goes first, so that over rounds every client gets admitted.
            shift = int(np.random.default_rng([cfg.seed, round_id, 1]).integers(len(order)))
            order = order[shift:] + order[:shift]
        seen_missing: set[int] = set()
        for target in order:
            rng = np.random.default_rng([cfg.seed, round_id, target])
            t0 = time.perf_counter()
            flat, design, attempts, refusals = None, None, 0, 0
            # Offline clients are left out of every design; a client that failed to answer is
            # left out of this target's redraws (failures may be transient).
            missing = set(sa.offline)
            while flat is None and target not in missing and attempts < cfg.policy_attempts:
                available = [p for p in participants if p not in missing]
                try:
                    validate_parameters(len(available), cfg.N, cfg.M, sa.min_members)
                except DesignError:
                    break  # too few clients answer for a valid design this round
                attempts += 1
                design = draw_design(
                    available,
                    target,
                    cfg.N,
                    cfg.M,
                    rng,
                    min_members=sa.min_members,
                    max_redraws=cfg.max_redraws,
                )
                try:
                    if hardened:
                        flat = estimate_update_fused(sa, design)
                    else:
                        flat = estimate_update(sa, design)
                except QueryFailed as exc:
                    # Nothing was released; redraw without the clients that did not answer.
                    missing.update(exc.missing)
                    seen_missing.update(exc.missing)
                except QueryRefused:
                    if not hardened:
                        raise
                    refusals += 1  # the release policy said no: try another design
                    if refusals >= cfg.policy_attempts:
                        break
            if flat is None:
                record.skipped.append(target)
                continue
            estimate = sa.layout.unflatten(flat)
            if cfg.center:
                estimate = add_update(estimate, minus_center)
            t1 = time.perf_counter()
            z = differential(estimate)
            t2 = time.perf_counter()
            for stat, value in z.items():
                self.scores.setdefault(stat, {}).setdefault(target, {})[round_id] = value
            target_record = TargetRecord(
                round=round_id,
                target=target,
                z=z,
                c=design.stats.c,
                m_eff=design.stats.m_eff,
                threshold=design.stats.threshold,
                redraws=design.redraws,
                queries=design.queries,
                U=[list(u) for u in design.U],
                V=[list(v) for v in design.V],
                sa_seconds=t1 - t0,
                score_seconds=t2 - t1,
                fused=hardened,
                attempts=attempts,
            )
            record.targets.append(target_record)
            if on_target is not None:
                on_target(target_record)
        record.dropouts = sorted(seen_missing | set(sa.offline))
        self.rounds.append(record)
        return record

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
