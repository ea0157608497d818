"""Real-valued additive shares of client updates, held by two non-colluding servers (the
sealed mode's reading shares).

A client splits what it submits, ``u``, into ``(u + R, -R)`` with ``R`` Gaussian of a public
scale (drawn from a ChaCha20 keystream under a fresh seed) and sends one share to each server.
Real shares are needed because the servers apply a *real* linear map to them (the first-order
reading of an owner's detector, :mod:`fedattr.attribution.sealed`); ring shares would wrap.
They hide statistically, not perfectly: a server's share is the update plus Gaussian noise
``scale`` times larger than anything the update holds (see ``attribution.sealed.mask_scale``).

A :class:`ShareServer` answers one kind of opening: the sum of its shares over at least
``min_members`` of the round's clients (the round's aggregate). Asking it for fewer, a single
client's share above all, is refused (:class:`~.errors.QueryRefused`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Collection
from typing import Any

import numpy as np

from .errors import QueryRefused, SecAggError
from .prg import expand


def gaussian(count: int, scale: float, seed: bytes | None = None) -> np.ndarray:
    """``count`` independent ``N(0, scale^2)`` values (float64) from the ChaCha20 keystream
    under ``seed`` (fresh if none), by the Box-Muller transform of 53-bit uniforms."""
    if not (math.isfinite(scale) and scale >= 0):
        raise SecAggError(f"gaussian: scale must be a finite number >= 0, got {scale!r}")
    half = (count + 1) // 2
    bits = expand(seed or os.urandom(32), 2 * half, np.uint64).reshape(2, half)
    u1 = ((bits[0] >> np.uint64(11)).astype(np.float64) + 1.0) / 2.0**53  # (0, 1]
    u2 = (bits[1] >> np.uint64(11)).astype(np.float64) / 2.0**53
    radius = np.sqrt(-2.0 * np.log(u1))
    out = np.concatenate([radius * np.cos(2 * np.pi * u2), radius * np.sin(2 * np.pi * u2)])
    return scale * out[:count]


def split_update(
    flat: np.ndarray, scale: float, seed: bytes | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """A client's two reading shares of ``flat``: ``(flat + R, -R)``, ``R ~ N(0, scale^2)``."""
    mask = gaussian(flat.size, scale, seed)
    return np.asarray(flat, dtype=np.float64) + mask, -mask


class ShareServer:
    """One of the two servers: the round's reading shares, by client. It opens only sums over
    ``min_members`` or more of them and computes on each share only what its caller's
    function makes of it (kept here: see :meth:`apply`)."""

    def __init__(self, label: str, min_members: int) -> None:
        if min_members < 2:
            raise SecAggError(f"min_members: must be >= 2, got {min_members}")
        self.label, self.min_members = label, min_members
        self._shares: dict[int, np.ndarray] = {}
        self.received = 0
        """Shares received over the run."""
        self.opened: list[tuple[int, ...]] = []
        """The client sets whose sums this server opened, in order."""

    def receive(self, client: int, share: np.ndarray) -> None:
        """Keep ``client``'s share of the open round."""
        self._shares[client] = share
        self.received += 1

    @property
    def clients(self) -> list[int]:
        """Clients whose share this server holds in the open round."""
        return sorted(self._shares)

    def total(self, members: Collection[int]) -> np.ndarray:
        """This server's sum over ``members``, refused below ``min_members`` clients."""
        members = tuple(sorted(set(members)))
        if len(members) < self.min_members:
            raise QueryRefused(
                f"server {self.label} refused: opening {len(members)} client(s) "
                f"{list(members)} is below min_members={self.min_members}"
            )
        missing = [c for c in members if c not in self._shares]
        if missing:
            raise QueryRefused(f"server {self.label}: no share of client(s) {missing}")
        self.opened.append(members)
        return np.sum([self._shares[c] for c in members], axis=0)

    def apply(self, fn: Callable[[list[np.ndarray]], list[Any]]) -> dict[int, Any]:
        """``fn`` of every held share (in client order), by client: what this server computes
        on its shares (its results stay with it, as its shares do)."""
        clients = self.clients
        return dict(zip(clients, fn([self._shares[c] for c in clients]), strict=True))

    def close_round(self) -> None:
        """Forget the round's shares."""
        self._shares = {}
