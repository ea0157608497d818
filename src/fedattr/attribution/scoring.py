"""The scorer interface and the differential score.

A scorer maps model parameters to a detection statistic (larger = more watermark), e.g. the
KGW z-score of a model's greedy generations. The differential score
``z_i^t = Score(w^{t-1} + Delta_hat_i) - Score(w^{t-1})`` subtracts the score of the round's
reference model, which already carries the watermark accumulated in earlier rounds; the
reference is scored once per round and reused for every target, with the same prompts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from ..updates import Update, add_update


class Scorer(Protocol):
    """Callable on model parameters returning a detection statistic.

    Either one float, or a mapping of named statistics (e.g. one KGW z per corpus owner's key,
    computed from the same generations) that FedAttr tracks side by side.
    """

    def __call__(self, params: Any) -> float | Mapping[str, float]: ...


DEFAULT_STATISTIC = "score"
"""Name given to the value of a scorer that returns a single float."""


def as_statistics(value: float | Mapping[str, float]) -> dict[str, float]:
    """A scorer's output as ``{name: value}``."""
    if isinstance(value, Mapping):
        return {str(k): float(v) for k, v in value.items()}
    return {DEFAULT_STATISTIC: float(value)}


ApplyUpdate = Callable[[Any, Update], Any]
"""How an estimated update is applied to the reference parameters (default: addition)."""


class LinearScorer:
    """``Score(w) = <s, w> / scale``: the synthetic scorer of the protocol demo and tests."""

    def __init__(self, direction: torch.Tensor, scale: float = 1.0) -> None:
        if scale <= 0:
            raise ValueError(f"scale: must be positive, got {scale}")
        self.direction = direction.to(torch.float64).reshape(-1)
        self.scale = scale

    def __call__(self, params: torch.Tensor) -> float:
        flat = params.to(torch.float64).reshape(-1)
        return float(torch.dot(self.direction, flat)) / self.scale


class DifferentialScorer:
    """Scores estimates against one round's reference parameters (reference scored once)."""

    def __init__(self, scorer: Scorer, reference: Any, apply: ApplyUpdate = add_update) -> None:
        self.scorer = scorer
        self.reference = reference
        self.apply = apply
        self.reference_score = as_statistics(scorer(reference))

    def __call__(self, estimate: Update) -> dict[str, float]:
        """``Score(reference + estimate) - Score(reference)`` for every statistic."""
        scores = as_statistics(self.scorer(self.apply(self.reference, estimate)))
        return {k: v - self.reference_score[k] for k, v in scores.items()}
