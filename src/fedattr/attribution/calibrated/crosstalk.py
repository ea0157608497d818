"""Cross-talk algebra: a round's design matrix and ``A^{-1}`` applied to its estimates or changes.

A round's estimates are ``Y = A X``: row i of ``A`` holds the weight of every participant in
target i's estimate (1 for the target, alpha for the others). Where every participant is a
target and ``A`` is well conditioned (:func:`cross_talk`), ``X = A^{-1} Y`` is each client's own
update or change. Every combination here is summed term by term in float64 in a fixed order
(:func:`combination`), so the same round gives the same bits wherever it is computed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..design import QueryDesign


def design_matrix(designs: Sequence[QueryDesign], order: Sequence[int]) -> np.ndarray:
    """Row i: the weight of every participant (in ``order``) in target i's estimate."""
    rows = []
    for d in designs:
        coef = d.coefficients()
        rows.append([coef.get(p, 0.0) for p in order])
    return np.array(rows, dtype=np.float64)


def cross_talk(
    participants: Sequence[int],
    targets: Sequence[int],
    designs: Sequence[QueryDesign],
    decorrelate: bool = True,
) -> np.ndarray | None:
    """The round's design matrix where its cross-talk is undone (every participant a target,
    a well-conditioned design), else ``None``."""
    if not (decorrelate and targets and sorted(targets) == sorted(participants)):
        return None
    A = design_matrix(designs, targets)
    return A if np.linalg.cond(A) < 1e8 else None


class UndoneUpdates(Sequence):
    """Each target's own update, ``A^{-1}`` row ``i`` applied to the round's estimates, formed
    when it is read: a round holds the estimates and the update being read, not K more
    updates (0.3 GB for SmolLM2)."""

    def __init__(self, inv: np.ndarray, updates: Sequence[Any]) -> None:
        self.inv, self.updates = inv, updates

    def __len__(self) -> int:
        return len(self.inv)

    def __getitem__(self, i):
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        first = self.updates[0]
        if isinstance(first, Mapping):
            return {
                name: combination(self.inv[i], [u[name] for u in self.updates]).to(t.dtype)
                for name, t in first.items()
            }
        return combination(self.inv[i], list(self.updates)).to(first.dtype)


def combination(weights: np.ndarray, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sum_k weights[k] * tensors[k]`` in float64, term by term in a fixed order (not a matrix
    product, whose summation order depends on the threads that run it): the same bits in a
    background scorer as in line."""
    total = torch.zeros_like(tensors[0], dtype=torch.float64)
    for w, t in zip(weights, tensors, strict=True):
        total = total + float(w) * t.double()
    return total


def combine(inv: np.ndarray, Y: torch.Tensor, at_once: bool = False) -> torch.Tensor:
    """``inv @ Y`` (float32), row ``i`` being :func:`combination` ``(inv[i], Y)``: the same bits.
    ``at_once`` converts ``Y`` to float64 once and sums in place (twice as fast; memory: ``Y``
    in float64), for a block of rows; else each term is converted as it is added (a change held
    whole, where a float64 copy of every client's change would double the round's memory)."""
    if not at_once:
        return torch.stack([combination(inv[i], list(Y)).float() for i in range(len(Y))])
    Yd = Y.double()
    out = torch.empty_like(Y)
    total, term = torch.empty_like(Yd[0]), torch.empty_like(Yd[0])
    for i in range(len(Y)):
        total.zero_()
        for k in range(len(Y)):
            # w * t rounded, then added: combination's two roundings, in its order.
            torch.mul(Yd[k], float(inv[i][k]), out=term)
            total.add_(term)
        out[i] = total
    return out


AT_ONCE_CELLS = 1 << 23
"""Cells of a round's changes (every target's) that :func:`combine` converts to float64 at
once when a change is held whole (64 MB in float64; a part of an embedded-default round is
3M)."""
