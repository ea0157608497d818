"""Process-wide runtime settings: how many CPU threads torch uses, and how much memory is
left."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path

from .errors import UserError


def available_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        n = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; elsewhere what :mod:`platform` says): runs on
    two CPUs can differ in their floats, so a run's results say which one computed them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown"


def available_memory() -> int | None:
    """Bytes of memory this process may still take: the kernel's ``MemAvailable``, capped by
    a cgroup v2 memory limit; ``None`` when neither can be read."""
    found: list[int] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            found.append(max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def busy_cpus(load: float | None = None) -> int:
    """CPUs other work keeps busy: the 1-minute load average (``load``, else the machine's),
    counting a CPU from 0.75 of one (0 where unknown). The average decays over about a minute,
    so a job that ended a few seconds ago still reads 0.5-0.7: rounding that up halved the
    threads of a run started on an idle two-core machine."""
    try:
        if load is None:
            load = os.getloadavg()[0]
    except (AttributeError, OSError):  # pragma: no cover - not on Unix
        return 0
    return max(0, int(load + 0.25))


def default_threads() -> tuple[int, str | None]:
    """Threads for a run that was given none: the CPUs other work leaves free (at least one),
    and a note to show when that is fewer than the machine has. Two processes that each take
    every core slow each other several-fold; one that takes its share does not."""
    cpus = available_cpus()
    free = max(1, cpus - busy_cpus())
    if free >= cpus:
        return cpus, None
    note = (
        f"the machine is busy (load {os.getloadavg()[0]:.1f} on {cpus} CPUs): using "
        f"{free} thread{'s' if free > 1 else ''}; set FEDATTR_THREADS to choose"
    )
    return free, note


_NOTE: list[str] = []


def take_note() -> str | None:
    """The busy-machine note of the last :func:`set_threads`, once (a run shows it when it
    starts work, after its inputs were checked: a refusal stays one line)."""
    return _NOTE.pop() if _NOTE else None


def set_threads() -> tuple[int, str | None]:
    """Set torch's intra-op threads to ``FEDATTR_THREADS`` or :func:`default_threads`;
    returns the count and the note to show (``None``: nothing to say).

    Torch otherwise sizes its pool from the machine's cores, which over-subscribes a container
    with a CPU quota, or a machine other work already keeps busy; with several runs started on
    one machine at once, give each ``FEDATTR_THREADS=1``.
    """
    import torch

    raw = os.environ.get("FEDATTR_THREADS", "")
    note = None
    if raw:
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise UserError(f"FEDATTR_THREADS: must be an integer >= 1, got {raw!r}")
    else:
        n, note = default_threads()
    torch.set_num_threads(n)
    _NOTE.clear()
    if note:
        _NOTE.append(note)
    return n, note


def require_cuda(flag: str) -> None:
    """One line naming ``flag`` when it asks for ``cuda`` and torch sees no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        raise UserError(f"{flag}=cuda: torch sees no CUDA device here; allowed: cpu")


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or ``None`` where there is none (looked up once)."""
    name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


def release_memory() -> bool:
    """Hand memory freed by the process back to the operating system (glibc's
    ``malloc_trim``); ``False`` where there is no glibc (nothing done).

    Torch's CPU tensors of a few MB come from malloc's heap, and glibc keeps what they free:
    after one SmolLM2 training step (vocabulary-sized logits, 30 layers of activations) a
    process held 4.0 GB of which 1.0 GB was live. Called between stages and clients, this
    keeps the next stage's peak at what it really uses; per allocation (a fixed mmap
    threshold) it would cost training a third of its speed.

    On a GPU, the blocks torch's caching allocator keeps for no tensor are released too: of two
    runs sharing an H100, one ran out of memory while the other held 45.7 GB."""
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class PeakMemory:
    """Peak resident memory per stage: Linux's high-water mark (``VmHWM``), reset at each stage
    through ``/proc/self/clear_refs``; elsewhere the process's lifetime peak
    (``getrusage``), which only grows."""

    def __init__(self) -> None:
        self.resettable = self._reset()

    @staticmethod
    def _reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def start(self) -> None:
        """Begin a stage (the peak is reset where it can be)."""
        if self.resettable:
            self._reset()

    def peak_gb(self) -> float:
        """The peak since :meth:`start` (or since the process started), in GB (1e9 bytes)."""
        if self.resettable:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024 / 1e9
        import resource

        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux, bytes on macOS
        return kb * (1 if sys.platform == "darwin" else 1024) / 1e9
