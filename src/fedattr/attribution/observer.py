"""FedAttr as an observer of the round engine: every round's SA queries, then every score.

Several observers may watch one training run (e.g. ``M = 5`` and ``M = 10``), each with its own
:class:`FedAttr`, results and SA session (so one's release-policy ledger does not spend the
other's budget). The first one (``primary``) is the run's headline result.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Executor, Future
from typing import Any

import numpy as np

from ..fl.pool import PlaintextTap
from ..fl.server import Observer, RoundContext, RunEnd
from ..updates import scale_update
from .design import own_update_design
from .protocol import FedAttr
from .records import Estimate, RoundEstimates


class AttributionObserver(Observer):
    """Runs :class:`FedAttr` on each round while SA still holds the updates.

    With ``background`` (an executor; one worker, shared by every observer that reads the
    same model) the round's SA queries run at once and its scoring is handed to the executor,
    so it runs while the clients train the next round; the engine collects it (:meth:`settle`)
    before the next round's attribution starts.
    """

    reads_sa: bool = True
    """Whether the estimates come from SA's answers (so are asked while the round is open)."""

    def __init__(
        self,
        fedattr: FedAttr,
        scorer: Any,
        name: str = "fedattr",
        primary: bool = True,
        marked: Collection[int] = (),
        background: Executor | None = None,
    ) -> None:
        self.fedattr, self.scorer, self.name, self.primary = fedattr, scorer, name, primary
        self.marked = set(marked)
        """Clients starred in progress lines (the simulation's watermarked ones)."""
        self.fedattr.use_scorer(scorer)  # right even for a finished run
        self.records: list[dict] = []
        """One ``RoundRecord.to_dict()`` per round."""
        self.timing = {"sa_s": 0.0, "scoring_s": 0.0}
        self.background = background
        self._pending: tuple[RoundContext, Future] | None = None
        self._asked: RoundEstimates | None = None

    def round_opened(self, ctx: RoundContext) -> None:
        self.settle()
        if not self.reads_sa:
            return
        t0 = time.perf_counter()
        with ctx.timing.watch("sa_s"):
            self._asked = self._estimates(ctx)
        t1 = time.perf_counter()
        self.timing["sa_s"] += t1 - t0
        if self.primary:
            ctx.timing.add("sa_s", t1 - t0)

    def round_closed(self, ctx: RoundContext) -> None:
        # Scored once SA has closed the round: the masked updates it held (a 7.4M-coordinate
        # update per client in SmolLM2) are freed before the vocabulary-sized reads begin.
        estimates = self._asked if self.reads_sa else self._estimates(ctx)
        self._asked = None
        if estimates is None:
            return
        if self.background is not None:
            self._pending = (ctx, self.background.submit(self._score, ctx, estimates, None))
            return
        steps = ctx.progress.steps(
            len(estimates.estimates), f"round {ctx.round} {self.name} scoring", lines=False
        )
        with ctx.timing.watch("scoring_s"):
            record, seconds = self._score(
                ctx, estimates, lambda r: steps.step(f"client {r.target}")
            )
        steps.close()
        self._record(ctx, record, seconds)

    def _estimates(self, ctx: RoundContext) -> RoundEstimates:
        """Every target's estimate of the open round, through SA queries only."""
        with ctx.sa.session(self.name):
            return self.fedattr.query_round(ctx.round, ctx.sa)

    @property
    def busy(self) -> bool:
        return self._pending is not None

    def settle(self) -> None:
        if self._pending is not None:
            (ctx, job), self._pending = self._pending, None
            self._record(ctx, *job.result())

    def run_finished(self, end: RunEnd) -> None:
        self.settle()

    def _score(self, ctx: RoundContext, estimates: Any, on_target: Any) -> tuple[Any, float]:
        t0 = time.perf_counter()
        record = self.fedattr.score_round(
            estimates,
            ctx.reference,
            self.scorer,
            apply=ctx.apply,
            center=ctx.mean_update,
            on_target=on_target,
        )
        return record, time.perf_counter() - t0

    def _record(self, ctx: RoundContext, record: Any, seconds: float) -> None:
        self.timing["scoring_s"] += seconds
        if self.primary:
            ctx.timing.add("scoring_s", seconds)
            ctx.timing.count("models_scored", record.models_scored)
        self.records.append(record.to_dict())
        line = " ".join(
            f"{r.target}{'*' if r.target in self.marked else ''}:{max(r.z.values()):+.1f}"
            for r in record.targets
            if r.z
        )
        for warning in record.warnings:
            ctx.progress(f"[round {ctx.round}/{ctx.rounds}] {self.name} warning: {warning}")
        for note in record.notes:
            ctx.progress(f"[round {ctx.round}/{ctx.rounds}] {self.name}: {note}")
        if not line:
            return
        star = " (* = watermarked)" if self.marked else ""
        ctx.progress(f"[round {ctx.round}/{ctx.rounds}] {self.name} max-statistic z{star}: {line}")

    def state(self) -> dict:
        self.settle()  # a checkpoint holds whole rounds only
        return {
            "fedattr": self.fedattr.state(),
            "records": self.records,
            "timing": self.timing,
        }

    def load(self, state: dict | None) -> None:
        if state is not None:
            self.fedattr.load(state["fedattr"])
            self.records = state["records"]
            self.timing = state["timing"]


class CeilingObserver(AttributionObserver):
    """The same statistic read on each client's *true* update instead of its SA estimate: what
    attribution would name with a perfect estimator, reported beside FedAttr's figure so that
    what SA estimation costs is visible (``ceiling = true``).

    It reads the plaintext updates (a :class:`~fedattr.fl.pool.PlaintextTap`), which a real
    deployment's server never holds: a measurement for simulations only, never a verdict.
    Every answering client is a target with a design of its own update alone (the identity
    design matrix), so the statistic runs exactly as on estimates whose cross-talk was undone.
    """

    reads_sa = False

    def __init__(
        self,
        fedattr: FedAttr,
        scorer: Any,
        tap: PlaintextTap,
        scales: Callable[[Sequence[int]], dict[int, float]],
        name: str = "ceiling",
        marked: Collection[int] = (),
    ) -> None:
        super().__init__(fedattr, scorer, name, primary=False, marked=marked)
        self.tap, self.scales = tap, scales

    def _estimates(self, ctx: RoundContext) -> RoundEstimates:
        answered = [c for c in ctx.answered if c in self.tap.updates]
        # The units of an estimate: what the client submitted to SA (its update times n * p_i).
        scales = self.scales(list(ctx.participants))
        layout = ctx.sa.layout  # known until the next round opens
        out = RoundEstimates(ctx.round, list(answered), layout)
        for c in answered:
            flat = layout.flatten(scale_update(self.tap.updates[c], scales[c]))
            flat = flat.astype(np.float32)  # as FedAttr's estimates (FedAttr.query_round)
            out.estimates.append(Estimate(c, flat, own_update_design(c, answered), 1, 0.0))
        return out
