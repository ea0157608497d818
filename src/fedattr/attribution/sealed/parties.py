"""Where the sealed mode's parties live: the clients, the two reading servers, the dealer and
the owners.

:class:`~.observer.SealedObserver` is the coordinator: it asks the parties for each round's
work and for the owners' verdicts at the end, and computes only public things itself (the
masks' scale, the taper, round 1's centre from the round's aggregate). The parties answer
through :class:`~fedattr.attribution.contract.Parties`: :class:`LocalParties` plays them all
in this process (a simulation: the clients split what the pool holds);
:mod:`fedattr.flower.sealed` puts each on its own Flower node, every message between two of
them sealed to the recipient.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...errors import UserError
from ...fl.pool import PlaintextTap
from ...secagg.beaver import Dealer, shared_inner_products
from ...secagg.beaver import split as ring_split
from ...secagg.sealed import split_update
from ...updates import UpdateLayout, scale_update
from ...watermarks.nullkeys import RandomSubsetKeys
from ...watermarks.tail.laws import RowSubsets
from .owner import OwnerOpenings
from .servers import Read, ReadingServer


@dataclass
class RoundWork:
    """What the coordinator hands the parties for one round (all of it public, or the
    clients' own)."""

    round: int
    previous: int | None
    """The last round the servers read before this one (``None``: this is the first)."""
    answered: list[int]
    scales: dict[int, float]
    layout: UpdateLayout
    mask_sd: float
    reference: Any
    weights: Mapping[str, torch.Tensor]
    centre: Mapping[str, torch.Tensor] | None
    """Round 1's public centre (server A subtracts it); ``None`` after round 1."""
    frac_bits: int


@dataclass
class Verdicts:
    """What the owners publish: per owner, every client's rank p and standardised value."""

    clients: list[int]
    keys: int
    p: dict[str, np.ndarray] = field(default_factory=dict)
    Z: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class Opening:
    """What the coordinator asks of the parties at the end."""

    clients: list[int]
    keys: int
    """Public random keys per owner."""
    seed: int
    """Their seed (public)."""
    frac_bits: int


def opening_bytes(clients: int, cells: Mapping[str, int], keys: int) -> int:
    """Bytes the openings move, per owner, in 8-byte elements: the dealer's triple shares to
    both servers, the owner's key shares, both servers' Beaver openings, their result and
    random-key shares."""
    n = clients
    return sum(
        8 * (2 * (n * c + c + n) + 2 * c + 2 * (n * c + c) + 2 * n * (2 + keys))
        for c in cells.values()
    )


def random_keys(n: int, seed: int, law: RowSubsets, rows: int) -> RandomSubsetKeys:
    """The ``n`` public random keys (``seed``) every server reads its shares under: the
    owners' law, ``rows`` rows (the largest owner part's)."""
    return RandomSubsetKeys(n, seed, rows, law.cols, law.m)


def server_random_values(
    servers: Sequence[ReadingServer], parts: Sequence[str], clients: Sequence[int], keys: Any
) -> list[list[torch.Tensor]]:
    """Each server's share of every client's values under the public random keys, per part
    (``[server][part] -> [clients, keys]``): what a server sends each owner. One pass of the keys
    for every block (keys are drawn as they are read)."""
    blocks = [torch.stack([s.W[c][p] for c in clients]) for s in servers for p in parts]
    values = keys.values_many(blocks)
    return [values[i * len(parts) : (i + 1) * len(parts)] for i in range(len(servers))]


def owner_statistics(
    name: str,
    clients: list[int],
    n_keys: int,
    inner: Sequence[torch.Tensor],
    random: Sequence[torch.Tensor],
    l1: Sequence[np.ndarray],
    key: torch.Tensor,
    frac_bits: int,
) -> tuple[OwnerOpenings, np.ndarray, np.ndarray]:
    """What owner ``name`` makes of the two servers' shares (``inner``: ring shares of its
    key's values; ``random``: random-key values; ``l1``: their L1 bounds): its openings and
    what it publishes, each client's rank p and standardised value."""
    openings = OwnerOpenings(clients, n_keys)
    openings.add_owner(
        name,
        inner[0] + inner[1],
        random[0] + random[1],
        int(key.sum()),
        frac_bits,
        np.asarray(l1[0]) + np.asarray(l1[1]),
        int(key.numel()),
    )
    p, Z = openings.statistics(name)
    return openings, p, Z


def expected_keys(config: Any, owners: int) -> int:
    """The random keys a run's verdict reads (``attribution.sealed``, sized to the per-pair
    level over ``fl.K`` clients and ``owners``): what a server checks the coordinator asks."""
    a = config.attribution
    return a.sealed.keys_for(a.calibrated.alpha / (config.fl.K * max(1, owners)))


def owner_keys(scorer: Any) -> dict[str, tuple[str, torch.Tensor]]:
    """Owner -> (the part that reads its documents, its key: the green mask) of a detector."""
    return {o: (part, G) for part in scorer.key_laws() for o, G in scorer.owner_keys(part).items()}


class LocalParties:
    """Every party in this process: the clients split what the pool holds (``tap``) as they
    would before sending; two :class:`ReadingServer` objects; a :class:`Dealer`; the owners'
    keys from the detector."""

    def __init__(
        self,
        tap: PlaintextTap,
        read: Read,
        laws: Mapping[str, RowSubsets],
        owner_keys: Mapping[str, tuple[str, torch.Tensor]],
        min_members: int,
    ) -> None:
        self.tap, self.read, self.laws = tap, read, dict(laws)
        self.keys_of = dict(owner_keys)
        self.servers = [ReadingServer(b, min_members, self.laws) for b in ("A", "B")]
        self.privacy: dict[int, dict[str, Any]] = {}
        """Client -> running sums for the simulation's attack on server A's view."""
        self.aggregates: list[np.ndarray] = []
        self.owner_openings: OwnerOpenings | None = None
        """What the owners received (after the verdict)."""

    def owners(self) -> list[str]:
        return sorted(self.keys_of)

    @property
    def reads(self) -> int:
        return sum(s.reads for s in self.servers)

    def clients(self) -> list[int]:
        return sorted(set(self.servers[0].W) & set(self.servers[1].W))

    def round(self, work: RoundWork) -> np.ndarray:
        missing = [c for c in work.answered if c not in self.tap.updates]
        if missing:
            raise RuntimeError(f"sealed mode: no submitted update of answering clients {missing}")
        for c in work.answered:
            flat = work.layout.flatten(scale_update(self.tap.updates[c], work.scales[c]))
            share_a, share_b = split_update(flat, work.mask_sd)
            self.servers[0].shares.receive(c, share_a)
            self.servers[1].shares.receive(c, share_b)
            self._observe_attack(c, flat, share_a)
        total = self.servers[0].shares.total(work.answered)
        total = total + self.servers[1].shares.total(work.answered)
        self.aggregates.append(total / sum(work.scales[c] for c in work.answered))
        for server in self.servers:
            server.read_round(self.read, work.reference, work.layout, work.weights, work.centre)
            server.check_fits(work.frac_bits)
            server.shares.close_round()
        return np.asarray(total)

    def _observe_attack(self, client: int, flat: np.ndarray, share: np.ndarray) -> None:
        """Running sums for the measurement of what server A's shares reveal (a simulation's:
        it reads the true update beside the share)."""
        acc = self.privacy.setdefault(client, {"rounds": 0, "true": 0.0, "share": 0.0})
        acc["rounds"] += 1
        acc["true"] = acc["true"] + flat
        acc["share"] = acc["share"] + share

    def open(self, opening: Opening) -> tuple[Verdicts, dict[str, Any]]:
        clients, frac = opening.clients, opening.frac_bits
        t0 = time.perf_counter()
        dealer = Dealer()
        owners = self.owners() if clients else []
        parts = [self.keys_of[o][0] for o in owners]
        first = self.servers[0].W[clients[0]] if clients else {}
        cells = {o: int(first[p].numel()) for o, p in zip(owners, parts, strict=True)}
        verdicts = Verdicts(clients, opening.keys)
        self.owner_openings = OwnerOpenings(clients, opening.keys)
        if owners:
            law = check_laws([self.laws[p] for p in parts])
            # Public random keys, drawn once for every owner's part (its first rows each).
            keys = random_keys(opening.keys, opening.seed, law, max(cells.values()) // law.cols)
            random = server_random_values(self.servers, parts, clients, keys)
            for j, owner in enumerate(owners):
                part, G = self.keys_of[owner]
                ring = [s.ring_shares(part, clients, frac) for s in self.servers]
                key = ring_split(G.reshape(-1).long())  # the owner shares its key
                inner, _ = shared_inner_products((ring[0], ring[1]), key, dealer)
                openings, verdicts.p[owner], verdicts.Z[owner] = owner_statistics(
                    owner,
                    clients,
                    opening.keys,
                    inner,
                    [random[0][j], random[1][j]],
                    [s.l1(part, clients) for s in self.servers],
                    G,
                    frac,
                )
                self.owner_openings.merge(openings)
        cost = {
            "opening_bytes": opening_bytes(len(clients), cells, opening.keys),
            "cells": cells,
            "triples_dealt": dealer.dealt,
            "seconds": time.perf_counter() - t0,
        }
        return verdicts, cost

    def attack(self) -> dict[str, Any]:
        """Attacks on server A's view of the run, each client's mean update estimated from
        what it saw, as relative errors (median and smallest over clients): ``prior``, the
        federation's mean update (public); ``shares``, its mean share scaled; ``prior+shares``,
        the prior plus the scaled share's departure from it; ``subspace``, the prior plus that
        departure projected on the span of the round aggregates (where updates mostly lie,
        which removes all but ``T`` dimensions of the masks' noise). Each scale is fitted on the
        truth: a bound on any attack of its form. A simulation's measurement."""
        if not self.privacy:
            return {}
        prior = np.mean(self.aggregates, axis=0)
        basis, _ = np.linalg.qr(np.stack(self.aggregates, axis=1))
        rel: dict[str, list[float]] = {
            "prior": [],
            "shares": [],
            "prior+shares": [],
            "subspace": [],
        }
        for acc in self.privacy.values():
            truth = acc["true"] / acc["rounds"]
            share = acc["share"] / acc["rounds"]
            norm = float(np.linalg.norm(truth)) or 1.0
            rel["prior"].append(float(np.linalg.norm(truth - prior)) / norm)
            guesses = {
                "shares": (0.0, share),
                "prior+shares": (prior, share - prior),
                "subspace": (prior, basis @ (basis.T @ (share - prior))),
            }
            for name, (base, x) in guesses.items():
                y = truth - base
                c = float(np.dot(x, y) / max(1e-300, float(np.dot(x, x))))
                rel[name].append(float(np.linalg.norm(y - c * x)) / norm)
        return {f"{k}_median": float(np.median(v)) for k, v in rel.items()} | {
            f"{k}_min": float(np.min(v)) for k, v in rel.items()
        }

    def state(self) -> dict:
        return {
            "servers": [s.state() for s in self.servers],
            "privacy": self.privacy,
            "aggregates": self.aggregates,
        }

    def load(self, state: dict) -> None:
        for server, saved in zip(self.servers, state["servers"], strict=True):
            server.load(saved)
        self.privacy, self.aggregates = state["privacy"], state["aggregates"]


def check_laws(laws: Sequence[RowSubsets]) -> RowSubsets:
    """The one key law every owner's part shares (the random keys serve them all)."""
    first = laws[0]
    if any((w.cols, w.m) != (first.cols, first.m) for w in laws):
        raise UserError("attribution.protocol.mode=sealed: owners' key laws must agree")
    return first
