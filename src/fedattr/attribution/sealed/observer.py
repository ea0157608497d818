"""The sealed mode as an observer of the round engine: every round, each client's reading
shares go to the two servers, which read them; at the end, the owners' openings and verdicts.

In the simulation the clients' submitted vectors are taken where the pool keeps them (a
:class:`~fedattr.fl.pool.PlaintextTap`) and split at once, as a client would before sending:
from the split on, only a server's own share reaches it. What each party received and opened
is recorded per round (``results.json`` rounds, and ``parties.json`` in the run folder).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import UserError
from ...fl.pool import PlaintextTap
from ...fl.server import Observer, RoundContext, RunEnd
from ...secagg.beaver import Dealer, shared_inner_products
from ...secagg.beaver import split as ring_split
from ...secagg.sealed import split_update
from ...updates import UpdateLayout, scale_update
from ...watermarks.nullkeys import RandomSubsetKeys
from ...watermarks.tail.laws import RowSubsets
from ..calibrated.weights import taper_weights
from ..config import AttributionConfig
from ..stouffer import AttributionReport
from .owner import OwnerOpenings, sealed_report
from .servers import ReadingServer, first_order_parts, weighed


def _rms(params: Any) -> float:
    """Root mean square over a parameter set's tensors (the reference adapter)."""
    tensors = list(params.values()) if isinstance(params, Mapping) else [params]
    total = sum(float((t.double() ** 2).sum()) for t in tensors)
    count = sum(t.numel() for t in tensors)
    return math.sqrt(total / max(1, count))


AGGREGATE_TOLERANCE = 1e-4
"""Relative difference above which the reading shares' aggregate is reported as not secure
aggregation's (float32 and fixed-point rounding stay near 1e-7)."""


class SealedAttribution:
    """What the run's results read of the sealed mode (the interface of
    :class:`~fedattr.attribution.protocol.FedAttr` that :func:`fedattr.pipeline.run._finish`
    uses): its configuration, null, report; it keeps no change in the clear."""

    null = "key-randomised"

    def __init__(self, config: AttributionConfig, report: Callable[[Any], AttributionReport]):
        self.config = config
        self.statistic = self
        self._report = report

    def changes(self) -> tuple[dict, dict]:
        """Nothing: no change is ever held in the clear."""
        return {}, {}

    def report(self, truth: Mapping[int, bool] | None = None) -> AttributionReport:
        return self._report(truth)


class SealedObserver(Observer):
    """Runs the sealed mode over a run (see :mod:`fedattr.attribution.sealed`)."""

    busy = False

    def __init__(
        self,
        config: AttributionConfig,
        scorer: Any,
        tap: PlaintextTap,
        scales: Callable[[Sequence[int]], dict[int, float]],
        min_members: int,
        name: str = "fedattr",
        primary: bool = True,
        marked: Collection[int] = (),
        folder: Path | None = None,
    ) -> None:
        if not callable(getattr(scorer, "first_order", None)) or not callable(
            getattr(scorer, "owner_keys", None)
        ):
            raise UserError(
                "attribution.protocol.mode=sealed: needs a detector with a first-order reading "
                "and owner keys (watermark.kind=kgw with watermark.detector=reading)"
            )
        laws = scorer.key_laws()
        if not laws or not all(isinstance(law, RowSubsets) for law in laws.values()):
            raise UserError(
                "attribution.protocol.mode=sealed: needs a detector whose keys are row subsets "
                "(KGW green lists)"
            )
        self.laws: dict[str, RowSubsets] = dict(laws)
        self.config, self.scorer, self.tap, self.scales = config, scorer, tap, scales
        self.name, self.primary, self.marked, self.folder = name, primary, set(marked), folder
        self.fedattr = SealedAttribution(config, self._verdicts)
        self.read = first_order_parts(scorer)
        self.servers = [ReadingServer(b, min_members, self.laws) for b in ("A", "B")]
        self.records: list[dict] = []
        self.timing = {"sa_s": 0.0, "scoring_s": 0.0}
        self.weights: dict[str, torch.Tensor] | None = None
        self.rounds_read = 0
        self.privacy: dict[int, dict[str, Any]] = {}
        """Client -> running sums for the simulation's attack on server A's view."""
        self.aggregates: list[np.ndarray] = []
        self.openings: dict[str, Any] = {}
        self.owner_openings: OwnerOpenings | None = None
        """What the owners received (after the verdict)."""

    # -- every round ----------------------------------------------------------------------

    def round_closed(self, ctx: RoundContext) -> None:
        if self.config.calibrated.late_rounds == "skip" and self.rounds_read >= 1:
            ctx.progress(
                f"[round {ctx.round}/{ctx.rounds}] {self.name} (sealed): not read "
                "(attribution.calibrated.late_rounds = skip)"
            )
            return
        t0 = time.perf_counter()
        missing = [c for c in ctx.answered if c not in self.tap.updates]
        if missing:
            raise RuntimeError(f"sealed mode: no submitted update of answering clients {missing}")
        answered = list(ctx.answered)
        scales = self.scales(list(ctx.participants))
        layout = UpdateLayout.of(ctx.mean_update)
        scale = self.config.sealed.mask_scale * _rms(ctx.reference)
        # The clients: each splits what it submits and sends one share to each server.
        for c in answered:
            flat = layout.flatten(scale_update(self.tap.updates[c], scales[c]))
            share_a, share_b = split_update(flat, scale)
            self.servers[0].shares.receive(c, share_a)
            self.servers[1].shares.receive(c, share_b)
            self._observe_attack(c, flat, share_a)
        # The servers open the round's aggregate only (what federated learning needs); the
        # mean as the engine takes it (the answering clients' scales sum to its divisor).
        total = self.servers[0].shares.total(answered) + self.servers[1].shares.total(answered)
        mean = total / sum(scales[c] for c in answered)
        self.aggregates.append(mean)
        # The reading shares' aggregate must be secure aggregation's: a client that sent shares
        # of anything else shows here (float32 and fixed-point rounding aside).
        expected = layout.flatten(ctx.mean_update)
        mismatch = float(np.abs(mean - expected).max() / max(1e-30, np.abs(expected).max()))
        if mismatch > AGGREGATE_TOLERANCE:
            ctx.progress(
                f"[round {ctx.round}/{ctx.rounds}] {self.name} (sealed) warning: the reading "
                f"shares' aggregate differs from secure aggregation's by {mismatch:.2g} "
                "(relative): a client sent shares of something else"
            )
        # Public, key-free quantities: the taper (round 1's reference, the base model); the
        # centre of round 1, the aggregate's change (its watermarked part reads against a
        # clean client's key: conservative).
        if self.weights is None:
            weights = taper_weights(
                self.scorer,
                self.scorer.observe(ctx.reference),
                self.config.calibrated.taper,
                self.config.calibrated.taper_from,
            )
            self.weights = {p: w.double().reshape(-1) for p, w in (weights or {}).items()}
        centre = None
        if self.rounds_read == 0:
            (common,) = self.read(ctx.reference, [layout.unflatten(mean)])
            centre = {p: weighed(d, p, self.weights, self.laws) for p, d in common.items()}
        for server in self.servers:
            server.read_round(self.read, ctx.reference, layout, self.weights, centre)
            server.check_fits(self.config.sealed.frac_bits)
            server.shares.close_round()
        self.rounds_read += 1
        seconds = time.perf_counter() - t0
        self.timing["scoring_s"] += seconds
        if self.primary:
            ctx.timing.add("scoring_s", seconds)
            ctx.timing.count("models_scored", 2 * len(answered) + (centre is not None))
        coords = int(layout.size)
        seen = {"shares": len(answered), "coordinates_each": coords, "opened": [answered]}
        self.records.append(
            {
                "round": ctx.round,
                "participants": list(ctx.participants),
                "sealed": {
                    # Two float64 shares a client (the secure-aggregation input aside).
                    "share_bytes": 16 * coords * len(answered),
                    "mask_sd": scale,
                    "aggregate_vs_sa": mismatch,
                    "seen": {
                        "server A": dict(seen),
                        "server B": dict(seen),
                        "public": {"aggregate": 1, "coordinates": coords},
                        "owners": {},
                    },
                },
            }
        )
        ctx.progress(
            f"[round {ctx.round}/{ctx.rounds}] {self.name} (sealed): {2 * len(answered)} shares "
            f"read by two servers in {seconds:.1f} s; opened: the aggregate"
        )

    def _observe_attack(self, client: int, flat: np.ndarray, share: np.ndarray) -> None:
        """Running sums for the measurement of what server A's shares reveal (a simulation's:
        it reads the true update beside the share)."""
        acc = self.privacy.setdefault(client, {"rounds": 0, "true": 0.0, "share": 0.0})
        acc["rounds"] += 1
        acc["true"] = acc["true"] + flat
        acc["share"] = acc["share"] + share

    def run_finished(self, end: RunEnd) -> None:
        pass

    # -- the end: owners' openings and verdicts -------------------------------------------

    def _verdicts(self, truth: Mapping[int, bool] | None) -> AttributionReport:
        """The owners' openings (computed once) and the report for ``truth``."""
        clients = sorted(set(self.servers[0].W) & set(self.servers[1].W))
        keys_of = {
            o: (part, G) for part in self.laws for o, G in self.scorer.owner_keys(part).items()
        }
        K = max(1, len(set(clients) | set(truth or {})))
        level = self.config.calibrated.alpha / (K * max(1, len(keys_of)))
        if self.owner_openings is None:
            self.owner_openings = self._open(clients, keys_of, level)
        return sealed_report(self.owner_openings, truth, self.config.calibrated.alpha, level)

    def _open(
        self, clients: list[int], keys_of: Mapping[str, tuple[str, torch.Tensor]], level: float
    ) -> OwnerOpenings:
        """What each owner receives: per client, its key's value (Beaver) and the random keys'
        values with their rounding bound."""
        n_keys = self.config.sealed.keys_for(level)
        frac = self.config.sealed.frac_bits
        t0 = time.perf_counter()
        openings = OwnerOpenings(clients, n_keys)
        dealer = Dealer()
        owners = sorted(keys_of) if clients else []
        cells = {o: int(self.servers[0].W[clients[0]][keys_of[o][0]].numel()) for o in owners}
        if owners:
            law = self.laws[keys_of[owners[0]][0]]
            if any((w.cols, w.m) != (law.cols, law.m) for w in self.laws.values()):
                raise UserError("attribution.protocol.mode=sealed: owners' key laws must agree")
            # Public random keys, drawn once for every owner's part (its first rows each).
            rows = max(cells.values()) // law.cols
            keys = RandomSubsetKeys(n_keys, self.config.seed, rows, law.cols, law.m)
            blocks = [
                torch.stack([s.W[c][keys_of[o][0]] for c in clients])
                for o in owners
                for s in self.servers
            ]
            values = keys.values_many(blocks)
            for j, owner in enumerate(owners):
                part, G = keys_of[owner]
                # Each server sends its share of every client's random-key values to the
                # owner, with the L1 norm of its share (their float rounding's bound).
                random = values[2 * j] + values[2 * j + 1]
                l1 = self.servers[0].l1(part, clients) + self.servers[1].l1(part, clients)
                ring = [s.ring_shares(part, clients, frac) for s in self.servers]
                key = ring_split(G.reshape(-1).long())  # the owner shares its key
                (z0, z1), _ = shared_inner_products((ring[0], ring[1]), key, dealer)
                openings.add_owner(owner, z0 + z1, random, int(G.sum()), frac, l1, cells[owner])
        n_c = len(clients)
        self.openings = {
            # Per owner, 8-byte elements: the dealer's triple shares to both servers, the
            # owner's key shares, both servers' openings, their result and random-key shares.
            "opening_bytes": sum(
                8 * (2 * (n_c * c + c + n_c) + 2 * c + 2 * (n_c * c + c) + 2 * n_c * (2 + n_keys))
                for c in cells.values()
            ),
            "cells": cells,
            "random_keys": n_keys,
            "smallest_p": 1.0 / (n_keys + 1),
            "triples_dealt": dealer.dealt,
            "seconds": time.perf_counter() - t0,
        }
        self._write_parties(clients, owners, n_keys)
        return openings

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

    def summary(self) -> dict[str, Any]:
        """What ``results.json`` records of the mode (``sealed``): the openings at the end, the
        first-order reads, and the attack measured on server A's view."""
        return {
            "mask_scale": self.config.sealed.mask_scale,
            "share_reads": sum(s.reads for s in self.servers),
            **self.openings,
            "attack_on_server_A": self.attack(),
        }

    def _write_parties(self, clients: list[int], owners: list[str], n_keys: int) -> None:
        if self.folder is None:
            return
        seen = {
            "rounds": [{"round": r["round"], **r["sealed"]["seen"]} for r in self.records],
            "end": {
                "server A": {"opened_to_each_owner": f"{len(clients)} x {n_keys + 1} values"},
                "server B": {"opened_to_each_owner": f"{len(clients)} x {n_keys + 1} values"},
                "dealer": {"triples_dealt": self.openings.get("triples_dealt", 0)},
                **{
                    f"owner {o}": {
                        "received": f"per client: its value under the owner's key and under "
                        f"{n_keys} public random keys",
                        "clients": clients,
                    }
                    for o in owners
                },
            },
            "attack_on_server_A": self.attack(),
        }
        Path(self.folder, "parties.json").write_text(json.dumps(seen, indent=1))

    # -- checkpoints ----------------------------------------------------------------------

    def state(self) -> dict:
        return {
            "servers": [s.state() for s in self.servers],
            "records": self.records,
            "timing": self.timing,
            "weights": self.weights,
            "rounds_read": self.rounds_read,
            "privacy": self.privacy,
            "aggregates": self.aggregates,
        }

    def load(self, state: dict | None) -> None:
        if state is None:
            return
        for server, saved in zip(self.servers, state["servers"], strict=True):
            server.load(saved)
        self.records, self.timing = state["records"], state["timing"]
        self.weights, self.rounds_read = state["weights"], state["rounds_read"]
        self.privacy, self.aggregates = state["privacy"], state["aggregates"]
