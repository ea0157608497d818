"""The FedAttr estimator: Delta_hat_i = mean_m S(U_m) - mean_m S(V_m), through SA only."""

from __future__ import annotations

import numpy as np

from ..secagg.base import SecureAggregator
from .design import QueryDesign


def estimate_update(sa: SecureAggregator, design: QueryDesign) -> np.ndarray:
    """Flat float64 estimate of the target's update; 2M subset-sum queries to ``sa``.

    Unbiased over accepted designs; the residual ``sum_j alpha_j Delta_j`` has trace covariance
    ``E[c | accepted] / (K-2) * sum_{j != i} ||Delta_j - mean_{-i}||^2``.
    """
    total: np.ndarray | None = None
    for u in design.U:
        s = sa.subset_sum_flat(u)
        total = s if total is None else total + s
    for v in design.V:
        total -= sa.subset_sum_flat(v)
    assert total is not None
    return total / design.M


def estimate_update_fused(sa: SecureAggregator, design: QueryDesign) -> np.ndarray:
    """The same estimate as :func:`estimate_update` from ONE fused SA query.

    Clients scale their ring encodings by ``M * coef_j`` (integers) and the SA session returns
    ``sum_j coef_j Delta_j`` directly, so the server never holds the 2M subset sums behind it.
    In the ring this is the very same integer as the subset-sum path's total.
    """
    return sa.combination_flat(design.integer_coefficients(), denominator=design.M)


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
