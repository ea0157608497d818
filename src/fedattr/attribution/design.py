"""FedAttr query design: which subsets to ask secure aggregation for, for one target client.

For target ``i`` among ``K`` participants, the design is ``M`` i.i.d. uniform ``(N+1)``-subsets
``U_m`` that contain ``i`` and ``M`` i.i.d. uniform ``N``-subsets ``V_m`` that do not. With
``alpha_j = freq_U(j) - freq_V(j)`` for ``j != i``, the estimate
``mean_m S(U_m) - mean_m S(V_m) = Delta_i + sum_j alpha_j Delta_j``.

The acceptance rule (checked *before* any query, so a redraw costs no SA query) requires
``c = sum alpha_j^2 >= aN`` and ``M_eff = c^2 / sum alpha_j^4 >= aN`` with ``a = (1 - rho)/M``,
``rho = N/(K-1)``, and ``N < K-1``. ``c`` is the variance of the masking noise the other
clients add to the estimate; ``M_eff`` says over how many clients that noise is spread. A design
with ``U_m \\ {i} = V_m`` for all ``m`` has ``alpha = 0`` and would release ``Delta_i`` itself;
it is rejected.

The rule is symmetric under ``alpha -> -alpha`` (swap ``U_m \\ {i}`` and ``V_m``) and under
relabelling the other clients, so conditioning on acceptance keeps ``E[alpha] = 0``: the
estimator stays unbiased.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import UserError


class DesignError(UserError):
    """Protocol parameters for which no valid FedAttr design exists."""


def validate_parameters(K: int, N: int, M: int, min_members: int = 1) -> None:
    """Raise :class:`DesignError` naming the parameter when (K, N, M, N_sa) is impossible."""
    for name, value in (("K", K), ("N", N), ("M", M), ("min_members", min_members)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise DesignError(f"{name}: must be an integer, got {value!r}")
    if K < 3:
        raise DesignError(f"K: FedAttr needs at least 3 participating clients, got K={K}")
    if M < 1:
        raise DesignError(f"M: the number of query pairs per target must be >= 1, got M={M}")
    if not 1 <= N < K - 1:
        raise DesignError(
            f"N: the subset size must satisfy 1 <= N < K-1 = {K - 1} (with N = K-1 every V_m is "
            f"all other clients and the estimate equals the client's own update), got N={N}"
        )
    if min_members > N:
        raise DesignError(
            f"N: the N-subsets V_m must meet the secure-aggregation threshold "
            f"min_members={min_members}; allowed N is {min_members}..{K - 2}, got N={N}"
        )


def acceptance_threshold(K: int, N: int, M: int) -> float:
    """``aN`` with ``a = (1 - rho) / M`` and ``rho = N / (K - 1)`` (the one place it is
    computed: the design rule, the privacy summary and the release budget all use it)."""
    rho = N / (K - 1)
    return (1.0 - rho) / M * N


def single_estimate_budget(K: int, N: int, M: int) -> float:
    """The paper's per-estimate leakage bound, Gaussian term: ``1/2 log(1 + 1/(aN))`` nats per
    dimension; every accepted single estimate stays within it (hardened mode's default
    ``secagg.release_budget``)."""
    return 0.5 * math.log1p(1.0 / acceptance_threshold(K, N, M))


@dataclass(frozen=True)
class DesignStats:
    """Masking statistics of one design for one target."""

    alpha: dict[int, float]
    c: float
    m_eff: float
    threshold: float
    accepted: bool


def design_stats(
    participants: Sequence[int],
    target: int,
    U: Sequence[Sequence[int]],
    V: Sequence[Sequence[int]],
) -> DesignStats:
    """alpha, c, M_eff and the acceptance decision for a given (possibly hand-made) design."""
    others = [j for j in participants if j != target]
    K, M = len(participants), len(U)
    if M == 0 or len(V) != M:
        raise DesignError(f"U and V must both hold M >= 1 subsets; got {len(U)} and {len(V)}")
    N = len(V[0])
    counts = dict.fromkeys(others, 0.0)
    for u in U:
        if target not in u:
            raise DesignError(f"every U_m must contain the target {target}; got {list(u)}")
        for j in u:
            if j != target:
                counts[j] += 1.0
    for v in V:
        if target in v:
            raise DesignError(f"no V_m may contain the target {target}; got {list(v)}")
        for j in v:
            counts[j] -= 1.0
    alpha = {j: counts[j] / M for j in others}
    a = np.fromiter(alpha.values(), dtype=np.float64)
    c = float(np.sum(a**2))
    fourth = float(np.sum(a**4))
    m_eff = c * c / fourth if c > 0 else 0.0
    threshold = acceptance_threshold(K, N, M)
    # Tiny tolerance: c and M_eff are ratios of small integers and may land exactly on aN.
    tol = 1e-12
    accepted = N < K - 1 and c >= threshold - tol and m_eff >= threshold - tol
    return DesignStats(alpha, c, m_eff, threshold, accepted)


@dataclass(frozen=True)
class QueryDesign:
    """An accepted design for one target in one round."""

    target: int
    U: tuple[tuple[int, ...], ...]
    V: tuple[tuple[int, ...], ...]
    stats: DesignStats
    redraws: int = 0
    participants: tuple[int, ...] = field(default=())

    @property
    def M(self) -> int:
        """Query pairs in this design."""
        return len(self.U)

    @property
    def queries(self) -> int:
        """SA queries this design costs (2M)."""
        return 2 * len(self.U)

    def integer_coefficients(self) -> dict[int, int]:
        """``M`` times :meth:`coefficients`, exactly: inclusion counts in U minus in V."""
        counts = dict.fromkeys(self.participants, 0)
        for u in self.U:
            for j in u:
                counts[j] += 1
        for v in self.V:
            for j in v:
                counts[j] -= 1
        return counts

    def coefficients(self) -> dict[int, float]:
        """Weight of every participant's update in the estimate (1 for the target, else alpha)."""
        coef = {j: self.stats.alpha.get(j, 0.0) for j in self.participants}
        coef[self.target] = 1.0
        return coef


def own_update_design(target: int, participants: Sequence[int]) -> QueryDesign:
    """The design of an estimate that is ``target``'s own update alone (weight 1 on it, 0 on
    every other participant): a client's update recovered from a round's estimates, or read
    directly (the ceiling)."""
    alone = DesignStats({}, 0.0, 0.0, 0.0, True)
    return QueryDesign(target, ((target,),), ((),), alone, 0, tuple(participants))


def _random_subsets(rng: np.random.Generator, pool: np.ndarray, size: int, count: int) -> list:
    return [
        tuple(sorted(int(x) for x in rng.choice(pool, size, replace=False))) for _ in range(count)
    ]


def draw_design(
    participants: Sequence[int],
    target: int,
    N: int,
    M: int,
    rng: np.random.Generator,
    *,
    min_members: int = 1,
    max_redraws: int = 10_000,
) -> QueryDesign:
    """Draw designs until one is accepted; no SA query is made here.

    Raises :class:`DesignError` if the parameters are impossible or ``max_redraws`` designs in a
    row are rejected (which only happens for parameters where acceptance is very unlikely).
    """
    participants = tuple(int(p) for p in participants)
    if target not in participants:
        raise DesignError(
            f"target: client {target} is not among the participants {list(participants)}"
        )
    validate_parameters(len(participants), N, M, min_members)
    others = np.array([j for j in participants if j != target])
    for redraws in range(max_redraws + 1):
        U = [(*s, target) for s in _random_subsets(rng, others, N, M)]
        U = [tuple(sorted(u)) for u in U]
        V = _random_subsets(rng, others, N, M)
        stats = design_stats(participants, target, U, V)
        if stats.accepted:
            return QueryDesign(target, tuple(U), tuple(V), stats, redraws, participants)
    raise DesignError(
        f"no acceptable design for K={len(participants)}, N={N}, M={M} after {max_redraws} "
        f"redraws; "
        f"increase M or N, or attribution.protocol.max_redraws"
    )
