"""The one error class for bad input from a user.

A :class:`UserError` is something the user can fix (a setting, a file, a folder): the command
line prints its message as one line and exits with code 2. Everything else is a bug and keeps
its traceback, so the CLI catches only this class.
"""

from __future__ import annotations

import os
from pathlib import Path


class UserError(ValueError):
    """Bad input: the message names the parameter and the allowed values."""


#: Errors that are a bug wherever they are raised. A handler that turns a library's failure on
#: the user's input into one line (``except Exception``) re-raises these first, so that a bug
#: in our call or in the library keeps its traceback.
BUGS: tuple[type[Exception], ...] = (TypeError, AttributeError, NameError, AssertionError)


def first_line(exc: BaseException, with_class: bool = False) -> str:
    """The first non-blank line of ``exc``'s message, for a one-line error (``with_class``:
    after its class name, ``OSError: ...``); the class name alone when the message is blank,
    which must not raise inside the handler that reports it."""
    name = type(exc).__name__
    for line in str(exc).splitlines():
        if line.strip():
            return f"{name}: {line.strip()}" if with_class else line.strip()
    return name


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


def read_text(path: str | Path, option: str, error: type[UserError] = UserError) -> str:
    """The UTF-8 text of the file ``path`` (given as ``option``); a file that is not UTF-8
    text, or cannot be read, is ``error`` naming ``option`` (not a traceback)."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise error(
            f"{option}: {str(p)!r} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
            "give a UTF-8 file"
        ) from None
    except OSError as exc:
        raise error(f"{option}: {str(p)!r} cannot be read ({exc.strerror or exc})") from None


def _file_in_the_way(path: Path) -> Path | None:
    """The nearest existing one of ``path`` and its parents, when it is not a folder."""
    for p in (path, *path.parents):
        if p.exists():
            return None if p.is_dir() else p
    return None


def not_writable(path: str | Path, option: str, exc: OSError | None = None) -> UserError:
    """The one-line error for an output folder ``path`` (given as ``option``) that cannot be
    written: it names a file standing where a folder is needed, else the system's reason."""
    p = Path(path)
    blocker = _file_in_the_way(p)
    if blocker is not None:
        return UserError(
            f"{option}: {str(blocker)!r} is a file, not a folder; choose another {option}"
        )
    reason = (exc.strerror if exc is not None else None) or "permission denied"
    return UserError(
        f"{option}: {str(p)!r} cannot be written ({reason}); choose a folder you can write to"
    )


def _refused_write(folder: Path) -> OSError | None:
    """Why a file cannot be created in the existing ``folder``, found by creating one (and
    removing it); ``None`` when it can. Permission bits do not say it all: they let root write
    anywhere, and know nothing of a read-only file system (``/proc``, a read-only mount)."""
    import tempfile

    try:
        fd, name = tempfile.mkstemp(prefix=".fedattr-probe-", dir=folder)
    except OSError as exc:
        return exc
    os.close(fd)
    os.unlink(name)
    return None


def require_writable_folder(folder: str | Path, option: str) -> Path:
    """``folder`` when it is an existing folder this process may create files in; else one
    line naming ``option``. Checked before work starts, so no work is lost to it."""
    p = Path(folder)
    if _file_in_the_way(p) is not None:
        raise not_writable(p, option)
    if not p.is_dir():
        raise UserError(f"{option}: folder {str(p)!r} does not exist")
    if not os.access(p, os.W_OK | os.X_OK):
        raise not_writable(p, option)
    refused = _refused_write(p)
    if refused is not None:
        raise not_writable(p, option, refused)
    return p


def require_creatable_folder(folder: str | Path, option: str) -> Path:
    """``folder`` when it is a folder this process may write in, or one it may create (no file
    standing where it or a parent should be, the nearest existing parent writable); else one
    line naming ``option``. For outputs made later (an experiment's folder): checked first."""
    p = Path(folder)
    if _file_in_the_way(p) is not None:
        raise not_writable(p, option)
    existing = next(q for q in (p, *p.parents, Path.cwd()) if q.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise not_writable(existing, option)
    refused = _refused_write(existing)
    if refused is not None:
        raise not_writable(existing, option, refused)
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
