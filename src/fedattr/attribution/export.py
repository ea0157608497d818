"""Scoring as the owner's step: what the server releases to corpus owners, round by round.

With ``attribution.scoring = "owner"`` the server holds no owner key. Each round it runs
FedAttr's phase 1 (SA queries only) and writes what the paper releases to the owner (the
reference ``w^{t-1}``, every target's estimate, the round's SA mean and a manifest with the
designs) into ``<run>/rounds/round-NNN/``, in the format of
:mod:`fedattr.attribution.round_folder`. An owner scores round folders with ``fedattr owner
score`` (:mod:`fedattr.owner.score`); ``fedattr attribute`` combines every owner's scores into
the run's results (:mod:`fedattr.attribution.offline`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

from ..errors import UserError
from ..fl.server import Observer, RoundContext
from .protocol import FedAttr
from .round_folder import round_dir, write_round, write_run


class ExportObserver(Observer):
    """FedAttr's phase 1 each round, then the round's release written for the owners; no
    scores (the server holds no key)."""

    def __init__(
        self, fedattr: FedAttr, run_dir: str | Path, run_config: Mapping, name: str = "fedattr"
    ) -> None:
        if fedattr.config.statistic != "calibrated":
            raise UserError(
                "attribution.scoring=owner: needs attribution.statistic=calibrated "
                "(owners return key statistics, not the paper's z)"
            )
        self.fedattr, self.run_dir, self.name = fedattr, Path(run_dir), name
        self.records: list[dict] = []
        self.timing = {"sa_s": 0.0, "scoring_s": 0.0}
        write_run(self.run_dir, run_config)

    def round_opened(self, ctx: RoundContext) -> None:
        t0 = time.perf_counter()
        with ctx.sa.session(self.name):
            estimates = self.fedattr.query_round(ctx.round, ctx.sa)
        seconds = time.perf_counter() - t0
        ctx.timing.add("sa_s", seconds)
        self.timing["sa_s"] += seconds
        folder = write_round(
            round_dir(self.run_dir, ctx.round),
            estimates,
            ctx.reference,
            ctx.mean_update,
            self.fedattr,
        )
        self.records.append(
            {
                "round": ctx.round,
                "participants": list(estimates.participants),
                "targets": [e.target for e in estimates.estimates],
                "dropouts": list(estimates.dropouts),
                "exported": str(folder.relative_to(self.run_dir)),
            }
        )
        ctx.progress(
            f"[round {ctx.round}/{ctx.rounds}] {len(estimates.estimates)} estimates "
            f"exported for the owners to {folder}"
        )

    def state(self) -> dict:
        return {"records": self.records, "timing": self.timing}

    def load(self, state: dict | None) -> None:
        if state is not None:
            self.records, self.timing = state["records"], state["timing"]
