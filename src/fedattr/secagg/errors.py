"""Errors raised by secure-aggregation backends."""


class SecAggError(ValueError):
    """A secure-aggregation request or configuration that cannot be honoured."""


class QueryRefused(SecAggError):
    """The aggregator refused a subset-sum query (threshold, unknown clients, closed round)."""
