"""FLDetector (Zhang et al., KDD'22), written from the paper's algorithm.

The server predicts each client's update from its previous one with a Hessian-vector product,
``g_hat_i^t = g_i^{t-1} + H^t (w^t - w^{t-1})``, where ``H^t`` is the L-BFGS approximation
built from the last ``window`` pairs of global-model differences ``s_j = w^j - w^{j-1}`` and
global-update differences ``y_j = g^j - g^{j-1}``. A client's suspicious score is its mean
normalised prediction error ``||g_hat_i - g_i|| / sum_k ||g_hat_k - g_k||`` over the window; the
gap statistic decides whether the scores form more than one cluster and, if so, k-means with
k = 2 names the cluster with the larger mean score.

In fedattr the "gradients" are the clients' LoRA updates in the strategy's update space (what
FedIT averages, or FLoRA's merged deltas) and ``w`` moves by the aggregated update each round.
FLDetector reads every client's plaintext update: it does not respect secure aggregation.
With T rounds it makes at most T - 2 predictions (a pair needs two global updates, a
prediction needs the client's previous update), 3 at the paper's T = 5.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np


def lbfgs_hvp(S: Sequence[np.ndarray], Y: Sequence[np.ndarray], v: np.ndarray) -> np.ndarray:
    """``B v`` for the L-BFGS (compact representation) Hessian approximation ``B``.

    ``B = sigma I - [sigma S, Y] [[sigma S^T S, L], [L^T, -D]]^{-1} [sigma S^T; Y^T]`` with
    ``sigma = y_m^T s_m / s_m^T s_m`` (last pair), ``D = diag(S^T Y)`` and ``L`` the strictly
    lower triangle of ``S^T Y`` (Byrd, Nocedal and Schnabel 1994). ``B`` equals ``m`` BFGS
    updates of ``sigma I`` with the pairs in order, and is never formed.
    """
    if not S or len(S) != len(Y):
        raise ValueError("lbfgs_hvp: need one or more (s, y) pairs of equal count")
    Sm = np.stack([np.asarray(s, dtype=np.float64) for s in S], axis=1)
    Ym = np.stack([np.asarray(y, dtype=np.float64) for y in Y], axis=1)
    v = np.asarray(v, dtype=np.float64)
    sty = Sm.T @ Ym
    sigma = float(Ym[:, -1] @ Sm[:, -1]) / float(Sm[:, -1] @ Sm[:, -1])
    lower = np.tril(sty, k=-1)
    middle = np.block([[sigma * (Sm.T @ Sm), lower], [lower.T, -np.diag(np.diag(sty))]])
    rhs = np.concatenate([sigma * (Sm.T @ v), Ym.T @ v])
    return sigma * v - np.hstack([sigma * Sm, Ym]) @ np.linalg.solve(middle, rhs)


def _dispersion(x: np.ndarray, k: int, seed: int) -> float:
    from sklearn.cluster import KMeans

    km = KMeans(n_clusters=k, n_init=10, random_state=seed).fit(x)
    return float(np.linalg.norm(x - km.cluster_centers_[km.labels_], axis=1).sum())


def gap_statistic(values: np.ndarray, k_max: int = 10, refs: int = 20, seed: int = 0) -> int:
    """Number of clusters by the gap statistic (Tibshirani et al. 2001).

    Data are min-max scaled; reference sets are uniform on the unit box; the answer is the
    smallest ``k`` with ``Gap(k) >= Gap(k+1) - s_{k+1}`` (FLDetector's rule).
    """
    x = np.asarray(values, dtype=np.float64).reshape(len(values), -1)
    span = x.max(0) - x.min(0)
    if len(x) < 3 or not np.any(span > 0):
        return 1
    x = (x - x.min(0)) / np.where(span > 0, span, 1.0)
    rng = np.random.default_rng(seed)
    k_max = min(k_max, len(x) - 1)
    gaps, sds = [], []
    for k in range(1, k_max + 1):
        logs = [np.log(_dispersion(rng.uniform(size=x.shape), k, seed)) for _ in range(refs)]
        gaps.append(float(np.mean(logs)) - np.log(max(_dispersion(x, k, seed), 1e-300)))
        sds.append(float(np.std(logs)) * np.sqrt(1 + 1 / refs))
    for k in range(1, k_max):
        if gaps[k - 1] >= gaps[k] - sds[k]:
            return k
    return k_max


@dataclass
class FLDetector:
    """Online FLDetector: feed it each round, read :meth:`result` at the end."""

    window: int = 5
    seed: int = 0
    S: list[np.ndarray] = field(default_factory=list)
    Y: list[np.ndarray] = field(default_factory=list)
    last_update: dict[int, np.ndarray] = field(default_factory=dict)
    last_global: np.ndarray | None = None
    last_step: np.ndarray | None = None
    distances: dict[int, list[float]] = field(default_factory=dict)

    def observe_round(self, updates: Mapping[int, np.ndarray], global_update: np.ndarray) -> None:
        """One round: the clients' updates (computed at ``w^t``) and their aggregate.

        The model moves by ``global_update``: ``w^{t+1} - w^t = global_update``.
        """
        if self.S and self.last_step is not None:
            hv = lbfgs_hvp(self.S, self.Y, self.last_step)
            known = [c for c in sorted(updates) if c in self.last_update]
            err = {c: float(np.linalg.norm(self.last_update[c] + hv - updates[c])) for c in known}
            total = sum(err.values())
            for c, e in err.items():
                self.distances.setdefault(c, []).append(e / total if total > 0 else 0.0)
        g = np.asarray(global_update, dtype=np.float64)
        if self.last_global is not None and self.last_step is not None:
            self.S = [*self.S, self.last_step][-self.window :]
            self.Y = [*self.Y, g - self.last_global][-self.window :]
        self.last_global, self.last_step = g, g
        self.last_update = {c: np.asarray(u, dtype=np.float64) for c, u in updates.items()}

    def scores(self) -> dict[int, float]:
        """Suspicious score per client: mean normalised distance over the last window."""
        return {c: float(np.mean(d[-self.window :])) for c, d in sorted(self.distances.items())}

    def result(self) -> tuple[list[int], dict[int, float], int]:
        """``(flagged clients, suspicious scores, clusters found by the gap statistic)``."""
        scores = self.scores()
        if len(scores) < 3:
            return [], scores, 1
        ids = list(scores)
        x = np.array([scores[c] for c in ids]).reshape(-1, 1)
        k = gap_statistic(x, seed=self.seed)
        if k <= 1:
            return [], scores, k
        from sklearn.cluster import KMeans

        labels = KMeans(n_clusters=2, n_init=10, random_state=self.seed).fit(x).labels_
        means = [x[labels == j].mean() for j in (0, 1)]
        bad = int(np.argmax(means))
        return [c for c, lab in zip(ids, labels, strict=True) if lab == bad], scores, k
