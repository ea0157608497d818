"""The one interface every secure-aggregation backend implements.

Per round: the server opens the round with the participating client ids, each client submits
its update, and the server may then ask only for subset sums ``S(W) = sum_{j in W} Delta_j``
with ``|W| >= min_members``. Every answered query is logged for overhead accounting.

Backends implement three hooks (``_receive``, ``_sum``, ``_drop_round``); this base class owns
round bookkeeping, query validation, layouts and logging, so all backends refuse exactly the
same queries with exactly the same messages.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import ClassVar

import numpy as np

from ..updates import Update, UpdateLayout
from .errors import QueryRefused, SecAggError
from .fixedpoint import FixedPointCodec


@dataclass(frozen=True)
class QueryRecord:
    """One answered subset-sum query.

    ``bytes_moved`` counts the protocol messages of the query (masked inputs, partial sums);
    ``seconds`` is the wall time of the whole query in this process; ``client_seconds_max`` is
    the slowest member's own computation, i.e. the query's latency when clients run in parallel.
    """

    round: int
    query_id: int
    subset: tuple[int, ...]
    bytes_moved: int
    seconds: float
    client_seconds_max: float = 0.0

    def to_dict(self) -> dict:
        """JSON-ready form."""
        d = asdict(self)
        d["subset"] = list(self.subset)
        return d


class SecureAggregator(ABC):
    """Secure aggregation with subset-sum queries over one round's submitted updates."""

    name: ClassVar[str]
    holds_plaintext: ClassVar[bool] = False
    """True only for the reference backend, which sees every individual update."""

    def __init__(self, min_members: int = 2, codec: FixedPointCodec | None = None) -> None:
        if not isinstance(min_members, int) or min_members < 1:
            raise SecAggError(f"min_members: must be an integer >= 1, got {min_members!r}")
        self.min_members = min_members
        self.codec = codec or FixedPointCodec()
        self.log: list[QueryRecord] = []
        self.upload_bytes = 0
        self._round: int | None = None
        self._clients: tuple[int, ...] = ()
        self._submitted: set[int] = set()
        self._layout: UpdateLayout | None = None
        self._next_query = 0

    # -- round life cycle -------------------------------------------------------------------
    @property
    def round(self) -> int | None:
        """The open round's id, or ``None`` between rounds."""
        return self._round

    @property
    def clients(self) -> tuple[int, ...]:
        """Client ids registered for the open round."""
        return self._clients

    @property
    def layout(self) -> UpdateLayout:
        """Layout of this round's updates (known after the first submission)."""
        if self._layout is None:
            raise SecAggError("no update has been submitted in this round yet")
        return self._layout

    def open_round(self, round_id: int, client_ids: Iterable[int]) -> None:
        """Start round ``round_id`` with the given participating clients."""
        if self._round is not None:
            raise SecAggError(f"round {self._round} is still open; close it before opening another")
        ids = tuple(int(c) for c in client_ids)
        if len(set(ids)) != len(ids):
            raise SecAggError(f"client_ids: duplicate ids in {list(ids)}")
        if len(ids) < self.min_members:
            raise SecAggError(
                f"client_ids: {len(ids)} clients cannot form any subset of the threshold size "
                f"min_members={self.min_members}"
            )
        self.codec.check_capacity(len(ids))
        self._round, self._clients = int(round_id), ids
        self._submitted, self._layout, self._next_query = set(), None, 0
        self._start_round(self._round, ids)

    def submit(self, client_id: int, update: Update) -> None:
        """Client ``client_id`` hands its update to the protocol (once per round)."""
        if self._round is None:
            raise SecAggError("submit: no round is open")
        if client_id not in self._clients:
            raise SecAggError(
                f"client_id: {client_id} is not registered for round {self._round} "
                f"(registered: {list(self._clients)})"
            )
        if client_id in self._submitted:
            raise SecAggError(f"client_id: {client_id} already submitted in round {self._round}")
        layout = self._layout or UpdateLayout.of(update)
        flat = layout.flatten(update)
        self._receive(client_id, flat)
        self._layout = layout
        self._submitted.add(client_id)

    def subset_sum(self, subset: Iterable[int]) -> Update:
        """``S(W)`` in the structure the clients submitted."""
        return self.layout.unflatten(self.subset_sum_flat(subset))

    def subset_sum_flat(self, subset: Iterable[int]) -> np.ndarray:
        """``S(W)`` as a flat float64 vector (see :class:`~fedattr.updates.UpdateLayout`)."""
        members = self._validate(subset)
        query_id = self._next_query
        start = time.perf_counter()
        total, moved, client_max = self._sum(members, query_id)
        seconds = time.perf_counter() - start
        self._next_query += 1
        self.log.append(QueryRecord(self._round, query_id, members, moved, seconds, client_max))
        return total

    def close_round(self) -> None:
        """End the round: every party forgets this round's updates, shares and keys."""
        if self._round is None:
            raise SecAggError("close_round: no round is open")
        self._drop_round()
        self._round, self._clients, self._submitted = None, (), set()

    # -- validation -------------------------------------------------------------------------
    def _validate(self, subset: Iterable[int]) -> tuple[int, ...]:
        if self._round is None:
            raise QueryRefused(
                "query refused: no round is open (the round was closed or never opened)"
            )
        members = tuple(int(c) for c in subset)
        if not members:
            raise QueryRefused("query refused: subset is empty")
        if len(set(members)) != len(members):
            raise QueryRefused(
                f"query refused: subset {list(members)} contains duplicate client ids"
            )
        unknown = sorted(set(members) - set(self._clients))
        if unknown:
            raise QueryRefused(
                f"query refused: clients {unknown} are not registered for round {self._round}"
            )
        missing = sorted(set(members) - self._submitted)
        if missing:
            raise QueryRefused(
                f"query refused: clients {missing} have not submitted an update in round "
                f"{self._round}"
            )
        if len(members) < self.min_members:
            raise QueryRefused(
                f"query refused: subset size {len(members)} is below the secure-aggregation "
                f"threshold; allowed sizes are {self.min_members}..{len(self._clients)}"
            )
        return tuple(sorted(members))

    # -- backend hooks ----------------------------------------------------------------------
    def _start_round(self, round_id: int, client_ids: Sequence[int]) -> None:  # noqa: B027
        """Backend set-up for a new round (keys, share holders); optional."""

    @abstractmethod
    def _receive(self, client_id: int, flat: np.ndarray) -> None:
        """Take a client's flattened update into the protocol."""

    @abstractmethod
    def _sum(self, members: tuple[int, ...], query_id: int) -> tuple[np.ndarray, int, float]:
        """Run one query; return (sum as float64, bytes moved, slowest client's seconds)."""

    @abstractmethod
    def _drop_round(self) -> None:
        """Forget the round's state."""

    def describe(self) -> str:
        """One line saying what this backend protects."""
        return f"{self.name}: {type(self).__doc__.strip().splitlines()[0]}"
