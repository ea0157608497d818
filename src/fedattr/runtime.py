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


def set_threads() -> int:
    """Set torch's intra-op threads to ``FEDATTR_THREADS`` or :func:`available_cpus`.

    Torch otherwise sizes its pool from the machine's cores, which over-subscribes a container
    with a CPU quota; with several runs on one machine, give each ``FEDATTR_THREADS=1``.
    """
    import torch

    raw = os.environ.get("FEDATTR_THREADS", "")
    if raw:
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise UserError(f"FEDATTR_THREADS: must be an integer >= 1, got {raw!r}")
    else:
        n = available_cpus()
    torch.set_num_threads(n)
    return n
