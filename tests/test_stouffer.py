import math

import numpy as np
import pytest

from fedattr.attribution import build_report, stouffer, upper_tail
from fedattr.reporting.markdown import attribution_table


def test_stouffer_formula():
    assert stouffer([1.0, 2.0, 3.0, 4.0]) == pytest.approx(10 / 2)
    assert stouffer([]) == 0.0


def test_tail_p_values_are_not_rounded_to_zero():
    p, lp = upper_tail(12.0)
    assert 0 < p < 1e-30 and lp == pytest.approx(math.log10(p), rel=1e-9)
    p, lp = upper_tail(40.0)  # p ~ 1e-350 underflows a double; log10 p stays exact
    assert p == 0.0 and -352 < lp < -347


def test_report_flags_rates_and_partial_participation():
    scores = {0: {1: 5.0, 2: 5.0}, 1: {1: 0.1, 3: -0.2}, 2: {2: 9.0}, 3: {}}
    truth = {0: True, 1: False, 2: False, 3: True}
    r = build_report(scores, gamma=4.0, truth=truth)
    by = {c.id: c for c in r.clients}
    assert pytest.approx(10 / math.sqrt(2)) == by[0].Z and by[0].flagged
    assert pytest.approx(9.0) == by[2].Z and by[2].flagged  # one round: sqrt(1)
    assert by[3].Z == 0.0 and not by[3].flagged
    assert r.tpr == 0.5 and r.fpr == 0.5 and r.flagged == [0, 2]
    d = r.to_dict()
    assert d["clients"][0]["z"] == {"1": 5.0, "2": 5.0}
    md = attribution_table(r)
    assert "| 0 | yes |" in md and "TPR = 50.0%" in md and "γ = 4" in md
    assert build_report({0: {1: 1.0}}, 4.0).tpr is None


def test_empirical_null_standardises_each_round_robustly():
    from fedattr.attribution.stouffer import empirical_null

    rng = np.random.default_rng(0)
    # 40 benign clients whose scores are N(2, 3^2) (shifted and widened by cross-talk) and one
    # outlier: after standardisation the benign bulk is ~N(0, 1) and the outlier stands out.
    scores = {c: {t: 2 + 3 * rng.normal() for t in (1, 2)} for c in range(40)}
    scores[40] = {1: 30.0, 2: 30.0}
    out = empirical_null(scores)
    bulk = np.array([out[c][t] for c in range(40) for t in (1, 2)])
    assert abs(np.median(bulk)) < 0.3 and 0.7 < bulk.std() < 1.4
    assert out[40][1] > 6
    # Too few clients, or no spread: left as is.
    assert empirical_null({0: {1: 5.0}, 1: {1: 1.0}}) == {0: {1: 5.0}, 1: {1: 1.0}}
    assert empirical_null({c: {1: 1.0} for c in range(5)}) == {c: {1: 1.0} for c in range(5)}
