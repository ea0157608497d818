"""An exclusive lock file, so that processes started together build a cached file once."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def file_lock(path: Path, waiting: Callable[[], None] | None = None) -> Iterator[bool]:
    """An exclusive lock on ``path`` (created if missing) for the ``with`` block; yields
    whether it holds one. ``waiting()`` is called once if another process holds it first (this
    one then waits for it). The lock is the operating system's (``fcntl.flock``): a process
    that dies drops it. Where there are no locks (no ``fcntl``, a file system that refuses
    them, a folder that cannot be written) the block runs unlocked."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on Unix
        yield False
        return
    try:
        handle = open(path, "a+")  # noqa: SIM115 - held for the block, closed below
    except OSError:
        yield False
        return
    locked = True
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting is not None:
                waiting()
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:  # a file system without locks
            locked = False
        yield locked
    finally:
        handle.close()  # releases the lock
