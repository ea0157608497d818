"""FedAttr: query design, SA-only estimator, differential scoring, Stouffer, privacy accounting.

Runs on plain tensors: nothing here needs a language model.
"""

from .config import AttributionConfig, CalibratedConfig, PaperConfig, ProtocolConfig, harden
from .contract import PairedScorer, Scorer
from .design import (
    DesignError,
    DesignStats,
    QueryDesign,
    acceptance_threshold,
    design_stats,
    draw_design,
    single_estimate_budget,
    validate_parameters,
)
from .estimator import combine_answers, design_queries, estimate_update, predicted_error_trace
from .privacy import acceptance_rate, joint_recovery, summarize, theorem4_bound
from .protocol import FedAttr
from .records import Estimate, RoundEstimates, RoundRecord, TargetRecord
from .scoring import DifferentialScorer, LinearScorer
from .statistics import CalibratedStatistic, PaperStatistic, Statistic
from .stouffer import AttributionReport, ClientAttribution, build_report, stouffer, upper_tail

__all__ = [
    "AttributionConfig",
    "AttributionReport",
    "CalibratedConfig",
    "CalibratedStatistic",
    "ClientAttribution",
    "DesignError",
    "DesignStats",
    "DifferentialScorer",
    "Estimate",
    "FedAttr",
    "LinearScorer",
    "PairedScorer",
    "PaperConfig",
    "PaperStatistic",
    "ProtocolConfig",
    "QueryDesign",
    "RoundEstimates",
    "RoundRecord",
    "Scorer",
    "Statistic",
    "TargetRecord",
    "acceptance_rate",
    "acceptance_threshold",
    "build_report",
    "combine_answers",
    "design_queries",
    "design_stats",
    "draw_design",
    "estimate_update",
    "harden",
    "joint_recovery",
    "predicted_error_trace",
    "single_estimate_budget",
    "stouffer",
    "summarize",
    "theorem4_bound",
    "upper_tail",
    "validate_parameters",
]
