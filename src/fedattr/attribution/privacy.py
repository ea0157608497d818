"""Privacy accounting for FedAttr designs.

Per released estimate the paper's Theorem 4 bounds the mutual information between one client's
update and its released estimate by ``(d*/2) log(1 + 1/(aN)) + C d*/(aN)`` nats, for an update
of effective dimension ``d*`` and a constant ``C`` the theorem leaves to the data (``C = 0``
keeps only the Gaussian term). Accepted designs have ``c >= aN``, so the bound at ``aN`` is the
worst case over them; ``(1/2) log(1 + 1/c)`` per dimension is the Gaussian-model value of the
design actually drawn.

The bound covers ONE released estimate. In one round the server answers ``2MK`` subset sums
over the same ``K`` updates; :func:`joint_recovery` shows that their coefficient vectors span
all of R^K, so the answers determine every individual update exactly.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from ..secagg.policy import joint_leakage
from .design import acceptance_threshold, draw_design, validate_parameters


def theorem4_bound(threshold: float, d_star: float, C: float = 0.0) -> float:
    """``(d*/2) log(1 + 1/aN) + C d*/aN`` nats for acceptance threshold ``aN``."""
    if d_star <= 0:
        raise ValueError(f"d_star: the effective dimension must be positive, got {d_star}")
    if C < 0:
        raise ValueError(f"C: must be >= 0, got {C}")
    return d_star / 2.0 * math.log1p(1.0 / threshold) + C * d_star / threshold


def gaussian_leakage_per_dim(c: float) -> float:
    """``(1/2) log(1 + 1/c)`` nats per effective dimension for a design with masking level c."""
    return 0.5 * math.log1p(1.0 / c) if c > 0 else math.inf


def variance_factor(K: int, N: int) -> float:
    """``N(K-1-N)/(K-2)``: the estimator's variance is (2/M) times this times the spread."""
    return N * (K - 1 - N) / (K - 2)


def expected_c(K: int, N: int, M: int) -> float:
    """Unconditional ``E[c] = (2/M) N (K-1-N) / (K-1)`` (before the acceptance rule)."""
    return 2.0 / M * N * (K - 1 - N) / (K - 1)


@dataclass
class AcceptanceEstimate:
    """Monte Carlo estimate of the acceptance rule's behaviour."""

    trials: int
    rate: float
    stderr: float
    mean_c: float
    mean_c_accepted: float
    mean_m_eff_accepted: float

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return asdict(self)


def _indicator_draws(rng: np.random.Generator, trials: int, M: int, n: int, N: int) -> np.ndarray:
    """(trials, M, n) 0/1 arrays, each row a uniform N-subset of n items."""
    keys = rng.random((trials, M, n))
    ranks = np.argsort(np.argsort(keys, axis=-1), axis=-1)
    return (ranks < N).astype(np.float64)


def acceptance_rate(
    K: int, N: int, M: int, trials: int = 20_000, seed: int = 0
) -> AcceptanceEstimate:
    """Share of i.i.d. designs that pass the acceptance rule (vectorised Monte Carlo)."""
    validate_parameters(K, N, M)
    if trials < 1:
        raise ValueError(f"trials: must be >= 1, got {trials}")
    rng = np.random.default_rng(seed)
    n = K - 1
    u = _indicator_draws(rng, trials, M, n, N)
    v = _indicator_draws(rng, trials, M, n, N)
    alpha = (u - v).mean(axis=1)
    c = np.sum(alpha**2, axis=1)
    fourth = np.sum(alpha**4, axis=1)
    m_eff = np.divide(c * c, fourth, out=np.zeros_like(c), where=fourth > 0)
    threshold = acceptance_threshold(K, N, M)
    ok = (c >= threshold - 1e-12) & (m_eff >= threshold - 1e-12)
    rate = float(ok.mean())
    return AcceptanceEstimate(
        trials=trials,
        rate=rate,
        stderr=math.sqrt(rate * (1 - rate) / trials),
        mean_c=float(c.mean()),
        mean_c_accepted=float(c[ok].mean()) if ok.any() else math.nan,
        mean_m_eff_accepted=float(m_eff[ok].mean()) if ok.any() else math.nan,
    )


@dataclass
class JointRecovery:
    """What one round's answered queries reveal jointly."""

    queries: int
    rank: int
    recoverable_clients: int
    estimates_condition_number: float

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return asdict(self)


def joint_recovery(K: int, N: int, M: int, seed: int = 0) -> JointRecovery:
    """Draw one round's accepted designs for all K targets and test exact recoverability.

    Client j's update is exactly recoverable from the answered sums iff ``e_j`` lies in the row
    space of the 0/1 query matrix. Also reports the condition number of the K x K matrix of
    released-estimate coefficients (row i = e_i + alpha^(i)).
    """
    validate_parameters(K, N, M)
    participants = list(range(K))
    rows, est = [], []
    for i in participants:
        d = draw_design(participants, i, N, M, np.random.default_rng([seed, i]))
        for subset in (*d.U, *d.V):
            row = np.zeros(K)
            row[list(subset)] = 1.0
            rows.append(row)
        coef = d.coefficients()
        est.append([coef[j] for j in participants])
    Q = np.array(rows)
    recoverable = int(np.sum(np.isinf(joint_leakage(Q))))
    rank = int(np.linalg.matrix_rank(Q))
    return JointRecovery(len(rows), rank, recoverable, float(np.linalg.cond(np.array(est))))


@dataclass
class PrivacySummary:
    """Everything ``fedattr privacy`` prints."""

    K: int
    N: int
    M: int
    rho: float
    threshold_aN: float
    variance_factor: float
    expected_c: float
    queries_per_round: int
    d_star: float
    C: float
    leakage_bound_nats: float
    acceptance: AcceptanceEstimate
    joint: JointRecovery

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return asdict(self)


def summarize(
    K: int, N: int, M: int, d_star: float = 1.0, C: float = 0.0, trials: int = 20_000, seed: int = 0
) -> PrivacySummary:
    """Acceptance rate, expected c, aN, variance factor, query count, leakage bound, joint rank."""
    validate_parameters(K, N, M)
    threshold = acceptance_threshold(K, N, M)
    return PrivacySummary(
        K=K,
        N=N,
        M=M,
        rho=N / (K - 1),
        threshold_aN=threshold,
        variance_factor=variance_factor(K, N),
        expected_c=expected_c(K, N, M),
        queries_per_round=2 * M * K,
        d_star=d_star,
        C=C,
        leakage_bound_nats=theorem4_bound(threshold, d_star, C),
        acceptance=acceptance_rate(K, N, M, trials, seed),
        joint=joint_recovery(K, N, M, seed),
    )
