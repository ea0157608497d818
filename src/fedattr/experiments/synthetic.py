"""A synthetic end-to-end FedAttr run on plain vectors with a linear scorer.

Model: parameters ``w`` in R^dim, watermark detector ``Score(w) = <s, w>`` for a secret unit
vector ``s``. In round t client j's update is

    Delta_j^t = drift * g_t + noise * xi_j^t + signal * 1[j watermarked] * s

with ``g_t`` a shared learning direction orthogonal to ``s`` (what all clients learn from the
task) and ``xi_j^t ~ N(0, I)`` (client-specific; its component along ``s`` is N(0, 1), so
``noise`` and ``signal`` are in score units). Every update goes only through the configured SA
backend; the server aggregates FedAvg-style from the SA sum over all clients and runs FedAttr on
each round against ``w^{t-1}``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..attribution.design import DesignError
from ..attribution.protocol import AttributionConfig, FedAttr, TargetRecord
from ..attribution.scoring import LinearScorer
from ..attribution.stouffer import AttributionReport
from ..config import check_client_ids, to_dict
from ..reporting.run_folder import write_run_folder
from ..secagg import SecAggConfig, make_aggregator
from .config import harden


@dataclass
class SyntheticConfig:
    """The synthetic federation."""

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
    noise: float = 0.25
    """Client-specific noise scale (its component along s has this standard deviation)."""
    drift: float = 1.0
    """Scale of the shared learning direction, orthogonal to s."""
    seed: int = 0
    """Seed of the federation (updates, watermark direction, watermarked clients)."""

    def __post_init__(self) -> None:
        if self.K < 3:
            raise DesignError(f"synthetic.K: must be >= 3, got {self.K}")
        if self.rounds < 1:
            raise DesignError(f"synthetic.rounds: must be >= 1, got {self.rounds}")
        if self.dim < 2:
            raise DesignError(f"synthetic.dim: must be >= 2, got {self.dim}")
        if self.watermarked is None and not 0 <= self.r <= self.K:
            raise DesignError(f"synthetic.r: must be in 0..K={self.K}, got {self.r}")
        if self.watermarked is not None:
            check_client_ids(self.watermarked, self.K, "synthetic.watermarked")
        for name in ("signal", "noise", "drift"):
            if not np.isfinite(getattr(self, name)) or getattr(self, name) < 0:
                raise DesignError(f"synthetic.{name}: must be a finite number >= 0")

    def watermarked_ids(self) -> list[int]:
        """The watermarked clients."""
        if self.watermarked is not None:
            return sorted(self.watermarked)
        rng = np.random.default_rng([self.seed, 1])
        return sorted(int(c) for c in rng.choice(self.K, self.r, replace=False))


@dataclass
class DemoConfig:
    """Configuration of ``fedattr demo-protocol``."""

    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    secagg: SecAggConfig = field(default_factory=SecAggConfig)
    attribution: AttributionConfig = field(default_factory=AttributionConfig)

    def __post_init__(self) -> None:
        harden(self.attribution, self.secagg, self.synthetic.K)


@dataclass
class DemoResult:
    """The report plus run records and timings."""

    config: DemoConfig
    report: AttributionReport
    rounds: list[dict]
    sa_queries: int
    timing: dict[str, float]
    queries: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-ready form (the layout of a run's results.json)."""
        out = self.report.to_dict()
        out.update(
            mode=self.config.attribution.mode,
            sa_queries=self.sa_queries,
            sa_backend=self.config.secagg.backend,
            timing=self.timing,
            config=to_dict(self.config),
        )
        return out

    def write(self, out_dir: str | Path) -> Path:
        """Write config.json, rounds.jsonl, results.json, report.md and attribution.png."""
        report_md = (
            f"# FedAttr synthetic protocol run ({self.config.attribution.mode} mode)\n\n"
            f"SA backend: `{self.config.secagg.backend}`; {self.sa_queries} SA queries; "
            f"total {self.timing['total_s']:.2f} s (SA {self.timing['sa_s']:.2f} s).\n\n"
            + self.report.to_markdown()
        )
        return write_run_folder(
            out_dir,
            config=to_dict(self.config),
            rounds=self.rounds,
            queries=self.queries,
            results=self.to_dict(),
            report=self.report,
            report_md=report_md,
        )


def _updates(
    cfg: SyntheticConfig, s: torch.Tensor, t: int, wm: set[int]
) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(
        int(np.random.default_rng([cfg.seed, 2, t]).integers(2**62))
    )
    g = torch.randn(cfg.dim, generator=gen, dtype=torch.float64)
    g -= torch.dot(g, s) * s  # the shared direction carries no watermark
    out = {}
    for j in range(cfg.K):
        xi = torch.randn(cfg.dim, generator=gen, dtype=torch.float64)
        delta = cfg.drift * g + cfg.noise * xi
        if j in wm:
            delta = delta + cfg.signal * s
        out[j] = delta.to(torch.float32)
    return out


def run_demo(
    config: DemoConfig | None = None,
    progress: Callable[[str], None] | None = None,
) -> DemoResult:
    """Run the synthetic federation through SA and FedAttr; return the report and records."""
    cfg = config or DemoConfig()
    syn = cfg.synthetic
    say = progress or (lambda msg: print(msg, file=sys.stderr))
    wm = set(syn.watermarked_ids())
    gen = torch.Generator().manual_seed(syn.seed)
    s = torch.randn(syn.dim, generator=gen, dtype=torch.float64)
    s /= s.norm()
    scorer = LinearScorer(s)
    sa = make_aggregator(cfg.secagg)
    fedattr = FedAttr(cfg.attribution)
    w = torch.zeros(syn.dim, dtype=torch.float32)
    clients = list(range(syn.K))
    start = time.perf_counter()
    timing = {"train_s": 0.0, "sa_s": 0.0, "scoring_s": 0.0}
    records = []

    def on_target(rec: TargetRecord) -> None:
        timing["sa_s"] += rec.sa_seconds
        timing["scoring_s"] += rec.score_seconds

    for t in range(1, syn.rounds + 1):
        t0 = time.perf_counter()
        updates = _updates(syn, s, t, wm)
        timing["train_s"] += time.perf_counter() - t0
        sa.open_round(t, clients)
        for j, delta in updates.items():
            sa.submit(j, delta)
        # The round's aggregate first: training needs it whatever the release policy admits.
        t0 = time.perf_counter()
        total, answered = sa.sum_of_available(clients)
        aggregate = total / len(answered)  # FedAvg from the SA aggregate only
        timing["sa_s"] += time.perf_counter() - t0
        record = fedattr.attribute_round(t, sa, w, scorer, on_target=on_target)
        w = w + aggregate
        sa.close_round()
        records.append(record.to_dict())
        zs = " ".join(f"{r.target}:{r.z['score']:+.1f}" for r in record.targets)
        say(f"[round {t}/{syn.rounds}] differential scores {zs}")
    timing["total_s"] = time.perf_counter() - start
    truth = {j: j in wm for j in clients}
    queries = [q.to_dict() for q in sa.log]
    return DemoResult(cfg, fedattr.report(truth), records, len(sa.log), timing, queries)
