"""The one error class for bad input from a user.

A :class:`UserError` is something the user can fix (a setting, a file, a folder): the command
line prints its message as one line and exits with code 2. Everything else is a bug and keeps
its traceback, so the CLI catches only this class.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input: the message names the parameter and the allowed values."""
