"""FLForensics (Jia et al.; official code ``jyqhahah/FLForensics``), and the FedAttr paper's
k-means adaptation of it.

**As published** (:func:`trace`). Each client gets two influence features, summed over the
rounds it took part in: its influence on the *target* (the original: the loss on a poisoned
input; here: the owner's detection statistic) and on a *benign reference* (the original: a
uniform-noise input with the target label; here: the same statistic under a random key that
never watermarked anything, or, for Fictitious Knowledge, a decoy value). As in the original,
each client's update is normalised to unit length first (here: the model is moved along the
update by the round's median update norm, the same step for every client, and the change of
the statistic measured exactly, where the original takes the first-order inner product). Each
feature is divided by its range over the clients (not shifted). HDBSCAN
(``min_cluster_size`` 7, ``min_samples`` 1, Euclidean) clusters the clients; candidate
clusters are those (the noise label included) with positive mean target influence and fewer
than half the clients; with one candidate all its members are named; with several, the
reference-to-target ratio of their pooled non-noise members sets the bar, and a cluster (or
noise point with positive target influence) at or below it is named. A client is named only
when it is named under every one of the 5 references (unanimity).

**The FedAttr paper's adaptation** (:func:`cluster_kmeans`): k-means (k in 2..K-1 by
silhouette) on the clients' exact influence vectors on the detection probes, summed over rounds;
the cluster with the largest mean total influence is named.

All of them read every client's plaintext update: they do not respect secure aggregation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def _stack(influence: Mapping[int, np.ndarray]) -> tuple[list[int], np.ndarray]:
    ids = sorted(influence)
    return ids, np.stack([np.asarray(influence[c], dtype=np.float64) for c in ids])


def _most_influential(ids: list[int], x: np.ndarray, labels: np.ndarray) -> list[int]:
    clusters = sorted({int(lab) for lab in labels if lab >= 0})
    if len(clusters) < 2:
        return []
    totals = x.sum(1)
    best = max(clusters, key=lambda j: totals[labels == j].mean())
    return [c for c, lab in zip(ids, labels, strict=True) if lab == best]


def cluster_kmeans(influence: Mapping[int, np.ndarray], seed: int = 0) -> tuple[list[int], int]:
    """Clients flagged by k-means (k chosen by silhouette over 2..K-1), and the chosen k."""
    from sklearn.cluster import KMeans
    from sklearn.metrics import silhouette_score

    ids, x = _stack(influence)
    if len(ids) < 3 or np.allclose(x, x[0]):
        return [], 1
    best_k, best_s, best_labels = 0, -2.0, None
    for k in range(2, len(ids)):
        labels = KMeans(n_clusters=k, n_init=10, random_state=seed).fit(x).labels_
        if len(set(labels.tolist())) < 2:
            continue
        s = float(silhouette_score(x, labels))
        if s > best_s:
            best_k, best_s, best_labels = k, s, labels
    if best_labels is None:
        return [], 1
    return _most_influential(ids, x, best_labels), best_k


def _named(x: np.ndarray, min_cluster_size: int, min_samples: int) -> np.ndarray:
    """The original's decision on one reference: a boolean per client."""
    from sklearn.cluster import HDBSCAN

    n = len(x)
    labels = (
        HDBSCAN(
            min_cluster_size=min(min_cluster_size, n),
            min_samples=min_samples,
            metric="euclidean",
            copy=True,
        )
        .fit(x)
        .labels_
    )
    candidates = [
        lab
        for lab in sorted(set(labels.tolist()))
        if x[labels == lab, 0].mean() > 0 and (labels == lab).sum() < n / 2
    ]
    named = np.zeros(n, dtype=bool)
    if len(candidates) == 1:
        named[labels == candidates[0]] = True
        return named
    if not candidates:
        return named
    pooled = np.isin(labels, [c for c in candidates if c != -1])
    bar = x[pooled, 1].mean() / x[pooled, 0].mean()
    for lab in candidates:
        if lab != -1 and x[labels == lab, 1].mean() / x[labels == lab, 0].mean() <= bar:
            named[labels == lab] = True
    noise = (labels == -1) & (x[:, 0] > 0)
    named[noise] |= x[noise, 1] / x[noise, 0] <= bar
    return named


def trace(
    target: Mapping[int, float],
    references: Mapping[int, Sequence[float]],
    min_cluster_size: int = 7,
    min_samples: int = 1,
) -> list[int]:
    """FLForensics as published: clients named under every reference (see the module doc).

    ``target[c]``: client c's influence on the target; ``references[c][r]``: on reference r.
    """
    ids = sorted(target)
    if len(ids) < 3:
        return []
    t = np.array([target[c] for c in ids], dtype=np.float64)
    refs = np.array([list(references[c]) for c in ids], dtype=np.float64)
    unanimous = np.ones(len(ids), dtype=bool)
    for r in range(refs.shape[1]):
        spans = [np.ptp(t), np.ptp(refs[:, r])]
        if min(spans) <= 0:
            return []
        x = np.stack([t / spans[0], refs[:, r] / spans[1]], axis=1)
        unanimous &= _named(x, min_cluster_size, min_samples)
    return [c for c, hit in zip(ids, unanimous, strict=True) if hit]
