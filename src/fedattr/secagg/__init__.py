"""Secure-aggregation backends behind one interface (:class:`SecureAggregator`).

``make_aggregator(SecAggConfig(...))`` builds a backend by name: ``plaintext`` (reference, holds
updates), ``pairwise-mask`` (Bonawitz-style masks per query) or ``two-server`` (additive shares
held by two non-colluding aggregators). ``run_queries`` answers a batch of :class:`QueryGroup`
objects (one per estimate) with a :class:`GroupAnswer` each.
"""

from __future__ import annotations

from .aggregator import SecureAggregator
from .batches import GroupAnswer, QueryGroup
from .config import BACKENDS, SecAggConfig, make_aggregator
from .errors import QueryFailed, QueryRefused, SecAggError
from .fixedpoint import FixedPointCodec
from .pairwise_mask import PairwiseMaskAggregator
from .plaintext import PlaintextAggregator
from .policy import ReleasePolicy, SessionLedgers, joint_leakage
from .queries import Query, QueryRecord
from .two_server import TwoServerAggregator

__all__ = [
    "BACKENDS",
    "FixedPointCodec",
    "GroupAnswer",
    "PairwiseMaskAggregator",
    "PlaintextAggregator",
    "Query",
    "QueryFailed",
    "QueryGroup",
    "QueryRecord",
    "QueryRefused",
    "ReleasePolicy",
    "SecAggConfig",
    "SecAggError",
    "SecureAggregator",
    "SessionLedgers",
    "TwoServerAggregator",
    "joint_leakage",
    "make_aggregator",
]
