"""Arithmetic shared by the strategies (after Flower's ``server/strategy/aggregate.py``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

State = dict[str, torch.Tensor]


def subtract_states(a: State, b: State) -> State:
    """``a - b`` key-wise over ``a``'s keys."""
    return {k: a[k] - b[k] for k in a}


def weighted_mean(states: Sequence[State], weights: Sequence[float]) -> State:
    """``sum_i w_i * state_i / sum_i w_i`` (the plaintext formula the SA path must match)."""
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("weighted_mean: weights must sum to a positive number")
    return {
        k: sum(w * s[k].double() for s, w in zip(states, weights, strict=True)) / total
        for k in states[0]
    }


def sa_scales(sizes: Sequence[int]) -> list[float]:
    """Per-client factors ``n * p_i`` (``p_i = |D_i| / sum |D_j|``) applied before SA.

    Clients submit ``n * p_i * Delta_i``, so the SA sum over all ``n`` participants divided by
    ``n`` is the sample-weighted mean ``sum p_i Delta_i``, and with equal data sizes every
    client submits its raw update (the FedAttr estimate is then ``Delta_i`` itself; otherwise
    it is the update weighted by the client's share of data, i.e. by its weight in the model).
    """
    if any(s < 0 for s in sizes):
        raise ValueError(f"sa_scales: data sizes must be >= 0, got {list(sizes)}")
    total = float(sum(sizes))
    if total == 0:
        # No participant holds a usable example: none has learned anything (each sends a
        # zero update), and the round leaves the model as it is.
        return [0.0] * len(sizes)
    return [len(sizes) * s / total for s in sizes]
