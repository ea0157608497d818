"""Seconds, work and peak memory per stage of a run, carried across a resume."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from ..runtime import PeakMemory, release_memory


class DeviceProbe:
    """One CUDA device's peak allocated memory and how busy it is, read per stage.

    Busy: the share of time the device ran a kernel, as NVML reports it, sampled four times a
    second: through ``torch.cuda.utilization`` (which needs ``pynvml``) by a daemon thread,
    else from one ``nvidia-smi`` process streaming its readings (``-lms``: no process started
    per sample); ``None`` where neither can be read."""

    INTERVAL = 0.25

    def __init__(self, device: Any) -> None:
        import torch

        self.torch = torch
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.samples: list[tuple[float, float]] = []
        self.readable = False
        self._stop = threading.Event()
        self._smi: subprocess.Popen | None = None
        try:
            torch.cuda.utilization(self.index)
            target: Callable[[], None] | None = self._poll
        except Exception:  # no pynvml: nvidia-smi, if there is one
            target = self._stream if self._start_smi() else None
        if target is not None:
            self.readable = True
            threading.Thread(target=target, daemon=True, name="fedattr-gpu").start()

    def _poll(self) -> None:
        while not self._stop.wait(self.INTERVAL):
            try:
                value = float(self.torch.cuda.utilization(self.index))
            except Exception:  # a failed read: a gap in the samples
                continue
            self.samples.append((time.perf_counter(), value))

    def _start_smi(self) -> bool:
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return False
        try:  # by UUID: CUDA_VISIBLE_DEVICES renumbers torch's devices, not nvidia-smi's
            which = str(self.torch.cuda.get_device_properties(self.index).uuid)
            which = which if which.startswith("GPU-") else f"GPU-{which}"
        except Exception:
            which = str(self.index)
        command = [smi, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]
        command += ["-i", which, f"-lms={int(1000 * self.INTERVAL)}"]
        try:
            self._smi = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            )
        except OSError:
            return False
        return True

    def _stream(self) -> None:
        assert self._smi is not None and self._smi.stdout is not None
        for line in self._smi.stdout:
            try:
                self.samples.append((time.perf_counter(), float(line.strip())))
            except ValueError:  # "[N/A]" or a message: a gap
                continue

    def busy(self, since: float) -> float | None:
        """Mean utilisation (0..1) of the samples taken since ``since`` (``None``: none)."""
        if not self.readable:
            return None
        samples, self.samples = self.samples, []
        values = [u for t, u in samples if t >= since]
        return sum(values) / len(values) / 100 if values else None

    def peak_gb(self) -> float:
        """Peak memory allocated by torch since the last :meth:`reset` (GB, 1e9 bytes)."""
        return self.torch.cuda.max_memory_allocated(self.index) / 1e9

    def reset(self) -> None:
        """Start a new peak."""
        self.torch.cuda.reset_peak_memory_stats(self.index)

    def close(self) -> None:
        """Stop sampling."""
        self._stop.set()
        if self._smi is not None:
            self._smi.terminate()
            self._smi.wait()


class Stopwatch:
    """Seconds per stage (``train_s``, ``sa_s``, ``scoring_s``, ...), each stage's peak resident
    memory and the run's elapsed time, carried across a resume; with a CUDA ``device``, each
    stage's peak device memory and how busy the device was (:meth:`profile`)."""

    def __init__(
        self, stages: Sequence[str] = ("train_s", "sa_s", "scoring_s"), device: Any = None
    ) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(stages, 0.0)
        self.counts: dict[str, float] = {}
        """Work done per stage (``train_tokens``, ``teacher_documents``, ...), for throughput."""
        self.peaks: dict[str, float] = {}
        """Peak resident memory (GB) while each stage ran, keyed as :attr:`seconds` is."""
        self.device_peaks: dict[str, float] = {}
        """Peak device memory (GB) allocated while each stage ran (CUDA runs)."""
        self.busy_seconds: dict[str, float] = {}
        """Seconds each stage kept the device busy (utilisation times time; CUDA runs)."""
        self.busy_timed: dict[str, float] = {}
        """Seconds of each stage over which the device's utilisation was sampled."""
        self._memory = PeakMemory()
        self._device = DeviceProbe(device) if _is_cuda(device) else None
        self._open: list[str] = []
        self._start = time.perf_counter()
        self._last_fold = self._start
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
        now = time.perf_counter()
        if self._open:
            peak = self._memory.peak_gb()
            for stage in self._open:
                self.peaks[stage] = max(self.peaks.get(stage, 0.0), peak)
            if self._device is not None:
                device_peak = self._device.peak_gb()
                busy = self._device.busy(self._last_fold)
                for stage in self._open:
                    self.device_peaks[stage] = max(self.device_peaks.get(stage, 0.0), device_peak)
                    if busy is not None:
                        self.busy_seconds[stage] = self.busy_seconds.get(stage, 0.0) + busy * (
                            now - self._last_fold
                        )
                        self.busy_timed[stage] = self.busy_timed.get(stage, 0.0) + (
                            now - self._last_fold
                        )
        # What the last stage freed goes back first: the next stage's peak is its own.
        release_memory()
        self._memory.start()
        if self._device is not None:
            self._device.reset()
        self._last_fold = time.perf_counter()

    def profile(self) -> dict[str, dict[str, float | None]]:
        """Per stage (named without ``_s``): seconds and peak resident memory (GB); on a CUDA
        device also its peak allocated memory (GB) and how busy it was (0..1, the share of
        the stage's sampled time the device ran kernels; ``None`` where it could not be
        read)."""
        out: dict[str, dict[str, float | None]] = {}
        for stage, seconds in self.seconds.items():
            row: dict[str, float | None] = {
                "seconds": seconds,
                "peak_rss_gb": self.peaks.get(stage),
            }
            if self._device is not None or stage in self.device_peaks:
                row["device_peak_gb"] = self.device_peaks.get(stage)
                timed = self.busy_timed.get(stage, 0.0)
                row["device_busy"] = self.busy_seconds.get(stage, 0.0) / timed if timed else None
            out[stage.removesuffix("_s")] = row
        return out

    def close(self) -> None:
        """Stop the device's sampler (if any)."""
        if self._device is not None:
            self._device.close()

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
            "device_peaks": dict(self.device_peaks),
            "busy_seconds": dict(self.busy_seconds),
            "busy_timed": dict(self.busy_timed),
            "elapsed": self.elapsed(),
        }

    def load(self, state: Mapping) -> None:
        """Add a checkpoint's stage times and elapsed time to this session's."""
        for k, v in state["seconds"].items():
            self.add(k, v)
        for k, v in state.get("counts", {}).items():
            self.count(k, v)
        for k, v in state.get("peaks", {}).items():  # absent in older checkpoints
            self.peaks[k] = max(self.peaks.get(k, 0.0), v)
        for k, v in state.get("device_peaks", {}).items():  # absent in older ones
            self.device_peaks[k] = max(self.device_peaks.get(k, 0.0), v)
        for name in ("busy_seconds", "busy_timed"):
            mine = getattr(self, name)
            for k, v in state.get(name, {}).items():
                mine[k] = mine.get(k, 0.0) + v
        self._offset += state["elapsed"]


def _is_cuda(device: Any) -> bool:
    return device is not None and getattr(device, "type", None) == "cuda"


ATTRIBUTION_STAGES = ("sa_s", "scoring_s", "verdict_s")
"""FedAttr's own stages: its SA queries, the per-round reads, the final verdict (exact tails,
rank check)."""


def overhead(seconds: Mapping[str, float]) -> float:
    """FedAttr's overhead over FL training: the seconds of :data:`ATTRIBUTION_STAGES` (those a
    run recorded) over ``train_s``."""
    spent = sum(seconds.get(stage, 0.0) for stage in ATTRIBUTION_STAGES)
    return spent / max(seconds.get("train_s", 0.0), 1e-9)
