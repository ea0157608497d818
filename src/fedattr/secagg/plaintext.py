"""The reference backend: no cryptography, exact float64 sums."""

from __future__ import annotations

import numpy as np

from .aggregator import SecureAggregator


class PlaintextAggregator(SecureAggregator):
    """Reference backend that HOLDS EVERY UPDATE IN THE CLEAR (tests and baselines only)."""

    name = "plaintext"
    holds_plaintext = True

    def _start_round(self, round_id, client_ids) -> None:
        self._updates: dict[int, np.ndarray] = {}

    def _receive(self, client_id: int, flat: np.ndarray) -> None:
        # The same checks the masked backends' encoders make, so every backend refuses the
        # same updates with the same message.
        self.codec.check(flat)
        self._updates[client_id] = flat

    def _combine(self, members, coefs, query_id):
        total = np.zeros_like(self._updates[members[0]])
        for j, c in zip(members, coefs, strict=True):
            total += c * self._updates[j]
        return total, total.nbytes * len(members), 0.0

    def _drop_round(self) -> None:
        self._updates = {}
