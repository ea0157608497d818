"""The baselines as an observer of the round engine.

They read every client's plaintext update through the pool's :class:`~fedattr.fl.pool.PlaintextTap`
(which only an in-process pool offers): that is exactly the secure-aggregation violation the
tables mark them with.
"""

from __future__ import annotations

import time

from ..fl.pool import PlaintextTap
from ..fl.server import Observer, RoundContext, RunEnd
from .recorder import BaselineRecorder


class BaselineObserver(Observer):
    """Feeds :class:`BaselineRecorder` each round and runs the global-model test at the end."""

    name = "baselines"

    def __init__(self, recorder: BaselineRecorder, tap: PlaintextTap) -> None:
        self.recorder, self.tap = recorder, tap

    def round_opened(self, ctx: RoundContext) -> None:
        t0 = time.perf_counter()
        self.recorder.record_round(ctx.round, ctx.reference, self.tap.updates, ctx.mean_update)
        ctx.timing.add("baselines_s", time.perf_counter() - t0)

    def run_finished(self, end: RunEnd) -> None:
        t0 = time.perf_counter()
        self.recorder.global_test(end.reference)
        end.timing.add("baselines_s", time.perf_counter() - t0)

    def state(self) -> dict:
        return self.recorder.state()

    def load(self, state: dict | None) -> None:
        if state is not None:
            self.recorder.load(state)
