"""A synthetic federation on plain vectors: the protocol's test bed without a language model.

Model: parameters ``w`` in R^dim, watermark detector ``Score(w) = <s, w>`` for a secret unit
vector ``s``. In round t client j's update is

    Delta_j^t = drift * g_t + common * c_t + heterogeneity * h_j + noise * xi_j^t
                + signal * v_j^t * 1[j watermarked] * s

with ``g_t`` a shared learning direction orthogonal to ``s`` (what all clients learn from the
task), ``xi_j^t ~ N(0, I)`` (client-specific; its component along ``s`` is N(0, 1), so
``noise`` and ``signal`` are in score units), and two terms that make the bed fail like a real
model (both 0 by default): ``c_t ~ N(0, I)``, a shared direction NOT orthogonal to ``s`` (its
projection on the detection key is one random draw per round, the same for every client, as
the round's common learning direction is on a real model), and ``h_j ~ N(0, I)``, a persistent
per-client direction (heterogeneous data: the same every round, so Stouffer accumulates its
projection). ``v_j^t`` is 1 unless ``signal_cv`` > 0: then a Gamma draw of mean 1 and that
coefficient of variation per watermarked client and round, as a real client's key-aligned
change varies from round to round (what hardened mode's de-mixing across rounds cannot cancel).
The pool submits every update to secure aggregation only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..config import check_client_ids
from ..secagg.aggregator import SecureAggregator
from .pool import ClientPool
from .progress import Progress
from .timing import Stopwatch


@dataclass
class SyntheticConfig:
    """The synthetic federation (the ``[synthetic]`` section of ``demo-protocol``)."""

    K: int = 10
    """Number of clients (all take part every round)."""
    rounds: int = 5
    """FL rounds T."""
    r: int = 3
    """Watermarked clients, drawn by seed (ignored when ``watermarked`` is given)."""
    watermarked: list[int] | None = None
    """Explicit watermarked client ids (0..K-1)."""
    dim: int = 4096
    """Dimension of each update."""
    signal: float = 3.0
    """Watermark component per round along s, in score units."""
    signal_cv: float = 0.0
    """Coefficient of variation of each watermarked client's per-round signal (0: the same
    ``signal`` every round; > 0: ``signal`` times a Gamma draw of mean 1 per client and round)."""
    noise: float = 0.25
    """Client-specific noise scale (its component along s has this standard deviation)."""
    drift: float = 1.0
    """Scale of the shared learning direction, orthogonal to s."""
    common: float = 0.0
    """Scale of a shared per-round direction with a random projection on s (score units)."""
    heterogeneity: float = 0.0
    """Scale of each client's persistent direction (score units along any unit vector)."""
    seed: int = 0
    """Seed of the federation (updates, watermark direction, watermarked clients)."""

    def __post_init__(self) -> None:
        if self.K < 3:
            raise ValueError(f"synthetic.K: must be >= 3, got {self.K}")
        if self.rounds < 1:
            raise ValueError(f"synthetic.rounds: must be >= 1, got {self.rounds}")
        if self.dim < 2:
            raise ValueError(f"synthetic.dim: must be >= 2, got {self.dim}")
        if self.watermarked is None and not 0 <= self.r <= self.K:
            raise ValueError(f"synthetic.r: must be in 0..K={self.K}, got {self.r}")
        if self.watermarked is not None:
            check_client_ids(self.watermarked, self.K, "synthetic.watermarked")
        for name in ("signal", "signal_cv", "noise", "drift", "common", "heterogeneity"):
            if not np.isfinite(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"synthetic.{name}: must be a finite number >= 0")

    def watermarked_ids(self) -> list[int]:
        """The watermarked clients."""
        if self.watermarked is not None:
            return sorted(self.watermarked)
        rng = np.random.default_rng([self.seed, 1])
        return sorted(int(c) for c in rng.choice(self.K, self.r, replace=False))


class SyntheticPool(ClientPool):
    """The synthetic clients; ``direction`` is the secret ``s`` (for a linear scorer)."""

    def __init__(self, config: SyntheticConfig) -> None:
        self.config = config
        self.watermarked = set(config.watermarked_ids())
        gen = torch.Generator().manual_seed(config.seed)
        s = torch.randn(config.dim, generator=gen, dtype=torch.float64)
        self.direction = s / s.norm()

    @property
    def num_clients(self) -> int:
        return self.config.K

    def data_sizes(self) -> list[int]:
        return [1] * self.config.K  # equal weights: every client submits its raw update

    def initial_params(self) -> torch.Tensor:
        """``w^0 = 0``."""
        return torch.zeros(self.config.dim, dtype=torch.float32)

    def updates(self, round_id: int) -> dict[int, torch.Tensor]:
        """Every client's update of round ``round_id`` (deterministic in the seed)."""
        cfg, s = self.config, self.direction
        seed = int(np.random.default_rng([cfg.seed, 2, round_id]).integers(2**62))
        gen = torch.Generator().manual_seed(seed)
        g = torch.randn(cfg.dim, generator=gen, dtype=torch.float64)
        g -= torch.dot(g, s) * s  # the shared direction carries no watermark
        out = {}
        strength = self._strengths(round_id)
        for j in range(cfg.K):
            xi = torch.randn(cfg.dim, generator=gen, dtype=torch.float64)
            delta = cfg.drift * g + cfg.noise * xi
            if j in self.watermarked:
                delta = delta + cfg.signal * strength[j] * s
            out[j] = delta
        if cfg.common:
            c = torch.Generator().manual_seed(self._seed(4, round_id))
            delta_c = cfg.common * torch.randn(cfg.dim, generator=c, dtype=torch.float64)
            out = {j: d + delta_c for j, d in out.items()}
        if cfg.heterogeneity:
            for j in out:
                h = torch.Generator().manual_seed(self._seed(3, j))
                out[j] = out[j] + cfg.heterogeneity * torch.randn(
                    cfg.dim, generator=h, dtype=torch.float64
                )
        return {j: d.to(torch.float32) for j, d in out.items()}

    def _strengths(self, round_id: int) -> np.ndarray:
        """Each client's signal multiplier in round ``round_id``: ones, or Gamma draws of mean
        1 and coefficient of variation ``signal_cv`` (a stream of their own, so the rest of
        the federation is the same whatever ``signal_cv``)."""
        cfg = self.config
        if not cfg.signal_cv:
            return np.ones(cfg.K)
        shape = 1.0 / cfg.signal_cv**2
        rng = np.random.default_rng([cfg.seed, 5, round_id])
        return rng.gamma(shape, 1.0 / shape, size=cfg.K)

    def _seed(self, *stream: int) -> int:
        return int(np.random.default_rng([self.config.seed, *stream]).integers(2**62))

    def train_round(
        self,
        round_id: int,
        participants: Sequence[int],
        state: Any,
        sa: SecureAggregator,
        scales: dict[int, float],
        progress: Progress,
        timing: Stopwatch | None = None,
    ) -> dict[int, float]:
        updates = self.updates(round_id)
        for j in participants:
            sa.submit(j, self.scaled(updates[j], scales[j]))
        return {}

    @staticmethod
    def scaled(update: torch.Tensor, scale: float) -> torch.Tensor:
        """What a synthetic client submits (unscaled at weight 1, to keep it exact)."""
        return update * scale if scale != 1.0 else update
