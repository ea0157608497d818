"""Two non-colluding aggregators with additive secret sharing (Prio-style).

Each client uploads once per round: a 32-byte seed to aggregator A, whose PRG expansion is A's
share, and ``enc(Delta) - PRG(seed)`` to aggregator B. Each share alone is uniform in the ring
and independent of the update, so neither aggregator learns anything by itself. For a query
``W`` each aggregator checks the threshold on its own and returns the sum of its shares over
``W``; the analyst adds the two partial sums to get ``enc(S(W))``.
"""

from __future__ import annotations

import os

import numpy as np

from .base import SecureAggregator
from .errors import QueryRefused, SecAggError
from .fixedpoint import FixedPointCodec
from .prg import PRG_NAMES, expand


class ShareHolder:
    """One aggregator: holds one additive share per client, answers thresholded partial sums."""

    def __init__(self, label: str, min_members: int) -> None:
        self.label = label
        self.min_members = min_members
        self.shares: dict[int, np.ndarray] = {}

    def partial_sum(self, members: tuple[int, ...]) -> np.ndarray:
        """Ring sum of this aggregator's shares over ``members`` (its own threshold check)."""
        if len(members) < self.min_members:
            raise QueryRefused(
                f"aggregator {self.label} refused: subset size {len(members)} is below "
                f"min_members={self.min_members}"
            )
        total = self.shares[members[0]].copy()
        for j in members[1:]:
            total += self.shares[j]
        return total


class TwoServerAggregator(SecureAggregator):
    """Additive shares held by two non-colluding aggregators; neither alone learns anything."""

    name = "two-server"

    def __init__(
        self, min_members: int = 2, codec: FixedPointCodec | None = None, prg: str = "aes-ctr"
    ) -> None:
        super().__init__(min_members, codec)
        if prg not in PRG_NAMES:
            raise SecAggError(f"prg: unknown generator {prg!r}; allowed: {', '.join(PRG_NAMES)}")
        self.prg = prg
        self.aggregator_a = ShareHolder("A", min_members)
        self.aggregator_b = ShareHolder("B", min_members)

    def _receive(self, client_id: int, flat: np.ndarray) -> None:
        encoded = self.codec.encode(flat)
        seed = os.urandom(32)  # fresh per client and round; never reused
        mask = expand(seed, encoded.size, self.codec.dtype, self.prg)
        # Aggregator A receives only the seed; its own expansion of it is exactly `mask`, so the
        # simulation hands it the array instead of running the same PRG a second time.
        self.aggregator_a.shares[client_id] = mask
        self.aggregator_b.shares[client_id] = encoded - mask
        self.upload_bytes += 32 + encoded.nbytes

    def _sum(self, members, query_id):
        part_a = self.aggregator_a.partial_sum(members)
        part_b = self.aggregator_b.partial_sum(members)
        return self.codec.decode(part_a + part_b), part_a.nbytes + part_b.nbytes, 0.0

    def _drop_round(self) -> None:
        self.aggregator_a.shares = {}
        self.aggregator_b.shares = {}
