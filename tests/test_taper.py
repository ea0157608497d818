"""The probability taper of the calibrated statistic (``attribution.taper``): key-free cell
weights from the round's reference model."""

import math

import numpy as np
import pytest
import torch

from fedattr.attribution.calibrated import standardise_round, taper_weights
from fedattr.attribution.config import AttributionConfig
from fedattr.attribution.design import DesignStats, QueryDesign
from fedattr.config import ConfigError, load
from fedattr.pipeline.config import RunConfig
from fedattr.watermarks.tail import RowSubsets


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
    by_estimates, undone = standardise_round(
        range(K),
        range(K),
        designs,
        [{"probes": m.float()} for m in mixed],
        None,
        law,
        weights=weights,
    )
    assert undone
    exact, _ = standardise_round(
        range(K),
        range(K),
        [_design(i, {}, K) for i in range(K)],
        [{"probes": (o * weights["probes"]).float()} for o in own],
        None,
        law,
    )
    for a, b in zip(by_estimates, exact, strict=True):
        assert a["probes"].numpy() == pytest.approx(b["probes"].numpy(), abs=1e-4)
    plain, _ = standardise_round(
        range(K), range(K), designs, [{"probes": m.float()} for m in mixed], None, law
    )
    assert not np.allclose(plain[0]["probes"].numpy(), by_estimates[0]["probes"].numpy())


def test_taper_settings_are_checked():
    assert (AttributionConfig().taper, AttributionConfig().taper_from) == (0.5, 0.01)
    for bad in ("attribution.taper=-1", "attribution.taper=3", "attribution.taper_from=0"):
        with pytest.raises(ConfigError, match=bad.split("=")[0].replace(".", r"\.")):
            load(RunConfig, None, [bad])
