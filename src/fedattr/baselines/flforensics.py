"""FLForensics-style tracing (after Jia et al. 2024): cluster clients by their influence on
the detection probes.

A client's influence vector is, per probe, the change its plaintext update makes to the
probe's detection value, ``v_p(w^{t-1} + Delta_i^t) - v_p(w^{t-1})``, summed over the rounds
it took part in (probes: the QA probes for FK, held-out clean texts for KGW; see the scorers'
``probe_values``). FLForensics uses a first-order (gradient inner-product) estimate of this
change; fedattr measures it exactly, since the model is at hand. The clients are clustered and
the cluster with the largest mean total influence (sum over probes, i.e. towards the
watermark) is flagged:

* ``hdbscan``: the original's density clustering (scikit-learn's HDBSCAN, ``min_cluster_size``
  2). Noise points belong to no cluster and are never flagged; with fewer than two clusters
  nobody is flagged, which is how it degenerates at K = 10.
* ``kmeans``: the FedAttr paper's variant, k-means with k in 2..K-1 chosen by the silhouette.

Both read every client's plaintext update: they do not respect secure aggregation.
"""

from __future__ import annotations

from collections.abc import Mapping

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


def cluster_hdbscan(influence: Mapping[int, np.ndarray], min_cluster_size: int = 2) -> list[int]:
    """Clients flagged by HDBSCAN clustering of their influence vectors."""
    from sklearn.cluster import HDBSCAN

    ids, x = _stack(influence)
    if len(ids) < 2 * min_cluster_size:
        return []
    labels = HDBSCAN(min_cluster_size=min_cluster_size, copy=True).fit(x).labels_
    return _most_influential(ids, x, labels)


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
