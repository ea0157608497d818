import numpy as np
import pytest

from fedattr.attribution import (
    DesignError,
    acceptance_threshold,
    design_stats,
    draw_design,
    validate_parameters,
)

P = list(range(10))


def test_degenerate_design_with_u_minus_target_equal_v_is_rejected():
    V = [(1, 2, 3, 4, 5)] * 5
    U = [(0, 1, 2, 3, 4, 5)] * 5  # U_m \ {0} == V_m: the estimate would be Delta_0 itself
    s = design_stats(P, 0, U, V)
    assert s.c == 0 and s.m_eff == 0 and not s.accepted
    assert all(a == 0 for a in s.alpha.values())


def test_hand_made_design_alpha_c_meff():
    # M=1: U\{0} = {1..5}, V = {5..9}: alpha = +1 on 1..4, -1 on 6..9, 0 on 5.
    s = design_stats(P, 0, [(0, 1, 2, 3, 4, 5)], [(5, 6, 7, 8, 9)])
    assert s.alpha == {1: 1, 2: 1, 3: 1, 4: 1, 5: 0, 6: -1, 7: -1, 8: -1, 9: -1}
    assert s.c == 8 and s.m_eff == 8
    assert s.threshold == pytest.approx((1 - 5 / 9) / 1 * 5)
    assert s.accepted


def test_concentrated_design_fails_m_eff_but_passes_c():
    # alpha nonzero on two clients only: c = 2*(1/5)^2*... build with M=5 sharing 4 members.
    U = [(0, 1, 2, 3, 4, 5)] * 4 + [(0, 1, 2, 3, 4, 6)]
    V = [(1, 2, 3, 4, 6)] * 4 + [(1, 2, 3, 4, 5)]
    s = design_stats(P, 0, U, V)
    assert s.alpha[5] == pytest.approx(0.6) and s.alpha[6] == pytest.approx(-0.6)
    assert s.c == pytest.approx(0.72) and s.c >= s.threshold  # 0.72 >= 0.444
    assert s.m_eff == pytest.approx(2.0) and s.m_eff >= s.threshold
    assert s.accepted
    # A design whose alpha sits on one pair with weight 0.2 fails on c.
    U = [(0, 1, 2, 3, 4, 5)] * 5
    V = [(1, 2, 3, 4, 5)] * 4 + [(1, 2, 3, 4, 6)]
    s = design_stats(P, 0, U, V)
    assert s.c == pytest.approx(0.08) and not s.accepted


def test_hand_made_design_must_respect_membership():
    with pytest.raises(DesignError, match="must contain the target"):
        design_stats(P, 0, [(1, 2, 3, 4, 5, 6)], [(1, 2, 3, 4, 5)])
    with pytest.raises(DesignError, match="no V_m may contain"):
        design_stats(P, 0, [(0, 1, 2, 3, 4, 5)], [(0, 2, 3, 4, 5)])


@pytest.mark.parametrize(
    ("K", "N", "M", "nsa", "match"),
    [
        (10, 9, 5, 1, "N: the subset size must satisfy 1 <= N < K-1 = 9"),
        (10, 10, 5, 1, "N: the subset size"),
        (10, 0, 5, 1, "N: the subset size"),
        (10, 3, 5, 4, "N: the N-subsets V_m must meet the secure-aggregation threshold"),
        (10, 5, 0, 1, "M: the number of query pairs"),
        (2, 1, 5, 1, "K: FedAttr needs at least 3"),
        (10, 5.0, 5, 1, "N: must be an integer"),
    ],
)
def test_impossible_parameters_are_rejected_up_front(K, N, M, nsa, match):
    with pytest.raises(DesignError, match=match):
        validate_parameters(K, N, M, nsa)


def test_draw_design_is_seeded_and_well_formed():
    a = draw_design(P, 3, 5, 5, np.random.default_rng([0, 1, 3]))
    b = draw_design(P, 3, 5, 5, np.random.default_rng([0, 1, 3]))
    assert a == b
    assert a.stats.accepted and a.queries == 10
    assert all(3 in u and len(u) == 6 for u in a.U)
    assert all(3 not in v and len(v) == 5 for v in a.V)
    coef = a.coefficients()
    assert coef[3] == 1.0 and abs(sum(v for k, v in coef.items() if k != 3)) < 1e-12


def test_redraws_are_counted():
    redraws = [draw_design(P, 0, 5, 5, np.random.default_rng(s)).redraws for s in range(300)]
    # Acceptance is about 87%, so about 13% of first draws are redrawn.
    share = np.mean([r > 0 for r in redraws])
    assert 0.07 < share < 0.20
    with pytest.raises(DesignError, match="no acceptable design"):
        # K=4, N=1, M=1: a draw is degenerate (U\{0} == V, alpha = 0) with probability 1/3,
        # so with no redraws allowed some seed must fail.
        for s in range(200):
            draw_design([0, 1, 2, 3], 0, 1, 1, np.random.default_rng(s), max_redraws=0)


def test_acceptance_threshold_formula():
    assert acceptance_threshold(10, 5, 5) == pytest.approx((1 - 5 / 9) / 5 * 5)
    assert acceptance_threshold(50, 5, 5) == pytest.approx((1 - 5 / 49) / 5 * 5)
