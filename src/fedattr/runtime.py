"""Process-wide runtime settings: how many CPU threads torch uses, and how much memory is
left."""

from __future__ import annotations

import os
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


def busy_cpus() -> int:
    """CPUs other work keeps busy: the 1-minute load average, rounded (0 where unknown)."""
    try:
        return max(0, round(os.getloadavg()[0]))
    except (AttributeError, OSError):  # pragma: no cover - not on Unix
        return 0


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
