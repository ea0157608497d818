"""What the baselines need from the FL loop, recorded round by round, and their results.

The loop hands the recorder each round's *plaintext* client updates. FedAttr never sees them
(it only queries secure aggregation); every baseline fed from here except the global-model test
reads them, so each such baseline is marked as violating SA in every table.

* Global-model test: the detector on the final global model against the base model (which
  never saw any watermarked document): detects presence, names nobody.
* Direct (oracle): ``Score(w^{t-1} + Delta_i)`` against the same base model, with no reference
  subtraction, Stouffer over rounds, the same gamma as FedAttr.
* FLDetector and FLForensics (HDBSCAN, k-means): see their modules.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..attribution.scoring import as_statistics, is_paired
from ..attribution.stouffer import build_report, combine_reports, empirical_null, upper_tail
from ..updates import Update, UpdateLayout
from .fldetector import FLDetector
from .flforensics import cluster_hdbscan, cluster_kmeans


@dataclass
class BaselineResult:
    """One baseline's verdict on one run."""

    name: str
    respects_sa: bool
    flagged: list[int] | None
    """Named clients (``None`` for a test that names nobody)."""
    tpr: float | None = None
    fpr: float | None = None
    p: float | None = None
    """Median p-value over the watermarked clients (Direct), or the test's p (global)."""
    detail: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {
            "name": self.name,
            "respects_sa": self.respects_sa,
            "flagged": self.flagged,
            "tpr": self.tpr,
            "fpr": self.fpr,
            "p": self.p,
            **self.detail,
        }


def _rates(flagged: list[int], truth: Mapping[int, bool]) -> tuple[float | None, float | None]:
    wm = [c for c, w in truth.items() if w]
    clean = [c for c, w in truth.items() if not w]
    tpr = sum(c in flagged for c in wm) / len(wm) if wm else None
    fpr = sum(c in flagged for c in clean) / len(clean) if clean else None
    return tpr, fpr


class BaselineRecorder:
    """Feeds Direct, FLDetector and FLForensics from the loop; runs the global-model test."""

    def __init__(
        self,
        scorer: Any,
        probe: Any,
        apply: Callable[[Any, Update], Any],
        null_params: Any,
        *,
        gamma: float = 4.0,
        seed: int = 0,
        window: int = 5,
        null: str = "theoretical",
    ) -> None:
        if not callable(getattr(probe, "probe_values", None)):
            raise ValueError("BaselineRecorder: the probe scorer needs probe_values()")
        self.scorer, self.probe, self.apply = scorer, probe, apply
        self.gamma, self.seed, self.null = gamma, seed, null
        self.paired = is_paired(scorer)
        # The base model (before round 1) is the null for the absolute tests.
        self._null = scorer.observe(null_params) if self.paired else None
        self.direct: dict[str, dict[int, dict[int, float]]] = {}
        self.influence: dict[int, np.ndarray] = {}
        self.fldetector = FLDetector(window=window, seed=seed)
        self.global_z: dict[str, float] = {}

    def absolute(self, params: Any) -> tuple[dict[str, float], Any]:
        """The detector's statistics for ``params`` against the base model, and the
        observation (for plain scorers: ``None``)."""
        if self.paired:
            obs = self.scorer.observe(params)
            return as_statistics(self.scorer.contrast(self._null, obs)), obs
        return as_statistics(self.scorer(params)), None

    def _probe_values(self, params: Any, obs: Any) -> np.ndarray:
        if self.probe is self.scorer and obs is not None:
            return self.probe.probe_values(obs)
        return self.probe.probe_values(self.probe.observe(params))

    def record_round(
        self, round_id: int, reference: Any, updates: Mapping[int, Update], mean_update: Update
    ) -> None:
        """One round: the plaintext client updates and the aggregate the model moved by."""
        base = self.probe.probe_values(self.probe.observe(reference))
        for c in sorted(updates):
            candidate = self.apply(reference, updates[c])
            stats, obs = self.absolute(candidate)
            for name, z in stats.items():
                self.direct.setdefault(name, {}).setdefault(c, {})[round_id] = z
            change = self._probe_values(candidate, obs) - base
            self.influence[c] = self.influence.get(c, 0.0) + change
        # The SA layout's flattening: one float64 vector per update, each checked against it.
        layout = UpdateLayout.of(mean_update)
        self.fldetector.observe_round(
            {c: layout.flatten(u) for c, u in updates.items()}, layout.flatten(mean_update)
        )

    def global_test(self, final_params: Any) -> dict[str, float]:
        """The detector on the final global model (stored for :meth:`results`); a scorer
        whose statistic needs an empirical null is asked for its calibrated test instead."""
        if self.paired and callable(getattr(self.scorer, "calibrated_contrast", None)):
            obs = self.scorer.observe(final_params)
            self.global_z = as_statistics(self.scorer.calibrated_contrast(self._null, obs))
        else:
            self.global_z, _ = self.absolute(final_params)
        return self.global_z

    def state(self) -> dict:
        """Everything recorded so far (for checkpoints)."""
        return {
            "direct": self.direct,
            "influence": self.influence,
            "fldetector": self.fldetector,
            "global_z": self.global_z,
        }

    def load(self, state: Mapping) -> None:
        """Restore :meth:`state`."""
        self.direct = state["direct"]
        self.influence = state["influence"]
        self.fldetector = state["fldetector"]
        self.global_z = state["global_z"]

    def results(self, truth: Mapping[int, bool]) -> list[BaselineResult]:
        """Every baseline's verdict given the ground truth."""
        out = []
        if self.global_z:
            best = max(self.global_z.values())
            p = min(1.0, len(self.global_z) * upper_tail(best)[0])
            out.append(BaselineResult(
                "Global model", True, None, p=p,
                detail={"z": self.global_z, "detected": best > self.gamma},
            ))  # fmt: skip
        if self.direct:
            # The same null as FedAttr's, so that both read their scores alike.
            norm = empirical_null if self.null == "empirical" else dict
            reports = [
                build_report(norm(self.direct[name]), self.gamma, truth, statistic=name)
                for name in sorted(self.direct)
            ]
            rep = reports[0] if len(reports) == 1 else combine_reports(reports)
            ps = [c.p for c in rep.clients if c.watermarked]
            out.append(BaselineResult(
                "Direct (oracle)", False, rep.flagged, rep.tpr, rep.fpr,
                statistics.median(ps) if ps else None,
                detail={
                    "Z": {str(c.id): c.Z for c in rep.clients},
                    "z": {n: {str(c): {str(t): v for t, v in r.items()} for c, r in per.items()}
                          for n, per in self.direct.items()},
                },
            ))  # fmt: skip
        flagged, scores, k = self.fldetector.result()
        out.append(BaselineResult(
            "FLDetector", False, flagged, *_rates(flagged, truth),
            detail={"suspicious": {str(c): v for c, v in scores.items()}, "gap_k": k},
        ))  # fmt: skip
        if self.influence:
            flagged = cluster_hdbscan(self.influence)
            out.append(
                BaselineResult("FLForensics (HDBSCAN)", False, flagged, *_rates(flagged, truth))
            )
            flagged, k = cluster_kmeans(self.influence, seed=self.seed)
            totals = {str(c): float(np.sum(v)) for c, v in sorted(self.influence.items())}
            out.append(BaselineResult(
                "FLForensics (k-means)", False, flagged, *_rates(flagged, truth),
                detail={"k": k, "total_influence": totals},
            ))  # fmt: skip
        return out
