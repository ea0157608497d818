"""The one interface every secure-aggregation backend implements: :class:`SecureAggregator`.

Per round: the server opens the round with the participating client ids, each client submits
its update, and the server may then ask only for subset sums over at least ``min_members``
clients, or for one fused combination over at least ``min_members`` clients (the query types
are in :mod:`~fedattr.secagg.queries`, batches of them in :mod:`~fedattr.secagg.batches`).
Every answered query is logged as a :class:`~fedattr.secagg.queries.QueryRecord`.

Backends implement three hooks (``_receive``, ``_combine``, ``_drop_round``); this base class
owns round bookkeeping, query validation, layouts, the query log and SA sessions, so all
backends refuse exactly the same queries with exactly the same messages. An optional
:class:`~fedattr.secagg.policy.ReleasePolicy` is enforced by ``_authorize``, which real
backends override so that the party that unmasks enforces it.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from ..updates import Update, UpdateLayout
from .batches import Combine, GroupAnswer, QueryGroup, answer_group, check_groups, combined
from .errors import QueryFailed, QueryRefused, SecAggError
from .fixedpoint import FixedPointCodec
from .policy import ReleasePolicy, SessionLedgers
from .queries import Query, QueryRecord

if TYPE_CHECKING:
    from typing import Self

    from .config import SecAggConfig


class SecureAggregator(ABC):
    """Secure aggregation with subset-sum queries over one round's submitted updates."""

    name: ClassVar[str]
    holds_plaintext: ClassVar[bool] = False
    """True only for the reference backend, which sees every individual update."""

    def __init__(
        self,
        min_members: int = 2,
        codec: FixedPointCodec | None = None,
        release_budget: float | None = None,
    ) -> None:
        if not isinstance(min_members, int) or min_members < 1:
            raise SecAggError(f"min_members: must be an integer >= 1, got {min_members!r}")
        if release_budget is not None and not release_budget > 0:
            raise SecAggError(f"release_budget: must be > 0 nats (or None), got {release_budget}")
        self.min_members = min_members
        self.codec = codec or FixedPointCodec()
        self.release_budget = release_budget
        self.log: list[QueryRecord] = []
        self.answer_taps: list[Callable[[QueryRecord, np.ndarray], None]] = []
        """Called with every answered query and its result (``sum_j c_j Delta_j``, before the
        denominator): what the server receives, for a simulation's cross-round attack."""
        self._round: int | None = None
        self._policy: SessionLedgers | None = None
        self._session = ""
        self._offline: set[int] = set()
        self._clients: tuple[int, ...] = ()
        self._submitted: set[int] = set()
        self._layout: UpdateLayout | None = None
        self._next_query = 0

    @classmethod
    def from_config(cls, config: SecAggConfig) -> Self:
        """Build this backend from ``config`` (``release_budget`` 0 means no policy)."""
        return cls(
            config.min_members,
            config.codec(),
            release_budget=config.release_budget or None,
            **cls._options(config),
        )

    @classmethod
    def _options(cls, config: SecAggConfig) -> dict:
        """Constructor settings of this backend's own (PRG, simulated dropouts); none here."""
        return {}

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
        self._offline = set()
        self._policy = self._new_policy()
        if self._policy is not None:
            self._policy.reset(ids)
            self._policy.active = self._session
        self._start_round(self._round, ids)

    def submit(self, client_id: int, update: Update) -> None:
        """Client ``client_id`` hands its update to the protocol (once per round)."""
        self._check_submitter(client_id, "submit")
        layout = self._layout or UpdateLayout.of(update)
        flat = layout.flatten(update)
        self._receive(client_id, flat)
        self._layout = layout
        self._submitted.add(client_id)

    def _check_submitter(self, client_id: int, step: str) -> None:
        """Refuse a submission outside an open round, from a stranger, or made twice."""
        if self._round is None:
            raise SecAggError(f"{step}: no round is open")
        if client_id not in self._clients:
            raise SecAggError(
                f"client_id: {client_id} is not registered for round {self._round} "
                f"(registered: {list(self._clients)})"
            )
        if client_id in self._submitted:
            raise SecAggError(f"client_id: {client_id} already submitted in round {self._round}")

    def subset_sum(self, subset: Iterable[int]) -> Update:
        """``S(W)`` in the structure the clients submitted."""
        return self.layout.unflatten(self.subset_sum_flat(subset))

    def subset_sum_flat(self, subset: Iterable[int]) -> np.ndarray:
        """``S(W)`` as a flat float64 vector (see :class:`~fedattr.updates.UpdateLayout`)."""
        members = self._validate(subset)
        return self._run(members, (1,) * len(members), 1)

    def sum_of_available(self, subset: Iterable[int]) -> tuple[Update, tuple[int, ...]]:
        """``S(W')`` over the members of ``subset`` that answer, and ``W'`` itself.

        A failed query releases nothing; it is re-run without the members that did not answer
        (the FL aggregate of a round with dropouts), down to the threshold.
        """
        members = [c for c in subset if c not in self._offline]
        while True:
            try:
                return self.subset_sum(members), tuple(sorted(members))
            except QueryFailed as exc:
                members = [c for c in members if c not in exc.missing]

    def combination_flat(self, coefficients: Mapping[int, int], denominator: int = 1) -> np.ndarray:
        """Fused query: ``sum_j (c_j / denominator) Delta_j`` in one SA session.

        Coefficients are integers (FedAttr's are multiples of 1/M: pass ``M * coef`` and
        ``denominator = M``), so clients scale their ring encodings exactly; clients with
        coefficient 0 take no part, and at least ``min_members`` must remain.
        """
        members, coefs, denominator = self._admit(Query(coefficients, denominator))
        return self._run(members, coefs, denominator) / denominator

    def run_queries(
        self, groups: Sequence[QueryGroup], combine: Combine | None = None
    ) -> list[GroupAnswer]:
        """Answer a batch of query groups, one :class:`GroupAnswer` per group, in order.

        Every query runs exactly as the single-query methods would, in the order of the groups,
        their alternatives and their queries, so results and the query log are those of calling
        :meth:`subset_sum_flat` / :meth:`combination_flat` one by one. Within a group:

        - :class:`QueryRefused` on an alternative's first query counts a refusal and moves on to
          the next alternative; every alternative refused gives ``results=None``;
        - :class:`QueryRefused` on a later query stops the group (``results=None``);
        - :class:`QueryFailed` anywhere stops the group with ``missing`` set.

        Anything else propagates. The default runs the queries one at a time in this process;
        a runtime with remote clients may override it to batch each round's messages.

        With ``combine``, each answered group's results become ``[combine(g, chosen,
        results)]`` as soon as group ``g`` is answered: the caller's reduction (an estimate
        from its 2M subset sums), so that a batch holds one group's answers at a time instead
        of every group's (a round's 100 float64 copies of an update at K = 10).
        """
        check_groups(groups)
        return [
            combined(g, answer_group(group, self._run_query), combine)
            for g, group in enumerate(groups)
        ]

    def _admit(self, query: Query) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """``query`` validated as the single-query methods validate it: (sorted members, their
        integer coefficients, denominator), or :class:`QueryRefused`."""
        if query.is_subset:
            members = self._validate(query.coefficients)
            return members, (1,) * len(members), 1
        coefficients, denominator = query.coefficients, query.denominator
        if not isinstance(denominator, int) or denominator < 1:
            raise QueryRefused(
                f"query refused: denominator must be an integer >= 1, got {denominator!r}"
            )
        bad = {c: v for c, v in coefficients.items() if not isinstance(v, (int, np.integer))}
        if bad:
            raise QueryRefused(f"query refused: coefficients must be integers, got {bad}")
        unknown = sorted(int(c) for c in coefficients if int(c) not in self._clients)
        if unknown and self._round is not None:
            raise QueryRefused(
                f"query refused: clients {unknown} are not registered for round {self._round}"
            )
        nonzero = {int(c): int(v) for c, v in coefficients.items() if v != 0}
        members = self._validate(nonzero)
        coefs = tuple(nonzero[c] for c in members)
        if not self.admits_combination(nonzero):  # the size passed _validate: the ring did not
            raise QueryRefused(
                f"query refused: sum of |coefficients| {sum(abs(v) for v in coefs)} exceeds what "
                f"the ring holds without overflow ({self.codec.max_members()}); use "
                "ring_bits=64 or lower frac_bits"
            )
        return members, coefs, denominator

    def admits_combination(self, coefficients: Mapping[int, int]) -> bool:
        """Whether a combination with these integer coefficients is one SA session as far as
        the coefficients decide (the members must still have submitted): nonzero ones on at
        least ``min_members`` clients, and their absolute sum within what the ring holds
        without overflow (a subset sum adds N + 1 values; a combination may add many more)."""
        weights = [abs(int(v)) for v in coefficients.values() if v != 0]
        return len(weights) >= self.min_members and sum(weights) <= self.codec.max_members()

    def _run_query(self, query: Query) -> np.ndarray:
        """One :class:`Query` through the single-query path it stands for."""
        if query.is_subset:
            return self.subset_sum_flat(list(query.coefficients))
        return self.combination_flat(query.coefficients, query.denominator)

    def _run(
        self, members: tuple[int, ...], coefs: tuple[int, ...], denominator: int
    ) -> np.ndarray:
        query_id = self._next_query
        start = time.perf_counter()
        self._authorize(members, coefs)
        total, moved, client_max = self._combine(members, coefs, query_id)
        self._answered(members, coefs)
        seconds = time.perf_counter() - start
        self._next_query += 1
        assert self._round is not None  # _authorize refused a query outside an open round
        self.log.append(
            QueryRecord(
                self._round,
                query_id,
                members,
                moved,
                seconds,
                client_max,
                coefs,
                denominator,
                self._session,
            )
        )
        for tap in self.answer_taps:
            tap(self.log[-1], total)
        return total

    def drop(self, client_id: int) -> None:
        """Simulate client ``client_id`` going offline for the rest of the round.

        Whether that matters depends on the backend: pairwise masking needs every member online
        at query time (the query fails with :class:`QueryFailed`); backends whose clients upload
        once at submission (two-server, plaintext) are unaffected.
        """
        if client_id not in self._clients:
            raise SecAggError(f"client_id: {client_id} is not registered for round {self._round}")
        self._offline.add(client_id)

    @property
    def offline(self) -> frozenset[int]:
        """Clients known to be offline in this round."""
        return frozenset(self._offline)

    def close_round(self) -> None:
        """End the round: every party forgets this round's updates, shares and keys."""
        if self._round is None:
            raise SecAggError("close_round: no round is open")
        self._drop_round()
        self._round, self._clients, self._submitted = None, (), set()

    # -- validation -------------------------------------------------------------------------
    def _validate(self, subset: Iterable[int] | Mapping[int, int]) -> tuple[int, ...]:
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
    def _combine(
        self, members: tuple[int, ...], coefs: tuple[int, ...], query_id: int
    ) -> tuple[np.ndarray, int, float]:
        """Run one query for ``sum_j coefs[j] Delta_members[j]``; return (result as float64,
        bytes moved, slowest client's seconds)."""

    def _authorize(self, members: tuple[int, ...], coefs: tuple[int, ...]) -> None:
        """Enforce the release policy before a query runs (here: in the server object, which
        only the plaintext reference relies on; real backends override this)."""
        if self._policy is not None:
            self._policy.check(dict(zip(members, coefs, strict=True)))

    def _answered(self, members: tuple[int, ...], coefs: tuple[int, ...]) -> None:
        """Record an answered query with whoever enforces the policy."""
        if self._policy is not None:
            self._policy.record(dict(zip(members, coefs, strict=True)))

    def _new_policy(self) -> SessionLedgers | None:
        return None if self.release_budget is None else SessionLedgers(self.release_budget)

    def _ledgers(self) -> list[SessionLedgers]:
        """Every release-policy holder of the backend (told which session is active)."""
        return [] if self._policy is None else [self._policy]

    @contextmanager
    def session(self, name: str) -> Iterator[None]:
        """Queries inside the ``with`` block belong to SA session ``name``: they are logged with
        it and counted in that session's release-policy ledger (see
        :class:`~fedattr.secagg.policy.SessionLedgers`)."""
        previous = self._session
        self._set_session(name)
        try:
            yield
        finally:
            self._set_session(previous)

    def _set_session(self, name: str) -> None:
        self._session = name
        for ledgers in self._ledgers():
            ledgers.active = name

    def leakage(self) -> dict[int, float]:
        """Joint leakage ``L_j`` of this round's answered queries in the active session, public
        ones included (from the query log)."""
        rows = [r for r in self.log if r.round == self._round and r.session in ("", self._session)]
        policy = ReleasePolicy()
        policy.reset(self._clients)
        for r in rows:
            policy.record(dict(zip(r.subset, r.coefficients, strict=True)))
        return policy.leakage()

    @abstractmethod
    def _drop_round(self) -> None:
        """Forget the round's state."""
