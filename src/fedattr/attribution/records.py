"""What FedAttr records of a round: phase 1's estimates, and the per-target records of the
scores (``rounds.jsonl``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from ..updates import UpdateLayout
from .design import QueryDesign


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
    notes: list[str] = field(default_factory=list)
    """What the round did differently, not a problem (e.g. a round the detector does not read)."""
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
