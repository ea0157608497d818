"""Splitting records over clients: IID or Dirichlet(alpha) non-IID."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from ..errors import UserError
from .records import Record


def partition_iid(records: Sequence[Record], K: int, seed: int = 0) -> list[list[Record]]:
    """Shuffle and deal into ``K`` near-equal shards."""
    if K < 1:
        raise UserError(f"K: must be >= 1, got {K}")
    if len(records) < K:
        raise UserError(f"data: {len(records)} records cannot give each of K={K} clients one")
    order = np.random.default_rng(seed).permutation(len(records))
    return [[records[i] for i in order[k::K]] for k in range(K)]


def partition_dirichlet(
    records: Sequence[Record], K: int, alpha: float, seed: int = 0, min_size: int = 1
) -> list[list[Record]]:
    """Label-skew split: for each category, client shares ~ Dirichlet(alpha * 1_K).

    Categories are the records' ``category`` field; data with a single category (e.g. plain
    Alpaca) gets a quantity skew instead, which is what one Dirichlet draw over one label is.
    Redraws (up to 100 times) until every client has at least ``min_size`` records.
    """
    if alpha <= 0:
        raise UserError(f"data.dirichlet_alpha: must be > 0, got {alpha}")
    if len(records) < K * min_size:
        raise UserError(f"data: {len(records)} records are too few for K={K} clients")
    by_cat: dict[str, list[int]] = defaultdict(list)
    for i, rec in enumerate(records):
        by_cat[rec.category].append(i)
    rng = np.random.default_rng(seed)
    for _ in range(100):
        shards: list[list[int]] = [[] for _ in range(K)]
        for cat in sorted(by_cat):
            idx = rng.permutation(by_cat[cat])
            props = rng.dirichlet(np.full(K, alpha))
            cuts = (np.cumsum(props)[:-1] * len(idx)).astype(int)
            for k, part in enumerate(np.split(idx, cuts)):
                shards[k].extend(int(i) for i in part)
        if min(len(s) for s in shards) >= min_size:
            return [[records[i] for i in sorted(s)] for s in shards]
    raise UserError(
        f"data.dirichlet_alpha={alpha}: could not give every one of K={K} clients "
        f"{min_size} records in 100 draws; raise alpha or use more data"
    )


def aggregation_weights(sizes: Sequence[int]) -> list[float]:
    """``p_i = |D_i| / sum_j |D_j|``."""
    total = float(sum(sizes))
    if total <= 0:
        raise UserError("aggregation weights: clients hold no data")
    return [s / total for s in sizes]
