"""Two non-colluding aggregators with additive secret sharing (Prio-style).

Each client uploads once per round: a 32-byte seed to aggregator A, whose PRG expansion is A's
share, and ``enc(Delta) - PRG(seed)`` to aggregator B. Each share alone is uniform in the ring
and independent of the update, so neither aggregator learns anything by itself. For a query
``W`` each aggregator checks the threshold on its own and returns the sum of its shares over
``W``; the analyst adds the two partial sums to get ``enc(S(W))``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from .aggregator import SecureAggregator
from .errors import QueryRefused, SecAggError
from .fixedpoint import FixedPointCodec
from .policy import SessionLedgers
from .prg import PRG_NAMES, masks

if TYPE_CHECKING:
    from .config import SecAggConfig


class ShareHolder:
    """One aggregator: holds one additive share per client, answers thresholded partial sums."""

    def __init__(self, label: str, min_members: int) -> None:
        self.label = label
        self.min_members = min_members
        self.shares: dict[int, torch.Tensor] = {}
        self.policy: SessionLedgers | None = None

    def authorize(self, members: tuple[int, ...], coefs: tuple[int, ...]) -> None:
        """This aggregator's own threshold and release-policy checks."""
        if len(members) < self.min_members:
            raise QueryRefused(
                f"aggregator {self.label} refused: subset size {len(members)} is below "
                f"min_members={self.min_members}"
            )
        if self.policy is not None:
            try:
                self.policy.check(dict(zip(members, coefs, strict=True)))
            except QueryRefused as exc:
                raise QueryRefused(f"aggregator {self.label}: {exc}") from exc

    def partial_sum(
        self, members: tuple[int, ...], coefs: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """Ring combination of this aggregator's shares over ``members``, after its checks."""
        coefs = coefs or (1,) * len(members)
        self.authorize(members, coefs)
        return self.release(members, coefs)

    def release(self, members: tuple[int, ...], coefs: tuple[int, ...]) -> torch.Tensor:
        """Compute and record a combination already authorised by :meth:`authorize`."""
        total = torch.zeros_like(self.shares[members[0]])
        for j, c in zip(members, coefs, strict=True):
            # Integer scaling in the ring (wrapping multiplication by a signed coefficient).
            if c == 1:
                total += self.shares[j]
            else:
                total += self.shares[j] * c
        if self.policy is not None:
            self.policy.record(dict(zip(members, coefs, strict=True)))
        return total


class TwoServerAggregator(SecureAggregator):
    """Additive shares held by two non-colluding aggregators; neither alone learns anything."""

    name = "two-server"

    def __init__(
        self,
        min_members: int = 2,
        codec: FixedPointCodec | None = None,
        release_budget: float | None = None,
        prg: str = "chacha20",
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(min_members, codec, release_budget)
        self.device = torch.device(device)
        if prg not in PRG_NAMES:
            raise SecAggError(f"prg: unknown generator {prg!r}; allowed: {', '.join(PRG_NAMES)}")
        self.prg = prg
        self.aggregator_a = ShareHolder("A", min_members)
        self.aggregator_b = ShareHolder("B", min_members)

    @classmethod
    def _options(cls, config: SecAggConfig) -> dict:
        return {"prg": config.resolved_prg(), "device": config.torch_device()}

    def _receive(self, client_id: int, flat) -> None:
        encoded = self.codec.encode(flat, self.device)
        seed = os.urandom(32)  # fresh per client and round; never reused
        (mask,) = masks([seed], encoded.numel(), self.codec.dtype, self.prg, self.device)
        # Aggregator A receives only the seed; its own expansion of it is exactly `mask`, so the
        # simulation hands it the array instead of running the same PRG a second time.
        self.aggregator_a.shares[client_id] = mask
        self.aggregator_b.shares[client_id] = encoded - mask

    def _start_round(self, round_id, client_ids) -> None:
        # Each aggregator keeps its own ledger of released combinations.
        for holder in (self.aggregator_a, self.aggregator_b):
            holder.policy = self._new_policy()
            if holder.policy is not None:
                holder.policy.reset(client_ids)
                holder.policy.active = self._session
        self._policy = None

    def _ledgers(self):
        return [h.policy for h in (self.aggregator_a, self.aggregator_b) if h.policy is not None]

    def _authorize(self, members, coefs) -> None:
        self.aggregator_a.authorize(members, coefs)
        self.aggregator_b.authorize(members, coefs)

    def _answered(self, members, coefs) -> None:
        pass  # each aggregator records the release itself in partial_sum

    def _combine(self, members, coefs, query_id):
        # Both aggregators authorised the query in _authorize: neither computes unless both agree.
        part_a = self.aggregator_a.release(members, coefs)
        part_b = self.aggregator_b.release(members, coefs)
        moved = 2 * part_a.numel() * part_a.element_size()
        return self.codec.decode(part_a + part_b), moved, 0.0

    def _drop_round(self) -> None:
        self.aggregator_a.shares = {}
        self.aggregator_b.shares = {}
