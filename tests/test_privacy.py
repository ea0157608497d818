import math

import numpy as np
import pytest

from fedattr.attribution import draw_design, theorem4_bound
from fedattr.attribution.privacy import (
    acceptance_rate,
    gaussian_leakage_per_dim,
    joint_recovery,
    summarize,
)


def test_acceptance_rate_matches_exact_design_draws():
    mc = acceptance_rate(10, 5, 5, trials=20_000, seed=1)
    assert 0.85 < mc.rate < 0.89  # paper: about 87%
    # Same rule through the per-design code path (draw_design counts redraws).
    rng = np.random.default_rng(7)
    redraws = [draw_design(range(10), 0, 5, 5, rng).redraws for _ in range(2000)]
    rate = 2000 / (2000 + sum(redraws))
    assert abs(rate - mc.rate) < 0.03
    assert acceptance_rate(50, 5, 5, trials=20_000, seed=1).rate > 0.995  # paper: > 99.8%


def test_theorem4_bound_formula_and_errors():
    assert theorem4_bound(0.5, d_star=10, C=0.0) == pytest.approx(5 * math.log(3))
    assert theorem4_bound(0.5, d_star=10, C=2.0) == pytest.approx(5 * math.log(3) + 40)
    assert gaussian_leakage_per_dim(1.0) == pytest.approx(0.5 * math.log(2))
    with pytest.raises(ValueError, match="d_star"):
        theorem4_bound(0.5, d_star=0)


def test_joint_release_reveals_every_update():
    j = joint_recovery(10, 5, 5, seed=0)
    assert j.queries == 100 and j.rank == 10 and j.recoverable_clients == 10


def test_summary_fields():
    s = summarize(10, 5, 5, d_star=2.0, trials=2000)
    assert s.queries_per_round == 100
    assert s.variance_factor == pytest.approx(5 * 4 / 8)
    assert s.threshold_aN == pytest.approx(4 / 9)
    assert s.leakage_bound_nats == pytest.approx(theorem4_bound(4 / 9, 2.0))
