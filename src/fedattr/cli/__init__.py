"""The ``fedattr`` command line.

One module per command group, each registering its subcommands with ``add_parsers(sub)`` and
holding their handlers: :mod:`.run` (``demo-protocol``, ``run``), :mod:`.experiment`,
:mod:`.privacy` (``privacy``, ``audit``), :mod:`.bench`, :mod:`.flower` and :mod:`.owner`
(``owner``, ``attribute``); :mod:`.common` has what they share. Each command says where it is
registered whether it sets up the machine's threads (``set_defaults(threads=True)``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from .. import __version__
from ..errors import UserError
from ..runtime import set_threads
from . import bench, experiment, flower, owner, privacy, run

__all__ = ["build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors (an unknown choice, a value of the wrong type, a
    missing argument) are one line and exit code 2, as every other bad input is; the usage is
    one ``--help`` away. Its subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for docs and tests)."""
    p = _Parser(
        prog="fedattr",
        description="Client-level watermark attribution in federated LLM fine-tuning under "
        "secure aggregation.",
    )
    p.add_argument("--version", action="version", version=f"fedattr {__version__}")
    # A command that does work sets threads=True; one that does not say sets nothing up.
    p.set_defaults(threads=False)
    sub = p.add_subparsers(dest="command", required=True)
    # The order here is the order of `fedattr --help` and of docs/reference/cli.md.
    for group in (run, experiment, privacy, bench, flower, owner):
        group.add_parsers(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse, run, and turn bad input (:class:`UserError`) into one clear line
    (exit code 2). Anything else is a bug and keeps its traceback."""
    args = build_parser().parse_args(argv)
    try:
        if args.threads:
            set_threads()  # a busy machine's note is shown when a run starts work
        return args.func(args)
    except UserError as exc:
        print(f"fedattr: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fedattr: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        if not _stdout_closed():
            raise  # some other pipe: a bug, with its traceback
        # The reader of our output stopped (``| head``): what it wanted has been written.
        # Point stdout at /dev/null so the interpreter's last flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a command its pipe ended


def _stdout_closed() -> bool:
    """Whether standard output is a pipe whose reading end is gone."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & select.POLLERR for _, event in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no real file descriptor
        return False
