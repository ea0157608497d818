"""Progress for long runs: bars on a terminal, one line per step with elapsed time elsewhere.

Off a terminal (a log file, CI, a busy shared machine) a bar prints nothing until it ends, so a
round could stay silent for many minutes; there every step is a line with the elapsed time.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from tqdm.auto import tqdm


class Progress:
    """``progress(msg)`` prints a line; ``progress.steps(total, desc)`` tracks a stage.

    ``write``: where lines go instead of stderr (e.g. ``lambda _m: None`` to be quiet); with it,
    no bars are drawn and step lines go to ``write`` too.
    """

    def __init__(self, write: Callable[[str], None] | None = None) -> None:
        self._write = write
        self._tty = write is None and sys.stderr.isatty()
        self._start = time.perf_counter()

    def elapsed(self) -> str:
        """Time since this reporter was made, as ``[1m05s]``."""
        s = int(time.perf_counter() - self._start)
        return f"[{s // 60}m{s % 60:02d}s]"

    def __call__(self, message: str) -> None:
        if self._write is not None:
            self._write(message)
        elif self._tty:
            tqdm.write(message, file=sys.stderr)
        else:
            print(f"{self.elapsed()} {message}", file=sys.stderr, flush=True)

    def steps(self, total: int, desc: str, lines: bool = True) -> Steps:
        """A stage of ``total`` steps; ``lines=False``: a bar on a terminal, nothing per step
        elsewhere (for fast steps whose stage ends with a line of its own)."""
        return Steps(self, total, desc, lines)


class Steps:
    """One stage: a tqdm bar on a terminal, else one line per finished step."""

    def __init__(self, progress: Progress, total: int, desc: str, lines: bool = True) -> None:
        self._progress, self.total, self.desc, self.done = progress, total, desc, 0
        self._lines = lines
        self._bar = (
            tqdm(total=total, desc=desc, leave=False, file=sys.stderr) if progress._tty else None
        )

    def step(self, detail: str = "") -> None:
        """One step finished (``detail``: what it was)."""
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)
        elif self._lines:
            what = f": {detail}" if detail else ""
            self._progress(f"{self.desc}{what} ({self.done}/{self.total})")

    def close(self) -> None:
        """End the stage."""
        if self._bar is not None:
            self._bar.close()
