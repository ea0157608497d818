"""Splitting records over clients: IID, Dirichlet(alpha) label skew, or Dirichlet(alpha)
quantity skew."""

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


def partition_quantity(
    records: Sequence[Record], K: int, alpha: float, seed: int = 0
) -> list[list[Record]]:
    """Quantity skew: shard sizes ``1 + (n - K) * q`` with ``q ~ Dirichlet(alpha * 1_K)`` (every
    client holds at least one record; at alpha = 0.5 and 2,000 records, from a handful of
    records to about a thousand), the records dealt at random, so every shard is drawn from the
    same distribution and only its size differs."""
    if alpha <= 0:
        raise UserError(f"data.dirichlet_alpha: must be > 0, got {alpha}")
    if len(records) < K:
        raise UserError(f"data: {len(records)} records cannot give each of K={K} clients one")
    rng = np.random.default_rng([seed, 0x0A7])
    q = rng.dirichlet(np.full(K, alpha))
    extra = np.floor(q * (len(records) - K)).astype(int)
    # The records left by rounding down go to the largest shares, one each.
    for k in np.argsort(-q)[: len(records) - K - int(extra.sum())]:
        extra[k] += 1
    order = rng.permutation(len(records))
    cuts = np.cumsum(1 + extra)[:-1]
    return [[records[i] for i in sorted(part)] for part in np.split(order, cuts)]


def aggregation_weights(sizes: Sequence[int]) -> list[float]:
    """``p_i = |D_i| / sum_j |D_j|``."""
    total = float(sum(sizes))
    if total <= 0:
        raise UserError("aggregation weights: clients hold no data")
    return [s / total for s in sizes]
