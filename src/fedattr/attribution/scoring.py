"""Scoring helpers and the differential score (the scorer protocols: :mod:`.contract`).

A scorer maps model parameters to a detection statistic (larger = more watermark), e.g. the
KGW z-score of a model's greedy generations. The differential score
``z_i^t = Score(w^{t-1} + Delta_hat_i) - Score(w^{t-1})`` subtracts the score of the round's
reference model, which already carries the watermark accumulated in earlier rounds; the
reference is scored once per round and reused for every target, with the same prompts.

A *paired* scorer (:class:`~fedattr.attribution.contract.PairedScorer`) replaces the
subtraction by a test of the change itself: it observes the reference once (``observe``) and
contrasts each estimate's observation with it (``contrast``). This is how a statistic whose
null variance depends on the size of the change (e.g. the teacher-forced KGW green-mass
contrast) plugs into the same protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch

from ..updates import Update, add_update
from ..watermarks.tail.laws import Directions
from .contract import BatchedScorer, DeclaresNull, PairedScorer, Scorer

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

    exchangeable_rounds: int | None = None
    """A random unit direction is exchangeable with the secret one in every round (the
    calibrated null)."""

    def __init__(self, direction: torch.Tensor, scale: float = 1.0) -> None:
        if scale <= 0:
            raise ValueError(f"scale: must be positive, got {scale}")
        self.direction = direction.to(torch.float64).reshape(-1)
        self.scale = scale
        self._null: tuple[tuple[int, int], torch.Tensor] | None = None

    def __call__(self, params: torch.Tensor) -> float:
        flat = params.to(torch.float64).reshape(-1)
        return float(torch.dot(self.direction, flat)) / self.scale

    def observe(self, params: torch.Tensor) -> torch.Tensor:
        """The parameters as a flat float64 vector (for :meth:`key_statistics`)."""
        return params.detach().to("cpu", torch.float64).reshape(-1)

    def change(self, reference: torch.Tensor, candidate: torch.Tensor) -> dict[str, torch.Tensor]:
        """The parameter change (the calibrated statistic's key-linear change)."""
        return {DEFAULT_STATISTIC: (candidate - reference) / self.scale}

    def key_laws(self) -> dict[str, Directions]:
        """A random key is a uniformly random unit direction."""
        return {DEFAULT_STATISTIC: Directions(self.direction.numel())}

    def owner_values(self, part: str, W: torch.Tensor) -> dict[str, float]:
        """``<s, W> / ||s||``: read with the unit direction, as the random keys of
        :meth:`key_laws` are (a longer ``s`` would otherwise scale the value, not its null)."""
        unit = self.direction / self.direction.norm()
        return {DEFAULT_STATISTIC: float(torch.dot(unit, W.double().reshape(-1)))}

    def key_statistics(
        self, reference: torch.Tensor, candidate: torch.Tensor, n: int, seed: int
    ) -> dict[str, tuple[float, np.ndarray]]:
        """``<s, change>`` and the same along ``n`` fresh random unit directions (the null)."""
        if self._null is None or self._null[0] != (n, seed):
            stream = np.random.default_rng([seed, 0x4E55])
            gen = torch.Generator().manual_seed(int(stream.integers(2**62)))
            dirs = torch.randn(n, self.direction.numel(), generator=gen, dtype=torch.float64)
            self._null = ((n, seed), dirs / dirs.norm(dim=1, keepdim=True))
        change = candidate - reference
        null = (self._null[1] @ change / self.scale).numpy()
        return {DEFAULT_STATISTIC: (float(torch.dot(self.direction, change)) / self.scale, null)}


def scorer_null(scorer: Any) -> str:
    """``empirical`` when the scorer's statistic has no null scale of its own, else
    ``theoretical``."""
    return (
        "empirical"
        if isinstance(scorer, DeclaresNull) and scorer.null == "empirical"
        else "theoretical"
    )


def observe_all(scorer: Any, params: Iterable[Any]) -> Iterable[Any]:
    """The scorer's observation of every entry of ``params``: one batched ``observe_many`` call
    when the scorer has it, else ``observe`` lazily one at a time (so only one candidate's
    parameters need to exist at a time when ``params`` is lazy)."""
    if observes_in_batches(scorer):
        return scorer.observe_many(list(params))
    return (scorer.observe(p) for p in params)


def observe_each(scorer: Any, params: Iterable[Any]) -> Iterator[Any]:
    """:func:`observe_all` one observation at a time, a batched read's list emptied as it goes
    (so its readings are freed as they are used, as a lazy read's are)."""
    items = observe_all(scorer, params)
    if isinstance(items, list):
        items.reverse()
        while items:
            yield items.pop()
    else:
        yield from items


def observes_in_batches(scorer: Any) -> bool:
    """Whether :func:`observe_all` sees a round's candidates in one batched call."""
    return isinstance(scorer, BatchedScorer) and bool(scorer.batched)


def is_paired(scorer: Any) -> bool:
    """Whether ``scorer`` follows :class:`PairedScorer` (has ``observe`` and ``contrast``)."""
    return isinstance(scorer, PairedScorer)


class DifferentialScorer:
    """Scores estimates against one round's reference parameters (reference scored once).

    ``reference_score`` holds the reference's statistics for a plain scorer and is empty for a
    paired one (its statistics only exist for a change).
    """

    def __init__(
        self, scorer: Scorer | PairedScorer, reference: Any, apply: ApplyUpdate = add_update
    ) -> None:
        # Any: a plain or a paired scorer, told apart at run time (is_paired).
        self.scorer: Any = cast(Any, scorer)
        self.reference = reference
        self.apply = apply
        self.paired = is_paired(scorer)
        if self.paired:
            self._reference_obs = self.scorer.observe(reference)
            self.reference_score: dict[str, float] = {}
        else:
            self.reference_score = as_statistics(self.scorer(reference))

    def __call__(self, estimate: Update) -> dict[str, float]:
        """``Score(reference + estimate) - Score(reference)`` for every statistic, or the
        paired scorer's contrast of the two."""
        return self.score_many([estimate])[0]

    def score_many(self, estimates: Sequence[Update]) -> list[dict[str, float]]:
        """:meth:`__call__` for every estimate; a paired scorer with ``observe_many`` sees all
        candidates at once (one batched pass), any other scorer one candidate at a time (so
        only one candidate's parameters exist at a time)."""
        if self.paired and observes_in_batches(self.scorer):
            candidates = (self.apply(self.reference, e) for e in estimates)
            ref = self._reference_obs
            return [
                as_statistics(self.scorer.contrast(ref, o))
                for o in observe_all(self.scorer, candidates)
            ]
        return [self._score_one(e) for e in estimates]

    def _score_one(self, estimate: Update) -> dict[str, float]:
        candidate = self.apply(self.reference, estimate)
        if self.paired:
            return as_statistics(
                self.scorer.contrast(self._reference_obs, self.scorer.observe(candidate))
            )
        scores = as_statistics(self.scorer(candidate))
        return {k: v - self.reference_score[k] for k, v in scores.items()}
