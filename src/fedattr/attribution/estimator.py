"""The FedAttr estimator: Delta_hat_i = mean_m S(U_m) - mean_m S(V_m), through SA only."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..secagg.aggregator import SecureAggregator
from ..secagg.batches import QueryGroup
from ..secagg.errors import QueryFailed, QueryRefused
from ..secagg.queries import Query
from .design import QueryDesign


def design_queries(design: QueryDesign, fused: bool = False) -> list[Query]:
    """The SA queries behind one estimate: the ``M`` U-subset sums then the ``M`` V-subset sums,
    or (``fused``) one combination with the design's integer coefficients over ``M``."""
    if fused:
        return [Query(design.integer_coefficients(), design.M)]
    return [Query.subset(s) for s in (*design.U, *design.V)]


def design_reduction(design: QueryDesign, fused: bool = False) -> tuple[list[int], int]:
    """:func:`combine_answers` as a :attr:`~fedattr.secagg.QueryGroup.reduce` entry (signs,
    divisor): SA then sums the answers as they arrive, in the same order and with the same
    float64 operations, so the estimate has the same bits."""
    if fused:
        return [1], 1
    return [1] * design.M + [-1] * design.M, design.M


def combine_answers(
    design: QueryDesign, answers: Sequence[np.ndarray], fused: bool = False
) -> np.ndarray:
    """``mean_m S(U_m) - mean_m S(V_m)`` from the answers of :func:`design_queries` (a fused
    answer already is the estimate)."""
    if fused:
        return answers[0]
    M = design.M
    total = answers[0]
    for s in answers[1:M]:
        total = total + s
    for s in answers[M:]:
        total -= s
    return total / M


def estimate_update(sa: SecureAggregator, design: QueryDesign, fused: bool = False) -> np.ndarray:
    """Flat float64 estimate of the target's update from its SA queries (2M subset sums, or one
    fused query that never releases the subset sums behind it).

    Unbiased over accepted designs; the residual ``sum_j alpha_j Delta_j`` has trace covariance
    ``E[c | accepted] / (K-2) * sum_{j != i} ||Delta_j - mean_{-i}||^2``.
    """
    group = QueryGroup([design_queries(design, fused)], reduce=[design_reduction(design, fused)])
    (answer,) = sa.run_queries([group])
    if answer.results is None:
        if answer.missing:
            raise QueryFailed(answer.error or "members did not answer", answer.missing)
        raise QueryRefused(answer.error)
    (estimate,) = answer.results
    return estimate


def predicted_error_trace(
    flat_updates: dict[int, np.ndarray], target: int, expected_c: float
) -> float:
    """Exact ``E||Delta_hat_i - Delta_i||^2`` for a design distribution with ``E[c] = expected_c``.

    Exchangeability of alpha over the other clients and ``sum_j alpha_j = 0`` give
    ``E[alpha alpha^T] = E[c]/(K-2) * (I - 11^T/(K-1))``, hence this closed form.
    """
    others = [v for j, v in flat_updates.items() if j != target]
    stacked = np.stack(others)
    centred = stacked - stacked.mean(axis=0)
    return float(expected_c / (len(flat_updates) - 2) * np.sum(centred**2))
