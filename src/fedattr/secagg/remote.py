"""Pairwise-mask secure aggregation with every client in its own process or machine.

The protocol is :mod:`~fedattr.secagg.pairwise_mask`'s (X25519 keys per round, HKDF pair
seeds bound to (round, query id), masks that cancel only in the query's sum); what changes is
where the parties live. A :class:`MaskingParty` is one client's side: it holds its update, its
private key and its own release-policy ledger, and its state is a plain dict, so a client whose
process restarts between messages (a Flower ClientApp) carries it in its node's state. A
:class:`RemoteMaskingServer` is the server: it never holds an update, only public keys and
masked uploads, and it reaches the parties through a :class:`Transport`.

A round's queries travel as **batches**: one message per client holding every planned query
(public: member ids and integer coefficients, as the query log already records) and the public
keys it needs; the client answers each query it is a member of with one masked vector. Before
answering, every client checks every query of the batch itself, whether it is a member or not:
the subset is at least its own threshold, all members take part in the round, and (hardened
mode) the release policy over everything this round has released admits it. A client that
refuses, or does not answer, makes that query fail with nothing released.

Ledgers on both sides count a query when it is *sent*, not when its sum comes back: a member's
masked upload is out once it answers, so a client cannot know that the sum was never formed.
The server keeps the same ledger to plan only queries the clients will admit.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from ..updates import UpdateLayout
from .base import GroupAnswer, QueryGroup, QueryRecord, SecureAggregator
from .errors import QueryFailed, QueryRefused, SecAggError
from .fixedpoint import FixedPointCodec
from .pairwise_mask import MaskingClient
from .policy import SessionLedgers
from .prg import PRG_NAMES

_KEY_BYTES = 32


@dataclass(frozen=True)
class PlannedQuery:
    """One query of a batch: ``sum_j coefficients[j] * Delta_members[j]`` in the ring."""

    query_id: int
    members: tuple[int, ...]
    coefficients: tuple[int, ...]
    session: str = ""

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"id": self.query_id, "members": list(self.members),
                "coefficients": list(self.coefficients), "session": self.session}  # fmt: skip

    @classmethod
    def from_dict(cls, d: Mapping) -> PlannedQuery:
        """Inverse of :meth:`to_dict`."""
        return cls(int(d["id"]), tuple(int(m) for m in d["members"]),
                   tuple(int(c) for c in d["coefficients"]), str(d.get("session", "")))  # fmt: skip


@dataclass
class QueryBatch:
    """What the server sends every recipient of one exchange."""

    round: int
    queries: list[PlannedQuery]
    public_keys: dict[int, bytes]
    """Public key of every member of the batch's queries."""

    def plan_json(self) -> str:
        """The queries as one JSON string (for message formats with flat values only)."""
        return json.dumps([q.to_dict() for q in self.queries])

    @staticmethod
    def queries_from_json(text: str) -> list[PlannedQuery]:
        """Inverse of :meth:`plan_json`."""
        return [PlannedQuery.from_dict(q) for q in json.loads(text)]


@dataclass
class BatchReply:
    """One client's answer to a :class:`QueryBatch`."""

    masked: dict[int, np.ndarray] = field(default_factory=dict)
    """Query id -> the client's masked ring vector."""
    refused: dict[int, str] = field(default_factory=dict)
    """Query id -> why this client refused it (only queries it is a member of)."""
    seconds: dict[int, float] = field(default_factory=dict)
    """Query id -> the client's own computation time for its upload."""


class Transport(Protocol):
    """How the server reaches remote parties."""

    def ask(self, batch: QueryBatch, recipients: Sequence[int]) -> dict[int, BatchReply]:
        """Send ``batch`` to every recipient; replies of those that answered in time (a client
        missing from the result did not answer)."""


class MaskingParty:
    """One client's side of remote pairwise masking (its own key, update, threshold, ledger).

    ``min_members`` is the client's own threshold: it refuses smaller subsets whatever the
    server asks. ``release_budget`` (nats; ``None``: no policy) is the client's release policy.
    """

    def __init__(
        self,
        client_id: int,
        codec: FixedPointCodec,
        prg: str = "chacha20",
        min_members: int = 2,
        release_budget: float | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if prg not in PRG_NAMES:
            raise SecAggError(f"prg: unknown generator {prg!r}; allowed: {', '.join(PRG_NAMES)}")
        self.client_id, self.codec, self.prg = int(client_id), codec, prg
        self.min_members, self.release_budget = int(min_members), release_budget
        self.device = torch.device(device)
        self.round: int | None = None
        self.participants: tuple[int, ...] = ()
        self._private: bytes | None = None
        self._flat: np.ndarray | None = None
        self._ledgers: SessionLedgers | None = None

    def start_round(self, round_id: int, participants: Sequence[int], flat: np.ndarray) -> bytes:
        """Hold this round's (scaled, flattened) update under a fresh key pair; returns the
        public key for the server to relay."""
        if self.client_id not in participants:
            raise SecAggError(f"client {self.client_id} is not among the round's participants")
        self.codec.check(flat)
        masking = MaskingClient(self.client_id, self.codec, self.prg, self.device)
        self.round, self.participants = int(round_id), tuple(int(c) for c in participants)
        self._private, self._flat = masking.private_key, np.asarray(flat, dtype=np.float64)
        self._ledgers = None
        if self.release_budget is not None:
            self._ledgers = SessionLedgers(self.release_budget)
            self._ledgers.reset(self.participants)
        return masking.public_key

    def _reason(self, query: PlannedQuery) -> str | None:
        """Why this client refuses ``query`` (``None``: admitted), recording it if admitted."""
        if len(query.members) < self.min_members:
            return (f"subset size {len(query.members)} is below this client's threshold "
                    f"min_members={self.min_members}")  # fmt: skip
        strangers = sorted(set(query.members) - set(self.participants))
        if strangers:
            return f"clients {strangers} do not take part in round {self.round}"
        if self._ledgers is not None:
            rows = dict(zip(query.members, query.coefficients, strict=True))
            self._ledgers.active = query.session
            try:
                self._ledgers.check(rows)
            except QueryRefused as exc:
                return str(exc)
            self._ledgers.record(rows)
        return None

    def answer(self, batch: QueryBatch) -> BatchReply:
        """Check every query of ``batch`` in order; mask this client's input for each admitted
        query it is a member of."""
        reply = BatchReply()
        if self.round is None or batch.round != self.round or self._flat is None:
            for q in batch.queries:
                if self.client_id in q.members:
                    reply.refused[q.query_id] = (
                        f"client {self.client_id} holds no update for round {batch.round}"
                    )
            return reply
        masking = MaskingClient(self.client_id, self.codec, self.prg, self.device, self._private)
        masking.hold(self._flat)
        for q in batch.queries:
            reason = self._reason(q)
            if self.client_id not in q.members:
                continue
            if reason is not None:
                reply.refused[q.query_id] = f"client {self.client_id} refused: {reason}"
                continue
            start = time.perf_counter()
            coefficient = q.coefficients[q.members.index(self.client_id)]
            y = masking.masked_input(self.round, q.query_id, q.members, batch.public_keys,
                                     coefficient)  # fmt: skip
            reply.masked[q.query_id] = y.cpu().numpy()
            reply.seconds[q.query_id] = time.perf_counter() - start
        return reply

    # -- state for clients whose process restarts between messages --------------------------
    def state(self) -> tuple[str, bytes, np.ndarray]:
        """(JSON metadata, raw private key, flat update): everything :meth:`restore` needs."""
        if self.round is None or self._private is None or self._flat is None:
            raise SecAggError(f"client {self.client_id} holds no round to save")
        meta = {
            "client": self.client_id, "round": self.round,
            "participants": list(self.participants),
            "ledgers": None if self._ledgers is None else self._ledgers.to_dict(),
        }  # fmt: skip
        return json.dumps(meta), self._private, self._flat

    def restore(self, meta: str, private_key: bytes, flat: np.ndarray) -> None:
        """Continue the round saved by :meth:`state`."""
        d = json.loads(meta)
        if int(d["client"]) != self.client_id:
            raise SecAggError(f"saved state belongs to client {d['client']}, not {self.client_id}")
        if len(private_key) != _KEY_BYTES:
            raise SecAggError("saved state: the private key must be 32 bytes")
        self.round, self.participants = int(d["round"]), tuple(int(c) for c in d["participants"])
        self._private, self._flat = bytes(private_key), np.asarray(flat, dtype=np.float64)
        ledgers = d["ledgers"]
        self._ledgers = None if ledgers is None else SessionLedgers.from_dict(ledgers)


@dataclass
class _Outcome:
    total: torch.Tensor | None
    missing: tuple[int, ...] = ()
    refused: str | None = None
    moved: int = 0
    client_max: float = 0.0


class RemoteMaskingServer(SecureAggregator):
    """The server of pairwise masking with remote clients: public keys and masked sums only.

    Clients train where they are and :meth:`register` their public key and update layout (no
    update ever reaches this object). Single queries (the round's aggregate) and whole
    :meth:`run_queries` batches each cost one :class:`Transport` exchange.
    """

    name = "pairwise-mask"

    def __init__(
        self,
        transport: Transport,
        min_members: int = 2,
        codec: FixedPointCodec | None = None,
        release_budget: float | None = None,
    ) -> None:
        super().__init__(min_members, codec, release_budget)
        self.transport = transport
        self.public_keys: dict[int, bytes] = {}
        self.exchanges = 0
        """Transport exchanges so far (each is one message per recipient)."""

    def register(
        self, client_id: int, public_key: bytes, layout: UpdateLayout | Mapping
    ) -> None:
        """Client ``client_id`` trained and holds its update; ``layout`` is its
        :class:`~fedattr.updates.UpdateLayout` (or that layout's ``to_dict()``)."""
        self._check_submitter(client_id, "register")
        if len(public_key) != _KEY_BYTES:
            raise SecAggError(f"client {client_id}: a public key must be 32 bytes")
        if not isinstance(layout, UpdateLayout):
            layout = UpdateLayout.from_dict(layout)
        if self._layout is not None and (layout.names, layout.shapes) != (
            self._layout.names, self._layout.shapes,
        ):  # fmt: skip
            raise SecAggError(
                f"client {client_id}: layout {layout.describe()} does not match this round's "
                f"layout {self._layout.describe()}"
            )
        self._layout = layout
        self.public_keys[client_id] = bytes(public_key)
        self._submitted.add(client_id)

    def _receive(self, client_id: int, flat: np.ndarray) -> None:
        raise SecAggError(
            "submit: remote clients keep their updates; they register() a public key instead"
        )

    def _authorize(self, members, coefs) -> None:
        # Check and count at once: clients count a query when they answer it (module doc).
        if self._policy is not None:
            rows = dict(zip(members, coefs, strict=True))
            self._policy.check(rows)
            self._policy.record(rows)

    def _answered(self, members, coefs) -> None:
        pass  # counted in _authorize

    def _exchange(self, queries: Sequence[PlannedQuery]) -> dict[int, _Outcome]:
        """One transport exchange for ``queries``; every query's outcome."""
        involved = sorted({m for q in queries for m in q.members})
        # With a release policy every client of the round sees every release (its ledger
        # needs all rows); otherwise only members are asked.
        pool = self._submitted if self._policy is not None else set(involved)
        recipients = sorted(c for c in pool if c not in self._offline)
        assert self._round is not None  # _authorize refused a query outside an open round
        batch = QueryBatch(
            self._round, list(queries), {c: self.public_keys[c] for c in involved}
        )
        replies = self.transport.ask(batch, recipients) if recipients else {}
        self.exchanges += 1
        for c in recipients:
            if c not in replies:
                self._offline.add(c)  # did not answer in time: offline for the round
        out: dict[int, _Outcome] = {}
        for q in queries:
            missing = tuple(m for m in q.members if m not in replies)
            if missing:
                out[q.query_id] = _Outcome(None, missing=missing)
                continue
            refused = [replies[m].refused[q.query_id] for m in q.members
                       if q.query_id in replies[m].refused]  # fmt: skip
            if refused:
                out[q.query_id] = _Outcome(None, refused="; ".join(refused))
                continue
            uploads = [replies[m].masked.get(q.query_id) for m in q.members]
            if any(u is None for u in uploads):
                absent = tuple(m for m, u in zip(q.members, uploads, strict=True) if u is None)
                out[q.query_id] = _Outcome(None, missing=absent)
                continue
            total = torch.from_numpy(np.array(uploads[0], dtype=self._ring_dtype()))
            for u in uploads[1:]:
                total += torch.from_numpy(np.asarray(u, dtype=self._ring_dtype()))
            moved = sum(int(u.nbytes) for u in uploads if u is not None)  # none is, here
            moved += _KEY_BYTES * len(q.members) * (len(q.members) - 1)  # keys relayed
            client_max = max(replies[m].seconds.get(q.query_id, 0.0) for m in q.members)
            out[q.query_id] = _Outcome(total, moved=moved, client_max=client_max)
        return out

    def _ring_dtype(self) -> np.dtype:
        return np.dtype(str(self.codec.dtype).removeprefix("torch."))

    @staticmethod
    def _raise(outcome: _Outcome, query_id: int) -> None:
        if outcome.missing:
            raise QueryFailed(
                f"query failed: members {list(outcome.missing)} did not answer; no sum was "
                "released",
                outcome.missing,
            )
        if outcome.refused is not None:
            raise QueryRefused(f"query {query_id} refused by its members: {outcome.refused}")

    def _combine(self, members, coefs, query_id):
        missing = tuple(m for m in members if m in self._offline)
        if missing:
            raise QueryFailed(
                f"query failed: members {list(missing)} are offline; no sum was released",
                missing,
            )
        outcome = self._exchange([PlannedQuery(query_id, members, coefs, self._session)])[
            query_id
        ]
        self._raise(outcome, query_id)
        assert outcome.total is not None
        return self.codec.decode(outcome.total), outcome.moved, outcome.client_max

    def run_queries(self, groups: Sequence[QueryGroup]) -> list[GroupAnswer]:
        """Every group's queries planned here (validation and the release policy, as
        :meth:`SecureAggregator.run_queries` would decide them), then answered in **one**
        exchange: one message per client for the whole batch.

        Differences from answering one query at a time, all on the side of releasing less: a
        group whose query fails or is refused stops there, but its later queries were already
        sent (and counted in the ledgers, as the clients count them); alternatives are chosen
        by the server's ledger, which the honest clients' ledgers agree with.
        """
        self._check_groups(groups)
        start = time.perf_counter()
        plans: list[tuple[GroupAnswer, list[tuple[PlannedQuery, int]]]] = []
        for group in groups:
            answer = GroupAnswer(results=None, chosen=None)
            planned: list[tuple[PlannedQuery, int]] = []
            for index, alternative in enumerate(group.alternatives):
                planned = []
                try:
                    for query in alternative:
                        members, coefs, denominator = self._admit(query)
                        if self._offline & set(members):
                            raise QueryFailed(
                                f"query failed: members {sorted(self._offline & set(members))} "
                                "are offline; no sum was released",
                                tuple(sorted(self._offline & set(members))),
                            )
                        self._authorize(members, coefs)
                        planned.append(
                            (PlannedQuery(self._next_query, members, coefs, self._session),
                             denominator)
                        )  # fmt: skip
                        self._next_query += 1
                except QueryRefused as exc:
                    answer.error = str(exc)
                    if planned:
                        break  # refused after part of the alternative: the group stops
                    answer.refusals += 1
                    continue
                except QueryFailed as exc:
                    answer.error, answer.missing = str(exc), tuple(exc.missing)
                    break
                answer.chosen = index
                break
            plans.append((answer, planned))
        queries = [q for _, planned in plans for q, _ in planned]
        outcomes = self._exchange(queries) if queries else {}
        share = (time.perf_counter() - start) / max(1, len(queries))
        for answer, planned in plans:
            results: list[np.ndarray] = []
            for q, denominator in planned:
                outcome = outcomes[q.query_id]
                try:
                    self._raise(outcome, q.query_id)
                except QueryFailed as exc:
                    answer.error, answer.missing = str(exc), tuple(exc.missing)
                    break
                except QueryRefused as exc:
                    answer.error = str(exc)
                    break
                assert outcome.total is not None and self._round is not None
                results.append(self.codec.decode(outcome.total) / denominator)
                self.log.append(QueryRecord(
                    self._round, q.query_id, q.members, outcome.moved, share, outcome.client_max,
                    q.coefficients, denominator, q.session,
                ))  # fmt: skip
            if answer.chosen is not None and len(results) == len(planned):
                answer.results = results
            else:
                answer.chosen = None
            answer.seconds = share * len(planned)
        return [answer for answer, _ in plans]

    def _drop_round(self) -> None:
        self.public_keys = {}


class LocalTransport:
    """Parties in this process (tests, and the reference the Flower runtime is checked
    against); ``silent`` clients never answer, like a node past its timeout."""

    def __init__(self, parties: Mapping[int, MaskingParty]) -> None:
        self.parties = dict(parties)
        self.silent: set[int] = set()
        self.messages = 0

    def ask(self, batch: QueryBatch, recipients: Sequence[int]) -> dict[int, BatchReply]:
        self.messages += len(recipients)
        return {c: self.parties[c].answer(batch) for c in recipients if c not in self.silent}
