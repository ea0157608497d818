"""Client pools: the clients a round engine drives, wherever they run.

A pool knows which clients exist and how much data each holds, trains a round's participants
and has each submit its (scaled) update to secure aggregation. In-process pools run every
client in this process; a remote pool (e.g. on Flower) sends them messages. Only an in-process
pool can hand out plaintext updates (:meth:`ClientPool.open_tap`), which is what the baselines
that do not respect secure aggregation read.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from ..errors import UserError
from ..secagg.aggregator import SecureAggregator
from ..updates import Update
from .aggregate import sa_scales
from .progress import Progress
from .timing import Stopwatch


def require_usable_examples(sizes: Sequence[int]) -> None:
    """Refuse, in one line, a federation in which no client has a usable training example
    (a client without one takes part with a zero update and weight 0; all of them, nothing
    would be learned)."""
    if not sizes or max(sizes) == 0:
        raise UserError("data: no client has a usable training example; raise data.records")


class PlaintextTap:
    """The last trained round's plaintext client updates, for baselines that read them.

    FedAttr never uses this: it only queries secure aggregation. Whoever opens a tap reads what
    a real deployment's server could not.
    """

    def __init__(self) -> None:
        self.updates: dict[int, Update] = {}


class ClientPool(ABC):
    """The federation's clients as the round engine sees them."""

    @property
    @abstractmethod
    def num_clients(self) -> int:
        """Clients in the federation (ids ``0..num_clients-1``)."""

    @abstractmethod
    def data_sizes(self) -> list[int]:
        """Training examples per client (the FedAvg weights)."""

    def scales(self, participants: Sequence[int]) -> dict[int, float]:
        """``n * p_i`` per participant: what each multiplies its update by before SA, so that
        the SA sum divided by the answering clients' total is the sample-weighted mean."""
        sizes = self.data_sizes()
        factors = sa_scales([sizes[c] for c in participants])
        return dict(zip(participants, factors, strict=True))

    @abstractmethod
    def train_round(
        self,
        round_id: int,
        participants: Sequence[int],
        state: Any,
        sa: SecureAggregator,
        scales: dict[int, float],
        progress: Progress,
        timing: Stopwatch | None = None,
    ) -> dict[int, float]:
        """Train every participant from ``state`` and submit ``scales[c] * Delta_c`` to ``sa``
        (a round already open for ``participants``); returns per-client training losses. Work
        done (``train_tokens``, ``train_steps``) is added to ``timing``'s counters."""

    def open_tap(self) -> PlaintextTap:
        """A :class:`PlaintextTap` the pool fills every round; only in-process pools have one."""
        raise UserError(
            "baselines: they read plaintext client updates, which this runtime's clients never "
            "reveal; run them in-process (fedattr run --set baselines=true)"
        )
