"""The sealed mode as an observer of the round engine: the coordinator. Every round, each
client's reading shares go to the two servers, which read them; at the end, the owners'
openings and verdicts. Where the parties live is :mod:`.parties`' business: in this process (a
simulation: the clients' submitted vectors are taken where the pool keeps them, a
:class:`~fedattr.fl.pool.PlaintextTap`, and split at once, as a client would before sending) or
on a runtime's nodes (:mod:`fedattr.flower.sealed`). What each party received and opened is
recorded per round (``results.json`` rounds, and ``parties.json`` in the run folder).
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
from ...updates import UpdateLayout
from ...watermarks.tail.laws import RowSubsets
from ..calibrated.weights import taper_weights
from ..config import AttributionConfig
from ..contract import Parties
from ..stouffer import AttributionReport
from .owner import OwnerOpenings, sealed_report
from .parties import LocalParties, Opening, RoundWork, check_laws, owner_keys
from .servers import first_order_parts, weighed


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
    """Runs the sealed mode over a run (see :mod:`fedattr.attribution.sealed`): the
    coordinator, which computes only public quantities and asks ``parties`` (by default all of
    them in this process, :class:`~.parties.LocalParties` over ``tap``) for the rest."""

    busy = False

    def __init__(
        self,
        config: AttributionConfig,
        scorer: Any,
        tap: PlaintextTap | None,
        scales: Callable[[Sequence[int]], dict[int, float]],
        min_members: int,
        name: str = "fedattr",
        primary: bool = True,
        marked: Collection[int] = (),
        folder: Path | None = None,
        parties: Parties | None = None,
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
        check_laws(list(self.laws.values()))  # one law: the random keys serve every owner
        keys_of = owner_keys(scorer)
        if parties is None:
            if tap is None:
                raise ValueError("SealedObserver: in-process parties read the pool's tap")
            parties = LocalParties(tap, self.read, self.laws, keys_of, min_members)
        elif parties.owners() != sorted(keys_of):
            # The level's Bonferroni counts the run's owners: every one needs its node.
            raise UserError(
                f"role: the run's owners are {sorted(keys_of)}; owner nodes registered for "
                f"{parties.owners()}"
            )
        self.parties: Parties = parties
        self.records: list[dict] = []
        self.timing = {"sa_s": 0.0, "scoring_s": 0.0}
        self.weights: dict[str, torch.Tensor] | None = None
        self.rounds_read: list[int] = []
        self.openings: dict[str, Any] = {}
        self.verdicts: Any = None

    @property
    def owner_openings(self) -> OwnerOpenings | None:
        """What the owners received, where they are in this process (after the verdict)."""
        return getattr(self.parties, "owner_openings", None)

    # -- every round ----------------------------------------------------------------------

    def round_closed(self, ctx: RoundContext) -> None:
        if self.config.calibrated.late_rounds == "skip" and self.rounds_read:
            ctx.progress(
                f"[round {ctx.round}/{ctx.rounds}] {self.name} (sealed): not read "
                "(attribution.calibrated.late_rounds = skip)"
            )
            return
        t0 = time.perf_counter()
        answered = list(ctx.answered)
        scales = self.scales(list(ctx.participants))
        layout = UpdateLayout.of(ctx.mean_update)
        expected = layout.flatten(ctx.mean_update)  # secure aggregation's mean (public)
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
        if not self.rounds_read:
            (common,) = self.read(ctx.reference, [layout.unflatten(expected)])
            centre = {p: weighed(d, p, self.weights, self.laws) for p, d in common.items()}
        work = RoundWork(
            round=ctx.round,
            previous=self.rounds_read[-1] if self.rounds_read else None,
            answered=answered,
            scales=scales,
            layout=layout,
            mask_sd=mask_sd(self.config.sealed.mask_scale, ctx.reference),
            reference=ctx.reference,
            weights=self.weights,
            centre=centre,
            frac_bits=self.config.sealed.frac_bits,
        )
        # The clients send their shares; the servers open the round's aggregate only (what
        # federated learning needs; the mean as the engine takes it) and read their shares.
        total = self.parties.round(work)
        mean = total / sum(scales[c] for c in answered)
        # The reading shares' aggregate must be secure aggregation's: a client that sent shares
        # of anything else shows here (float32 and fixed-point rounding aside).
        mismatch = float(np.abs(mean - expected).max() / max(1e-30, np.abs(expected).max()))
        if mismatch > AGGREGATE_TOLERANCE:
            ctx.progress(
                f"[round {ctx.round}/{ctx.rounds}] {self.name} (sealed) warning: the reading "
                f"shares' aggregate differs from secure aggregation's by {mismatch:.2g} "
                "(relative): a client sent shares of something else"
            )
        self.rounds_read.append(ctx.round)
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
                    "mask_sd": work.mask_sd,
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

    def run_finished(self, end: RunEnd) -> None:
        pass

    # -- the end: owners' openings and verdicts -------------------------------------------

    def _verdicts(self, truth: Mapping[int, bool] | None) -> AttributionReport:
        """The owners' verdicts (opened once) and the report for ``truth``."""
        clients = self.parties.clients()
        owners = self.parties.owners()
        K = max(1, len(set(clients) | set(truth or {})))
        level = self.config.calibrated.alpha / (K * max(1, len(owners)))
        if self.verdicts is None:
            n_keys = self.config.sealed.keys_for(level)
            opening = Opening(clients, n_keys, self.config.seed, self.config.sealed.frac_bits)
            self.verdicts, cost = self.parties.open(opening)
            self.openings = {
                **cost,
                "random_keys": n_keys,
                "smallest_p": 1.0 / (n_keys + 1),
            }
            self._write_parties(clients, owners, n_keys)
        return sealed_report(self.verdicts, truth, self.config.calibrated.alpha, level)

    def attack(self) -> dict[str, Any]:
        """The attack on server A's view measured by the parties (see
        :meth:`~.parties.LocalParties.attack`; empty where the truth is not at hand)."""
        return self.parties.attack()

    def summary(self) -> dict[str, Any]:
        """What ``results.json`` records of the mode (``sealed``): the openings at the end, the
        first-order reads, and the attack measured on server A's view."""
        return {
            "mask_scale": self.config.sealed.mask_scale,
            "share_reads": self.parties.reads,
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
            "parties": self.parties.state(),
            "records": self.records,
            "timing": self.timing,
            "weights": self.weights,
            "rounds_read": self.rounds_read,
        }

    def load(self, state: dict | None) -> None:
        if state is None:
            return
        self.parties.load(state["parties"])
        self.records, self.timing = state["records"], state["timing"]
        self.weights, self.rounds_read = state["weights"], list(state["rounds_read"])


def mask_sd(mask_scale: float, reference: Any) -> float:
    """The masks' standard deviation: ``mask_scale`` times the rms of the round's reference
    adapter (public: a client on a remote runtime computes it itself from the global state it
    trains from)."""
    return mask_scale * _rms(reference)
