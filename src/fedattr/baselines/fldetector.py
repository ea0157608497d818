"""FLDetector (Zhang et al., KDD'22), as the authors' code runs it (``zaixizhang/FLDetector``).

The server predicts each client's update from its previous one with a Hessian-vector product,
``g_hat_i^t = g_i^{t-1} + H^t (w^t - w^{t-1})``, where ``H^t`` is the L-BFGS approximation
built from the last ``window`` (10) pairs of global-model differences ``s_j = w^j - w^{j-1}``
and aggregated-update differences ``y_j = g^j - g^{j-1}``. Each round after the warm-up (the
original: rounds with 0-based index > 50; 20 on CIFAR) a client's distance
``||g_hat_i - g_i||`` is divided by the sum over clients; the suspicious score is the **sum**
of the last ``window`` rounds' normalised distances, and detection needs ``window`` of them.
The gap statistic (min-max scaled scores, k = 1..7, 10 uniform reference sets, dispersion
``W_k`` = k-means inertia, ``Gap(k) = log(mean W_k^ref) - log W_k``, ``sd_k = sqrt(1 + 1/B)
std(log W_k^ref)``, the smallest k with ``Gap(k) >= Gap(k+1) - sd_{k+1}``) decides whether the
scores form more than one cluster; if so, k-means with k = 2 on the raw scores names the
cluster with the larger mean.

In fedattr the "gradients" are the clients' LoRA updates in the strategy's update space and
``w`` moves by the aggregated update each round. At the paper's T = 5 the original settings
score no round (warm-up) and could not fill the window anyway (a prediction needs two earlier
rounds: at most T - 2 = 3): FLDetector makes no prediction, and says so. ``warmup = 0`` with
``window = 3`` adapts it to five rounds. It reads every client's plaintext update: it does not
respect secure aggregation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np


def lbfgs_hvp(S: Sequence[np.ndarray], Y: Sequence[np.ndarray], v: np.ndarray) -> np.ndarray:
    """``B v`` for the L-BFGS (compact representation) Hessian approximation ``B``.

    ``B = sigma I - [sigma S, Y] [[sigma S^T S, L], [L^T, -D]]^{-1} [sigma S^T; Y^T]`` with
    ``sigma = y_m^T s_m / s_m^T s_m`` (last pair), ``D = diag(S^T Y)`` and ``L`` the strictly
    lower triangle of ``S^T Y`` (Byrd, Nocedal and Schnabel 1994; the original's ``lbfgs``).
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


def _inertia(x: np.ndarray, k: int, seed: int) -> float:
    from sklearn.cluster import KMeans

    return float(KMeans(n_clusters=k, n_init=10, random_state=seed).fit(x).inertia_)


def gap_statistic(values: np.ndarray, k_max: int = 7, refs: int = 10, seed: int = 0) -> int:
    """Number of clusters by the original's gap statistic (see the module docstring); 1 when
    the scores do not vary. Where the original's rule finds no k it fails; here: ``k_max``."""
    x = np.asarray(values, dtype=np.float64).reshape(len(values), -1)
    span = x.max(0) - x.min(0)
    if len(x) < 3 or not np.any(span > 0):
        return 1
    x = (x - x.min(0)) / np.where(span > 0, span, 1.0)
    rng = np.random.default_rng(seed)
    k_max = min(k_max, len(x) - 1)
    gaps, sds = [], []
    for k in range(1, k_max + 1):
        ref = np.array([_inertia(rng.uniform(size=x.shape), k, seed) for _ in range(refs)])
        ref = np.maximum(ref, 1e-300)
        gaps.append(float(np.log(ref.mean())) - np.log(max(_inertia(x, k, seed), 1e-300)))
        sds.append(float(np.sqrt(1 + 1 / refs) * np.std(np.log(ref))))
    for k in range(1, k_max):
        if gaps[k - 1] - gaps[k] + sds[k] >= 0:
            return k
    return k_max


@dataclass
class FLDetector:
    """Online FLDetector: feed it each round, read :meth:`result` at the end."""

    window: int = 10
    warmup: int = 50
    k_max: int = 7
    references: int = 10
    seed: int = 0
    S: list[np.ndarray] = field(default_factory=list)
    Y: list[np.ndarray] = field(default_factory=list)
    last_update: dict[int, np.ndarray] = field(default_factory=dict)
    last_global: np.ndarray | None = None
    last_step: np.ndarray | None = None
    rounds: int = 0
    rows: list[dict[int, float]] = field(default_factory=list)
    """Normalised distances of every scored round."""

    def observe_round(self, updates: Mapping[int, np.ndarray], global_update: np.ndarray) -> None:
        """One round: the clients' updates (computed at ``w^t``) and their aggregate.

        The model moves by ``global_update``: ``w^{t+1} - w^t = global_update``.
        """
        index, self.rounds = self.rounds, self.rounds + 1  # the original's 0-based epoch
        if index > self.warmup and self.S and self.last_step is not None:
            hv = lbfgs_hvp(self.S, self.Y, self.last_step)
            known = [c for c in sorted(updates) if c in self.last_update]
            err = {c: float(np.linalg.norm(self.last_update[c] + hv - updates[c])) for c in known}
            total = sum(err.values())
            if total > 0:
                self.rows.append({c: e / total for c, e in err.items()})
        g = np.asarray(global_update, dtype=np.float64)
        if self.last_global is not None and self.last_step is not None:
            self.S = [*self.S, self.last_step][-self.window :]
            self.Y = [*self.Y, g - self.last_global][-self.window :]
        self.last_global, self.last_step = g, g
        self.last_update = {c: np.asarray(u, dtype=np.float64) for c, u in updates.items()}

    def scores(self) -> dict[int, float]:
        """Suspicious score per client: its normalised distances summed over the last
        ``window`` scored rounds (clients present in all of them)."""
        last = self.rows[-self.window :]
        if not last:
            return {}
        clients = sorted(set.intersection(*(set(r) for r in last)))
        return {c: float(sum(r[c] for r in last)) for c in clients}

    def result(self) -> tuple[list[int], dict[int, float], int, str | None]:
        """``(flagged, suspicious scores, clusters found, why no prediction or None)``."""
        if len(self.rows) < self.window:
            why = (
                f"no prediction: {len(self.rows)} scored round(s) after a warm-up of "
                f"{self.warmup}, the window needs {self.window} (rounds run: {self.rounds})"
            )
            return [], self.scores(), 1, why
        scores = self.scores()
        if len(scores) < 3:
            return [], scores, 1, "no prediction: fewer than 3 clients scored in every round"
        ids = list(scores)
        x = np.array([scores[c] for c in ids]).reshape(-1, 1)
        k = gap_statistic(x, self.k_max, self.references, seed=self.seed)
        if k <= 1:
            return [], scores, k, None
        from sklearn.cluster import KMeans

        labels = KMeans(n_clusters=2, n_init=10, random_state=self.seed).fit(x).labels_
        means = [x[labels == j].mean() for j in (0, 1)]
        bad = int(np.argmax(means))
        return [c for c, lab in zip(ids, labels, strict=True) if lab == bad], scores, k, None
