"""The messages of pairwise masking with remote parties, and their (de)serialisation.

A round's queries travel as **batches**: one :class:`QueryBatch` per client holding every
planned query (public: member ids and integer coefficients, as the query log already records)
and the public keys it needs; the client answers with one :class:`BatchReply`, a masked vector
for each query it is a member of and admits, and the reason for each it refuses.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

KEY_BYTES = 32
"""Length of a raw X25519 key, public or private, as it travels and is stored."""


@dataclass(frozen=True)
class PlannedQuery:
    """One query of a batch: ``sum_j coefficients[j] * Delta_members[j]`` in the ring."""

    query_id: int
    members: tuple[int, ...]
    coefficients: tuple[int, ...]
    session: str = ""

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {
            "id": self.query_id,
            "members": list(self.members),
            "coefficients": list(self.coefficients),
            "session": self.session,
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> PlannedQuery:
        """Inverse of :meth:`to_dict`."""
        return cls(
            int(d["id"]),
            tuple(int(m) for m in d["members"]),
            tuple(int(c) for c in d["coefficients"]),
            str(d.get("session", "")),
        )


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
