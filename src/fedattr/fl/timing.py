"""Seconds, work and peak memory per stage of a run, carried across a resume."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from ..runtime import PeakMemory, release_memory


class Stopwatch:
    """Seconds per stage (``train_s``, ``sa_s``, ``scoring_s``, ...), each stage's peak resident
    memory and the run's elapsed time, carried across a resume."""

    def __init__(self, stages: Sequence[str] = ("train_s", "sa_s", "scoring_s")) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(stages, 0.0)
        self.counts: dict[str, float] = {}
        """Work done per stage (``train_tokens``, ``teacher_documents``, ...), for throughput."""
        self.peaks: dict[str, float] = {}
        """Peak resident memory (GB) while each stage ran, keyed as :attr:`seconds` is."""
        self._memory = PeakMemory()
        self._open: list[str] = []
        self._start = time.perf_counter()
        self._offset = 0.0

    @contextmanager
    def measure(self, stage: str) -> Iterator[None]:
        """Add the time spent in the ``with`` block to ``stage``, and its peak memory."""
        t0 = time.perf_counter()
        try:
            with self.watch(stage):
                yield
        finally:
            self.add(stage, time.perf_counter() - t0)

    @contextmanager
    def watch(self, stage: str) -> Iterator[None]:
        """Record the peak resident memory of the ``with`` block as ``stage``'s (the largest
        of its blocks). The high-water mark is reset as a block opens and closes, so a stage
        inside another counts toward both; where it cannot be reset (not Linux) every stage
        reads the process's peak so far, an upper bound. Call it from the thread that runs
        the stage: the mark is the whole process's."""
        self._fold()
        self._open.append(stage)
        try:
            yield
        finally:
            self._fold()
            self._open.remove(stage)

    def _fold(self) -> None:
        if self._open:
            peak = self._memory.peak_gb()
            for stage in self._open:
                self.peaks[stage] = max(self.peaks.get(stage, 0.0), peak)
        # What the last stage freed goes back first: the next stage's peak is its own.
        release_memory()
        self._memory.start()

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
            "peaks": dict(self.peaks),
            "elapsed": self.elapsed(),
        }

    def load(self, state: Mapping) -> None:
        """Add a checkpoint's stage times and elapsed time to this session's."""
        for k, v in state["seconds"].items():
            self.add(k, v)
        for k, v in state.get("counts", {}).items():
            self.count(k, v)
        for k, v in state.get("peaks", {}).items():  # absent in checkpoints before 2026-11-27
            self.peaks[k] = max(self.peaks.get(k, 0.0), v)
        self._offset += state["elapsed"]


ATTRIBUTION_STAGES = ("sa_s", "scoring_s", "verdict_s")
"""FedAttr's own stages: its SA queries, the per-round reads, the final verdict (exact tails,
rank check)."""


def overhead(seconds: Mapping[str, float]) -> float:
    """FedAttr's overhead over FL training: the seconds of :data:`ATTRIBUTION_STAGES` (those a
    run recorded) over ``train_s``."""
    spent = sum(seconds.get(stage, 0.0) for stage in ATTRIBUTION_STAGES)
    return spent / max(seconds.get("train_s", 0.0), 1e-9)
