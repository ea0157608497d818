"""Baselines that FedAttr is compared with, all fed from the same training run.

Every baseline except the global-model test reads plaintext client updates and therefore does
not respect secure aggregation; tables mark this in their SA column.
"""

from .fldetector import FLDetector, gap_statistic, lbfgs_hvp
from .flforensics import cluster_kmeans, trace
from .recorder import BaselineRecorder, BaselineResult

__all__ = [
    "BaselineRecorder",
    "BaselineResult",
    "FLDetector",
    "cluster_kmeans",
    "gap_statistic",
    "lbfgs_hvp",
    "trace",
]
