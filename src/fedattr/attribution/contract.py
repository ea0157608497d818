"""The detector contract: what FedAttr asks of a scorer, as runtime-checkable protocols.

A *scorer* maps model parameters to a detection statistic (:class:`Scorer`); a *paired* one
tests the change between a reference and a candidate itself (:class:`PairedScorer`). What else
a scorer can do is found with ``isinstance`` against one of these protocols, and each is read
by one consumer:

- the protocol and the paper statistic: :class:`BatchedScorer` (a round's candidates in one
  read), :class:`DeclaresNull` (``attribution.paper.null = auto``);
- the baselines: :class:`ProbeScorer`, :class:`KeyStatisticScorer` (FLForensics),
  :class:`CalibratedContrast` (the global-model test);
- the calibrated statistic (:mod:`fedattr.attribution.calibrated`): :class:`LinearKeyScorer`
  (required: owner statistics linear in the key, with the key's law per part), and the
  optional :class:`OwnerKeys`, :class:`SteppedReading`, :class:`SpreadReporter`,
  :class:`ReferenceProbabilities`, :class:`RowOwnerValues`;
- the sealed mode's coordinator: :class:`Parties` (where its servers and owners run).

The detectors themselves live in :mod:`fedattr.watermarks` and need not import this module:
the protocols are structural.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch

from ..watermarks.tail.laws import KeyLaw

if TYPE_CHECKING:
    from .sealed.parties import Opening, RoundWork, Verdicts

Parts = dict[str, torch.Tensor]
"""Part name -> a change (or a standardised change): one per key law the detector reads."""


class Scorer(Protocol):
    """Callable on model parameters returning a detection statistic.

    Either one float, or a mapping of named statistics (e.g. one KGW z per corpus owner's key,
    computed from the same generations) that FedAttr tracks side by side.
    """

    def __call__(self, params: Any) -> float | Mapping[str, float]: ...


@runtime_checkable
class PairedScorer(Protocol):
    """A scorer that tests the change between a reference and a candidate model directly.

    It may also offer ``observe_many(list_of_params)`` and ``batched`` (:class:`BatchedScorer`:
    one observation per entry, in order) to evaluate a round's candidates in one batched pass;
    without them they are observed one by one.
    """

    def observe(self, params: Any) -> Any:
        """What the scorer needs to know of a model (e.g. its next-token distributions)."""
        ...

    def contrast(self, reference: Any, candidate: Any) -> float | Mapping[str, float]:
        """The statistic of ``candidate`` against ``reference`` (observations)."""
        ...


@runtime_checkable
class BatchedScorer(PairedScorer, Protocol):
    """A paired scorer that observes several parameter sets in one pass, when ``batched`` says
    it can (a scorer that would only loop over ``observe`` says ``False``: it is better fed
    lazily, one candidate's parameters at a time)."""

    batched: bool

    def observe_many(self, many: Sequence[Any]) -> list[Any]:
        """One observation per entry of ``many``, in order."""
        ...


@runtime_checkable
class DeclaresNull(Protocol):
    """A scorer that says under which null its statistic is read: ``theoretical`` (unit
    variance of its own) or ``empirical`` (to be standardised across clients)."""

    null: str


@runtime_checkable
class ProbeScorer(Protocol):
    """A paired scorer that exposes the per-probe values behind its statistic (FLForensics'
    influence features)."""

    def observe(self, params: Any) -> Any: ...

    def probe_values(self, observation: Any) -> np.ndarray:
        """One value per probe (token position, question, ...) of an observation."""
        ...


@runtime_checkable
class KeyStatisticScorer(Protocol):
    """A scorer that reads a change with the owner's key and with ``n`` references (random
    keys, decoys): FLForensics' reference features."""

    def key_statistics(
        self, reference: Any, candidate: Any, n: int, seed: int
    ) -> Mapping[str, tuple[float, np.ndarray]]:
        """Owner -> (the owner's statistic, the ``n`` references' statistics)."""
        ...


@runtime_checkable
class CalibratedContrast(Protocol):
    """A paired scorer whose contrast needs an empirical null, offering a calibrated test of
    one model against a reference for the global-model test."""

    def calibrated_contrast(self, reference: Any, candidate: Any) -> float | Mapping[str, float]:
        """The contrast as a calibrated z."""
        ...


@runtime_checkable
class LinearKeyScorer(Protocol):
    """A paired detector whose owner statistics are linear in the owner's key."""

    exchangeable_rounds: int | None
    """How many rounds, from the first, read the owner's key as exchangeable with a random one
    (``None``: every round). A detector whose reference model learns the owner's secret says
    so (FK: 1): later rounds are skipped or make its p-values uncalibrated."""

    def observe(self, params: Any) -> Any:
        """What the detector reads of a model."""
        ...

    def change(self, reference: Any, candidate: Any) -> Parts:
        """The key-linear change from ``reference`` to ``candidate`` (observations), per part."""
        ...

    def key_laws(self) -> dict[str, KeyLaw]:
        """Part -> the law of a random key over that part."""
        ...

    def owner_values(self, part: str, W: torch.Tensor) -> dict[str, float]:
        """``<W, G_owner>`` for every owner whose key reads ``part``."""
        ...


@runtime_checkable
class OwnerKeys(Protocol):
    """A detector that lends the verdict its owners' keys as matrices (KGW: green masks), so
    that where the analytic tail is only a bound, p is read by shifting the owner's own key
    (:func:`~fedattr.watermarks.tail.methods.shifted_keys_p`)."""

    def owner_keys(self, part: str) -> Mapping[str, torch.Tensor]:
        """Owner -> ``G`` with ``owner_values(part, W)[owner] == <W, G>``."""
        ...


@runtime_checkable
class SteppedReading(Protocol):
    """A detector that asks to be read at a fraction of each estimate (its reading saturates:
    only the first-order part of its change is linear in the estimate)."""

    reading_step: float
    """The fraction (``attribution.calibrated.reading_step`` overrides it)."""


@runtime_checkable
class SpreadReporter(Protocol):
    """A detector that says over how many contexts a change is spread (for the record)."""

    def effective_contexts(self, reference: Any, candidate: Any) -> float:
        """``(sum ||D[x]||^2)^2 / sum ||D[x]||^4`` of the change between two observations."""
        ...


@runtime_checkable
class ReferenceProbabilities(Protocol):
    """A detector whose change is over next-token distributions (KGW reading): it says each
    cell's probability under the reference model, which a taper reads (key-free)."""

    def reference_probabilities(self, reference: Any) -> Parts:
        """Part -> each cell's mean next-token probability under the reference observation."""
        ...


@runtime_checkable
class RowOwnerValues(Protocol):
    """A detector that reads its owners' values off a block of rows (a change read by blocks,
    :class:`~fedattr.attribution.calibrated.standardise.ChangeRows`; the spilled sums)."""

    def owner_values_rows(self, part: str, rows: torch.Tensor, lo: int) -> dict[str, float]:
        """``<W[lo : lo + len(rows)], G_owner[same rows]>`` for every owner reading ``part``."""
        ...


class Parties(Protocol):
    """The sealed mode's parties, wherever they run (:mod:`fedattr.attribution.sealed.parties`):
    what its coordinator, :class:`~fedattr.attribution.sealed.SealedObserver`, asks of them."""

    def owners(self) -> list[str]:
        """The owners' names (sorted)."""
        ...

    def round(self, work: RoundWork) -> np.ndarray:
        """Clients send their shares; each server opens its sum over ``work.answered`` (the
        two returned added: the round's weighted aggregate, flat float64) and reads its
        shares into its running sums."""
        ...

    def clients(self) -> list[int]:
        """Clients both servers hold a running sum of."""
        ...

    def open(self, opening: Opening) -> tuple[Verdicts, dict[str, Any]]:
        """The owners' verdicts, and the openings' cost (bytes, triples, cells, seconds)."""
        ...

    @property
    def reads(self) -> int:
        """First-order reads of shares over the run (both servers)."""
        ...

    def attack(self) -> dict[str, Any]:
        """The simulation's attack on server A's view (empty where the truth is not here)."""
        ...

    def state(self) -> Any: ...

    def load(self, state: Any) -> None: ...
