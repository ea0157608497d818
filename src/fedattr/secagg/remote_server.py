"""The server of pairwise masking with remote parties: :class:`RemoteMaskingServer`.

It never holds an update, only public keys, layouts and masked uploads, and it reaches the
parties (:class:`~fedattr.secagg.party.MaskingParty`) through a
:class:`~fedattr.secagg.transport.Transport`. A single query (the round's aggregate) and a whole
:meth:`~RemoteMaskingServer.run_queries` batch each cost one exchange: one
:class:`~fedattr.secagg.wire.QueryBatch` per client.

The server's release-policy ledger counts a query when it is *sent*, as the clients' ledgers do
(see :mod:`~fedattr.secagg.party`), so it plans only queries the clients will admit.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..updates import UpdateLayout
from .aggregator import SecureAggregator
from .batches import Combine, GroupAnswer, QueryGroup, Reduction, check_groups, combined
from .errors import QueryFailed, QueryRefused, SecAggError
from .fixedpoint import FixedPointCodec
from .queries import QueryRecord
from .transport import Transport
from .wire import KEY_BYTES, PlannedQuery, QueryBatch


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

    def register(self, client_id: int, public_key: bytes, layout: UpdateLayout | Mapping) -> None:
        """Client ``client_id`` trained and holds its update; ``layout`` is its
        :class:`~fedattr.updates.UpdateLayout` (or that layout's ``to_dict()``)."""
        self._check_submitter(client_id, "register")
        if len(public_key) != KEY_BYTES:
            raise SecAggError(f"client {client_id}: a public key must be 32 bytes")
        if not isinstance(layout, UpdateLayout):
            layout = UpdateLayout.from_dict(layout)
        if self._layout is not None and (layout.names, layout.shapes) != (
            self._layout.names,
            self._layout.shapes,
        ):
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
        batch = QueryBatch(self._round, list(queries), {c: self.public_keys[c] for c in involved})
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
            refused = [
                replies[m].refused[q.query_id]
                for m in q.members
                if q.query_id in replies[m].refused
            ]
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
            moved += KEY_BYTES * len(q.members) * (len(q.members) - 1)  # keys relayed
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
        outcome = self._exchange([PlannedQuery(query_id, members, coefs, self._session)])[query_id]
        self._raise(outcome, query_id)
        assert outcome.total is not None
        return self.codec.decode(outcome.total), outcome.moved, outcome.client_max

    def run_queries(
        self, groups: Sequence[QueryGroup], combine: Combine | None = None
    ) -> list[GroupAnswer]:
        """Every group's queries planned here (validation and the release policy, as
        :meth:`SecureAggregator.run_queries` would decide them), then answered in **one**
        exchange: one message per client for the whole batch.

        Differences from answering one query at a time, all on the side of releasing less: a
        group whose query fails or is refused stops there, but its later queries were already
        sent (and counted in the ledgers, as the clients count them); alternatives are chosen
        by the server's ledger, which the honest clients' ledgers agree with.
        """
        check_groups(groups)
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
                            (
                                PlannedQuery(self._next_query, members, coefs, self._session),
                                denominator,
                            )
                        )
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
        for g, ((answer, planned), group) in enumerate(zip(plans, groups, strict=True)):
            results = Reduction(group, answer.chosen or 0)
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
                total = self.codec.decode(outcome.total)
                results.add(total / denominator)
                self.log.append(
                    QueryRecord(
                        self._round,
                        q.query_id,
                        q.members,
                        outcome.moved,
                        share,
                        outcome.client_max,
                        q.coefficients,
                        denominator,
                        q.session,
                    )
                )
                for tap in self.answer_taps:
                    tap(self.log[-1], total)
            if answer.chosen is not None and results.count == len(planned):
                answer.results = results.done()
                combined(g, answer, combine)  # decoded a group at a time, reduced at once
            else:
                answer.chosen = None
            answer.seconds = share * len(planned)
        return [answer for answer, _ in plans]

    def _drop_round(self) -> None:
        self.public_keys = {}
