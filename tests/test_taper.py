"""The probability taper of the calibrated statistic (``attribution.calibrated.taper``): key-free
cell weights from the round's reference model."""

import math

import numpy as np
import pytest
import torch

from fedattr.attribution.calibrated.plan import plan_round
from fedattr.attribution.calibrated.standardise import standardise_round
from fedattr.attribution.calibrated.weights import spread_weights, taper_weights
from fedattr.attribution.config import AttributionConfig
from fedattr.attribution.design import DesignStats, QueryDesign
from fedattr.config import ConfigError, load
from fedattr.pipeline.config import RunConfig
from fedattr.watermarks.tail.laws import RowSubsets


class _Distributions:
    """A detector over next-token distributions: the reference observation is ``A``."""

    def reference_probabilities(self, reference):
        return {"probes": reference / reference.sum(dim=1, keepdim=True)}


def _design(target, alpha, K):
    return QueryDesign(
        target, ((target,),), ((),), DesignStats(alpha, 0.0, 0.0, 0.0, True), 0, tuple(range(K))
    )


def test_weights_are_one_below_the_start_and_fall_as_a_power_above_it():
    ref = torch.tensor([[0.001, 0.009, 0.09, 0.9], [0.25, 0.25, 0.25, 0.25]]) * 8
    w = taper_weights(_Distributions(), ref, 0.5, 0.01)["probes"]
    want = [[1.0, 1.0, math.sqrt(0.01 / 0.09), math.sqrt(0.01 / 0.9)], [0.2] * 4]
    assert w.numpy() == pytest.approx(np.array(want), rel=1e-5)
    assert taper_weights(_Distributions(), ref, 0.0, 0.01) is None  # off
    assert taper_weights(object(), ref, 0.5, 0.01) is None  # a detector without probabilities


def test_a_taper_keeps_undoing_cross_talk_exact_and_the_round_key_free():
    """The weights multiply every change of the round alike, so the design matrix still
    undoes cross-talk exactly: weighting the estimates' changes gives what weighting each
    client's own change gives."""
    K, rows, cols = 5, 3, 8
    gen = torch.Generator().manual_seed(1)
    own = torch.randn(K, rows, cols, generator=gen, dtype=torch.float64)
    alpha = torch.rand(K, K, generator=gen, dtype=torch.float64) * 0.4 - 0.2
    designs = [_design(i, {j: float(alpha[i, j]) for j in range(K) if j != i}, K) for i in range(K)]
    A = np.array([[d.coefficients()[j] for j in range(K)] for d in designs])
    mixed = torch.einsum("ij,jrc->irc", torch.from_numpy(A), own)
    ref = torch.rand(rows, cols, generator=gen, dtype=torch.float64) + 0.01
    weights = taper_weights(_Distributions(), ref, 0.5, 0.05)
    law = {"probes": RowSubsets(2, cols)}
    plan = plan_round(1, range(K), range(K), designs)
    assert plan.undone
    by_estimates = standardise_round(
        plan, [{"probes": m.float()} for m in mixed], None, law, weights=weights
    )
    exact = standardise_round(
        plan_round(1, range(K), range(K), [_design(i, {}, K) for i in range(K)]),
        [{"probes": (o * weights["probes"]).float()} for o in own],
        None,
        law,
    )
    for a, b in zip(by_estimates, exact, strict=True):
        assert a["probes"].numpy() == pytest.approx(b["probes"].numpy(), abs=1e-4)
    plain = standardise_round(plan, [{"probes": m.float()} for m in mixed], None, law)
    assert not np.allclose(plain[0]["probes"].numpy(), by_estimates[0]["probes"].numpy())


def test_taper_settings_are_checked():
    assert (AttributionConfig().calibrated.taper, AttributionConfig().calibrated.taper_from) == (
        0.5,
        0.01,
    )
    for bad in (
        "attribution.calibrated.taper=-1",
        "attribution.calibrated.taper=3",
        "attribution.calibrated.taper_from=0",
    ):
        with pytest.raises(ConfigError, match=bad.split("=")[0].replace(".", r"\.")):
            load(RunConfig, None, [bad])


def test_spread_weights_lower_the_cells_every_client_moves_widely_with_a_floor_per_row():
    # Three clients' centred changes on two rows of four cells.
    D = torch.tensor(
        [
            [[4.0, 1.0, 0.1, 0.0], [2.0, 2.0, 2.0, 2.0]],
            [[-4.0, 1.0, -0.1, 0.0], [2.0, 2.0, 2.0, 2.0]],
            [[8.0, -3.0, 0.2, 0.0], [2.0, 2.0, 2.0, 2.0]],
        ],
        dtype=torch.float64,
    ).reshape(3, -1)
    w = spread_weights(D, 4, 0.5).reshape(2, 4)
    # Row 0: S = (4, 1, 0.1, 0), floor = its median 0.55; row 1: S = floor = 2.
    want = [[4**-0.5, 1.0, 0.55**-0.5, 0.55**-0.5], [2**-0.5] * 4]
    assert w.numpy() == pytest.approx(np.array(want))
    assert spread_weights(torch.zeros(3, 8), 4, 0.5).abs().sum() == 0  # nothing moved: 0


def test_spread_weights_lift_a_key_signal_that_sits_beside_wide_drift():
    """Clients drift widely on a few cells of every row (likely tokens) and a little on the
    rest; one client also carries a small shift on its owner's green cells. Read with spread
    weights, the drift's few cells no longer dominate: the owner's value stands further out
    in its exact tail (and a clean client's stays a null draw: the weights carry no key)."""
    K, rows, V, m = 8, 60, 32, 8
    gen = torch.Generator().manual_seed(3)
    scale = torch.ones(rows, V)
    scale[:, :3] = 30.0  # the likely tokens: every client moves them widely
    X = torch.randn(K, rows, V, generator=gen) * scale
    green = torch.zeros(rows, V).scatter_(
        1, torch.rand(rows, V, generator=gen).argsort(1)[:, :m], 1.0
    )
    X[0] += 0.6 * green
    designs = [_design(i, {}, K) for i in range(K)]
    law = RowSubsets(m, V)

    def log10_p(spread, client):
        out = standardise_round(
            plan_round(1, range(K), range(K), designs),
            [{"probes": x} for x in X],
            None,
            {"probes": law},
            spread=spread,
        )
        W = out[client]["probes"].double()
        return law.tail(W, float((W * green).sum())).log10_p

    assert log10_p(0.5, 0) < log10_p(0.0, 0) - 2
    assert log10_p(0.5, 0) < -4
    assert log10_p(0.5, 1) > -2


def test_spread_setting_is_checked():
    assert AttributionConfig().calibrated.spread == 0.25
    for bad in ("attribution.calibrated.spread=-0.5", "attribution.calibrated.spread=2"):
        with pytest.raises(ConfigError, match=r"attribution\.calibrated\.spread"):
            load(RunConfig, None, [bad])
