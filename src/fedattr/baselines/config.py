"""The ``[fldetector]`` and ``[flforensics]`` sections: the baselines' settings, at the
originals' defaults (the authors' code; README *Reproducing the paper* says what they leave at
the paper's T = 5)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FLDetectorConfig:
    """FLDetector (Zhang et al., KDD'22; official code ``zaixizhang/FLDetector``)."""

    window: int = 10
    """L-BFGS (s, y) pairs kept, and rounds of normalised distances summed into the suspicious
    score; detection needs this many scored rounds (the original: 10 and 10)."""
    warmup: int = 50
    """Rounds (0-based index <= warmup) before any prediction is scored (the original: 50 for
    MNIST/FEMNIST, 20 for CIFAR). 0 with a small ``window`` adapts it to a few rounds."""
    k_max: int = 7
    """The gap statistic's largest k (the original: 1..7)."""
    references: int = 10
    """Uniform reference sets of the gap statistic (the original: 10)."""
    adapted_window: int = 3
    """The adaptation reported beside it (``FLDetector (adapted)``): no warm-up and this
    window (3 = T - 2, every prediction a five-round run allows)."""

    def __post_init__(self) -> None:
        if self.adapted_window < 1:
            raise ValueError(f"fldetector.adapted_window: must be >= 1, got {self.adapted_window}")
        if self.window < 1 or self.warmup < 0 or self.k_max < 2 or self.references < 2:
            raise ValueError(
                "fldetector: window >= 1, warmup >= 0, k_max >= 2 and references >= 2 "
                f"(got {self.window}, {self.warmup}, {self.k_max}, {self.references})"
            )


@dataclass
class FLForensicsConfig:
    """FLForensics (Jia et al.; official code ``jyqhahah/FLForensics``)."""

    min_cluster_size: int = 7
    """HDBSCAN's ``min_cluster_size`` (the original: 7; capped at the number of clients)."""
    min_samples: int = 1
    """HDBSCAN's ``min_samples`` (the original: 1)."""
    references: int = 5
    """Benign references the second feature is measured on; a client is named only when it is
    named under every one (the original: 5, unanimous)."""

    def __post_init__(self) -> None:
        if self.min_cluster_size < 2 or self.min_samples < 1 or self.references < 1:
            raise ValueError(
                "flforensics: min_cluster_size >= 2, min_samples >= 1, references >= 1 (got "
                f"{self.min_cluster_size}, {self.min_samples}, {self.references})"
            )
