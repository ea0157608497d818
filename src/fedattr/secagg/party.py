"""One client's side of pairwise masking with remote parties: :class:`MaskingParty`.

The protocol is :mod:`~fedattr.secagg.pairwise_mask`'s (X25519 keys per round, HKDF pair
seeds bound to (round, query id), masks that cancel only in the query's sum); what changes is
where the parties live. A party holds its update, its private key and its own release-policy
ledger, and its state is plain data (:meth:`MaskingParty.state`), so a client whose process
restarts between messages (a Flower ClientApp) carries it in its node's state.

Before answering a :class:`~fedattr.secagg.wire.QueryBatch`, every client checks every query of
the batch itself, whether it is a member or not: the subset is at least its own threshold, all
members take part in the round, and (hardened mode) the release policy over everything this
round has released admits it. A client that refuses, or does not answer, makes that query fail
with nothing released. The ledger counts a query when the client admits it, not when its sum
comes back: a member's masked upload is out once it answers, so a client cannot know that the
sum was never formed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

import numpy as np
import torch

from .errors import QueryRefused, SecAggError
from .fixedpoint import FixedPointCodec
from .pairwise_mask import MaskingClient
from .policy import SessionLedgers
from .prg import PRG_NAMES
from .wire import KEY_BYTES, BatchReply, PlannedQuery, QueryBatch


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
        if len(set(query.members)) != len(query.members):
            return f"a member is listed twice in {list(query.members)}"
        if len(query.members) < self.min_members:
            return (
                f"subset size {len(query.members)} is below this client's threshold "
                f"min_members={self.min_members}"
            )
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
            y = masking.masked_input(
                self.round, q.query_id, q.members, batch.public_keys, coefficient
            )
            reply.masked[q.query_id] = y.cpu().numpy()
            reply.seconds[q.query_id] = time.perf_counter() - start
        return reply

    # -- state for clients whose process restarts between messages --------------------------
    def state(self) -> tuple[str, bytes, np.ndarray]:
        """(JSON metadata, raw private key, flat update): everything :meth:`restore` needs."""
        if self.round is None or self._private is None or self._flat is None:
            raise SecAggError(f"client {self.client_id} holds no round to save")
        meta = {
            "client": self.client_id,
            "round": self.round,
            "participants": list(self.participants),
            "ledgers": None if self._ledgers is None else self._ledgers.to_dict(),
        }
        return json.dumps(meta), self._private, self._flat

    def restore(self, meta: str, private_key: bytes, flat: np.ndarray) -> None:
        """Continue the round saved by :meth:`state`."""
        d = json.loads(meta)
        if int(d["client"]) != self.client_id:
            raise SecAggError(f"saved state belongs to client {d['client']}, not {self.client_id}")
        if len(private_key) != KEY_BYTES:
            raise SecAggError("saved state: the private key must be 32 bytes")
        self.round, self.participants = int(d["round"]), tuple(int(c) for c in d["participants"])
        self._private, self._flat = bytes(private_key), np.asarray(flat, dtype=np.float64)
        ledgers = d["ledgers"]
        self._ledgers = None if ledgers is None else SessionLedgers.from_dict(ledgers)
