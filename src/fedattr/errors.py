"""The one error class for bad input from a user.

A :class:`UserError` is something the user can fix (a setting, a file, a folder): the command
line prints its message as one line and exits with code 2. Everything else is a bug and keeps
its traceback, so the CLI catches only this class.
"""

from __future__ import annotations

from pathlib import Path


class UserError(ValueError):
    """Bad input: the message names the parameter and the allowed values."""


def require_file(
    path: str | Path,
    option: str,
    expected: str = "a file",
    hint: str = "",
    error: type[UserError] = UserError,
) -> Path:
    """``path`` when it is an existing file; else ``error`` naming ``option`` and saying what is
    there instead (a directory, nothing). ``expected`` names the file wanted (``a .json or
    .toml file``); ``hint`` follows a missing file's message (``make one with ...``)."""
    p = Path(path)
    if p.is_dir():
        raise error(f"{option}: {str(p)!r} is a directory; {expected} is expected")
    if not p.is_file():
        raise error(f"{option}: {str(p)!r} does not exist{f' ({hint})' if hint else ''}")
    return p


def has_module(module: str) -> bool:
    """Whether ``module`` can be imported (an optional extra installed)."""
    import importlib.util

    return importlib.util.find_spec(module) is not None


def require_extra(module: str, extra: str, purpose: str) -> None:
    """A :class:`UserError` naming the extra to install when ``module`` (of the optional extra
    ``extra``) is missing; checked before work starts, so no work is lost to it."""
    if not has_module(module):
        raise UserError(f"{purpose} needs {module}: pip install 'fedattr[{extra}]'")
