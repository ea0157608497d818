"""Seconds and work per stage of a run, carried across a resume."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager


class Stopwatch:
    """Seconds per stage (``train_s``, ``sa_s``, ``scoring_s``, ...) and the run's elapsed time,
    carried across a resume."""

    def __init__(self, stages: Sequence[str] = ("train_s", "sa_s", "scoring_s")) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(stages, 0.0)
        self.counts: dict[str, float] = {}
        """Work done per stage (``train_tokens``, ``teacher_documents``, ...), for throughput."""
        self._start = time.perf_counter()
        self._offset = 0.0

    @contextmanager
    def measure(self, stage: str) -> Iterator[None]:
        """Add the time spent in the ``with`` block to ``stage``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, time.perf_counter() - t0)

    def add(self, stage: str, seconds: float) -> None:
        """Add ``seconds`` to ``stage``."""
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds

    def count(self, name: str, amount: float) -> None:
        """Add ``amount`` units of work to counter ``name``."""
        self.counts[name] = self.counts.get(name, 0.0) + amount

    def elapsed(self) -> float:
        """Seconds since the run started, earlier sessions of a resumed run included."""
        return time.perf_counter() - self._start + self._offset

    def state(self) -> dict:
        """For checkpoints."""
        return {
            "seconds": dict(self.seconds),
            "counts": dict(self.counts),
            "elapsed": self.elapsed(),
        }

    def load(self, state: Mapping) -> None:
        """Add a checkpoint's stage times and elapsed time to this session's."""
        for k, v in state["seconds"].items():
            self.add(k, v)
        for k, v in state.get("counts", {}).items():
            self.count(k, v)
        self._offset += state["elapsed"]
