"""How the server of remote pairwise masking reaches the parties: :class:`Transport`.

One :meth:`Transport.ask` is one exchange: the same :class:`~fedattr.secagg.wire.QueryBatch` to
every recipient, one :class:`~fedattr.secagg.wire.BatchReply` back from each that answered in
time. :class:`LocalTransport` keeps the parties in this process; the Flower runtime's link
(:mod:`fedattr.flower.link`) sends the batch as one message per node.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from .party import MaskingParty
from .wire import BatchReply, QueryBatch


class Transport(Protocol):
    """How the server reaches remote parties."""

    def ask(self, batch: QueryBatch, recipients: Sequence[int]) -> dict[int, BatchReply]:
        """Send ``batch`` to every recipient; replies of those that answered in time (a client
        missing from the result did not answer)."""


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
