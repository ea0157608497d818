"""FedAttr: query design, SA-only estimator, differential scoring, Stouffer, privacy accounting.

Runs on plain tensors: nothing here needs a language model.
"""

from .design import (
    DesignError,
    DesignStats,
    QueryDesign,
    acceptance_threshold,
    design_stats,
    draw_design,
    validate_parameters,
)
from .estimator import estimate_update, predicted_error_trace
from .privacy import acceptance_rate, joint_recovery, summarize, theorem4_bound
from .protocol import AttributionConfig, FedAttr, RoundRecord, TargetRecord
from .scoring import DifferentialScorer, LinearScorer, PairedScorer, Scorer
from .stouffer import AttributionReport, ClientAttribution, build_report, stouffer, upper_tail

__all__ = [
    "AttributionConfig",
    "AttributionReport",
    "ClientAttribution",
    "DesignError",
    "DesignStats",
    "DifferentialScorer",
    "FedAttr",
    "LinearScorer",
    "PairedScorer",
    "QueryDesign",
    "RoundRecord",
    "Scorer",
    "TargetRecord",
    "acceptance_rate",
    "acceptance_threshold",
    "build_report",
    "design_stats",
    "draw_design",
    "estimate_update",
    "joint_recovery",
    "predicted_error_trace",
    "stouffer",
    "summarize",
    "theorem4_bound",
    "upper_tail",
    "validate_parameters",
]
