"""What a server may ask of secure aggregation, and the record of each answered query.

A :class:`Query` is one SA query: a subset sum ``S(W) = sum_{j in W} Delta_j`` (every
coefficient 1) or one *fused* combination ``sum_j (c_j / d) Delta_j`` with integer ``c_j``
(FedAttr's estimate in one SA session, so the 2M subset sums behind it are never released).
A :class:`QueryRecord` is what the query log keeps of an answered query: its members and
coefficients (never its result), for overhead accounting and privacy audits.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass

import numpy as np

from .errors import SecAggError


@dataclass(frozen=True)
class QueryRecord:
    """One answered subset-sum query.

    ``bytes_moved`` counts the protocol messages of the query (masked inputs, partial sums);
    ``seconds`` is the wall time of the whole query in this process; ``client_seconds_max`` is
    the slowest member's own computation, i.e. the query's latency when clients run in parallel.
    """

    round: int
    query_id: int
    subset: tuple[int, ...]
    bytes_moved: int
    seconds: float
    client_seconds_max: float = 0.0
    coefficients: tuple[int, ...] = ()
    """Integer weight of each member of ``subset`` (all 1 for a subset sum)."""
    denominator: int = 1
    session: str = ""
    """The SA session that asked (an attribution configuration's name; ``""``: none)."""

    def to_dict(self) -> dict:
        """JSON-ready form."""
        d = asdict(self)
        d["subset"] = list(self.subset)
        d["coefficients"] = list(self.coefficients or (1,) * len(self.subset))
        return d


@dataclass(frozen=True)
class Query:
    """One SA query: ``sum_j (coefficients[j] / denominator) * Delta_j``.

    All coefficients 1 with denominator 1 is a subset sum (answered by
    :meth:`~fedattr.secagg.SecureAggregator.subset_sum_flat`); anything else is a fused
    combination (answered by :meth:`~fedattr.secagg.SecureAggregator.combination_flat`, which
    validates coefficients and denominator).
    """

    coefficients: Mapping[int, int]
    """Client id -> integer coefficient (stored as a plain dict)."""
    denominator: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "coefficients", dict(self.coefficients))

    @classmethod
    def subset(cls, members: Iterable[int]) -> Query:
        """The subset sum over ``members`` (every coefficient 1)."""
        ids = [int(c) for c in members]
        if len(set(ids)) != len(ids):
            raise SecAggError(f"Query.subset: duplicate client ids in {ids}")
        return cls(dict.fromkeys(ids, 1))

    @property
    def is_subset(self) -> bool:
        """True when this query is a plain subset sum (all coefficients 1, denominator 1)."""
        return (
            type(self.denominator) is int
            and self.denominator == 1
            and all(isinstance(v, (int, np.integer)) and v == 1 for v in self.coefficients.values())
        )
