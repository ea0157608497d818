"""Errors raised by secure-aggregation backends."""

from __future__ import annotations

from ..errors import UserError


class SecAggError(UserError):
    """A secure-aggregation request or configuration that cannot be honoured."""


class QueryRefused(SecAggError):
    """The aggregator refused a subset-sum query (threshold, unknown clients, closed round)."""


class QueryFailed(SecAggError):
    """A query could not complete because members did not answer; nothing was released."""

    def __init__(self, message: str, missing: tuple[int, ...]) -> None:
        super().__init__(message)
        self.missing = missing
