"""What the baselines need from the FL loop, recorded round by round, and their results.

The loop hands the recorder each round's *plaintext* client updates. FedAttr never sees them
(it only queries secure aggregation); every baseline fed from here except the global-model test
reads them, so each such baseline is marked as violating SA in every table.

* Global-model test: the detector on the final global model against the base model (which
  never saw any watermarked document): detects presence, names nobody.
* Direct (oracle): ``Score(w^{t-1} + Delta_i)`` against the same base model, with no reference
  subtraction, Stouffer over rounds, the same gamma as FedAttr.
* FLDetector and FLForensics (as published, and the FedAttr paper's k-means adaptation): see
  their modules.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..attribution.contract import CalibratedContrast, KeyStatisticScorer, ProbeScorer
from ..attribution.scoring import as_statistics, is_paired
from ..attribution.stouffer import build_report, combine_reports, empirical_null, upper_tail
from ..updates import Update, UpdateLayout, scale_update
from .config import FLDetectorConfig, FLForensicsConfig
from .fldetector import FLDetector
from .flforensics import cluster_kmeans, trace


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
        null: str = "theoretical",
        fldetector: FLDetectorConfig | None = None,
        flforensics: FLForensicsConfig | None = None,
    ) -> None:
        if not isinstance(probe, ProbeScorer):
            raise ValueError("BaselineRecorder: the probe scorer needs probe_values()")
        self.scorer, self.probe, self.apply = scorer, probe, apply
        self.gamma, self.seed, self.null = gamma, seed, null
        self.paired = is_paired(scorer)
        # The base model (before round 1) is the null for the absolute tests.
        self._null = scorer.observe(null_params) if self.paired else None
        self.direct: dict[str, dict[int, dict[int, float]]] = {}
        self.influence: dict[int, np.ndarray] = {}
        fd = fldetector or FLDetectorConfig()
        self.fldetector = FLDetector(fd.window, fd.warmup, fd.k_max, fd.references, seed=seed)
        self.fldetector_adapted = FLDetector(
            fd.adapted_window, 0, fd.k_max, fd.references, seed=seed
        )
        self.forensics_config = flforensics or FLForensicsConfig()
        self.forensics: dict[str, dict[int, np.ndarray]] = {}
        """Owner -> client -> [target influence, influence on each reference], summed."""
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
        base_obs = self.probe.observe(reference)
        base = self.probe.probe_values(base_obs)
        self._forensics_round(reference, base_obs, updates)
        for c in sorted(updates):
            candidate = self.apply(reference, updates[c])
            stats, obs = self.absolute(candidate)
            for name, z in stats.items():
                self.direct.setdefault(name, {}).setdefault(c, {})[round_id] = z
            change = self._probe_values(candidate, obs) - base
            self.influence[c] = self.influence.get(c, 0.0) + change
        # The SA layout's flattening: one float64 vector per update, each checked against it.
        layout = UpdateLayout.of(mean_update)
        flat = {c: layout.flatten(u) for c, u in updates.items()}
        for detector in (self.fldetector, self.fldetector_adapted):
            detector.observe_round(flat, layout.flatten(mean_update))

    def _forensics_round(
        self, reference: Any, base_obs: Any, updates: Mapping[int, Update]
    ) -> None:
        """FLForensics' features for one round: each client's update normalised to one common
        length (the round's median update norm), the owner's statistic and the references'
        (random keys, or decoys) moved by it."""
        if not updates or not isinstance(self.probe, KeyStatisticScorer):
            return
        norms = {
            c: float(np.linalg.norm(UpdateLayout.of(u).flatten(u))) for c, u in updates.items()
        }
        step = float(np.median(list(norms.values())))
        for c in sorted(updates):
            if norms[c] <= 0:
                continue
            moved = self.apply(reference, scale_update(updates[c], step / norms[c]))
            refs = self.forensics_config.references
            stats = self.probe.key_statistics(base_obs, self.probe.observe(moved), refs, self.seed)
            for owner, (value, refs) in stats.items():
                row = np.array([value, *np.asarray(refs, dtype=np.float64)])
                per = self.forensics.setdefault(owner, {})
                per[c] = per.get(c, 0.0) + row

    def global_test(self, final_params: Any) -> dict[str, float]:
        """The detector on the final global model (stored for :meth:`results`); a scorer
        whose statistic needs an empirical null is asked for its calibrated test instead."""
        if self.paired and isinstance(self.scorer, CalibratedContrast):
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
            "forensics": self.forensics,
            "fldetector": self.fldetector,
            "fldetector_adapted": self.fldetector_adapted,
            "global_z": self.global_z,
        }

    def load(self, state: Mapping) -> None:
        """Restore :meth:`state`."""
        self.direct = state["direct"]
        self.influence = state["influence"]
        self.forensics = state.get("forensics", {})
        self.fldetector = state["fldetector"]
        self.fldetector_adapted = state.get("fldetector_adapted", self.fldetector_adapted)
        self.global_z = state["global_z"]

    def results(self, truth: Mapping[int, bool]) -> list[BaselineResult]:
        """Every baseline's verdict given the ground truth."""
        out = []
        if self.global_z:
            best = max(self.global_z.values())
            p = min(1.0, len(self.global_z) * upper_tail(best)[0])
            out.append(
                BaselineResult(
                    "Global model",
                    True,
                    None,
                    p=p,
                    detail={"z": self.global_z, "detected": best > self.gamma},
                )
            )
        if self.direct:
            # The same null as FedAttr's, so that both read their scores alike.
            norm = empirical_null if self.null == "empirical" else dict
            reports = [
                build_report(norm(self.direct[name]), self.gamma, truth, statistic=name)
                for name in sorted(self.direct)
            ]
            rep = reports[0] if len(reports) == 1 else combine_reports(reports)
            ps = [c.p for c in rep.clients if c.watermarked]
            out.append(
                BaselineResult(
                    "Direct (oracle)",
                    False,
                    rep.flagged,
                    rep.tpr,
                    rep.fpr,
                    statistics.median(ps) if ps else None,
                    detail={
                        "Z": {str(c.id): c.Z for c in rep.clients},
                        "z": {
                            n: {str(c): {str(t): v for t, v in r.items()} for c, r in per.items()}
                            for n, per in self.direct.items()
                        },
                    },
                )
            )
        for name, detector in (
            ("FLDetector", self.fldetector),
            ("FLDetector (adapted)", self.fldetector_adapted),
        ):
            flagged, scores, k, why = detector.result()
            tpr, fpr = (None, None) if why else _rates(flagged, truth)
            out.append(
                BaselineResult(
                    name,
                    False,
                    None if why else flagged,
                    tpr,
                    fpr,
                    detail={
                        "suspicious": {str(c): v for c, v in scores.items()},
                        "gap_k": k,
                        "no_prediction": why,
                        "warmup": detector.warmup,
                        "window": detector.window,
                    },
                )
            )
        if self.forensics:
            cfg, flagged = self.forensics_config, set()
            for per in self.forensics.values():
                flagged |= set(
                    trace(
                        {c: float(v[0]) for c, v in per.items()},
                        {c: v[1:] for c, v in per.items()},
                        cfg.min_cluster_size,
                        cfg.min_samples,
                    )
                )
            named = sorted(flagged)
            out.append(
                BaselineResult(
                    "FLForensics",
                    False,
                    named,
                    *_rates(named, truth),
                    detail={
                        "features": {
                            o: {str(c): v.tolist() for c, v in per.items()}
                            for o, per in self.forensics.items()
                        }
                    },
                )
            )
        if self.influence:
            flagged, k = cluster_kmeans(self.influence, seed=self.seed)
            totals = {str(c): float(np.sum(v)) for c, v in sorted(self.influence.items())}
            out.append(
                BaselineResult(
                    "FLForensics (k-means)",
                    False,
                    flagged,
                    *_rates(flagged, truth),
                    detail={"k": k, "total_influence": totals},
                )
            )
        return out
