"""Property-based checks: bad input gets a clear error, never a traceback from deep inside."""

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedattr.attribution import DesignError, validate_parameters
from fedattr.config import ConfigError, load
from fedattr.pipeline.config import DemoConfig
from fedattr.secagg import BACKENDS, QueryRefused, SecAggConfig, SecAggError, make_aggregator

K = 7
_UPDATES = {j: torch.arange(4, dtype=torch.float64) * (j + 1) for j in range(K)}


@settings(max_examples=150, deadline=None)
@given(
    backend=st.sampled_from(list(BACKENDS)),
    subset=st.lists(st.integers(-2, K + 2), max_size=9),
)
def test_any_subset_query_is_answered_correctly_or_refused_clearly(backend, subset):
    sa = make_aggregator(SecAggConfig(backend=backend, min_members=3))
    sa.open_round(0, range(K))
    for j, u in _UPDATES.items():
        sa.submit(j, u)
    try:
        got = sa.subset_sum_flat(subset)
    except QueryRefused as exc:
        assert str(exc).startswith("query refused")
        return
    assert np.allclose(got, sum(_UPDATES[j].numpy() for j in subset), atol=1e-6)


@settings(max_examples=100, deadline=None)
@given(coefs=st.dictionaries(st.integers(-1, K), st.integers(-5, 5), max_size=K + 2))
def test_any_fused_query_is_answered_correctly_or_refused_clearly(coefs):
    sa = make_aggregator(SecAggConfig(backend="pairwise-mask", min_members=3))
    sa.open_round(0, range(K))
    for j, u in _UPDATES.items():
        sa.submit(j, u)
    try:
        got = sa.combination_flat(coefs, denominator=2)
    except QueryRefused as exc:
        assert str(exc).startswith("query refused")
        return
    expected = sum(c * _UPDATES[j].numpy() for j, c in coefs.items()) / 2
    assert np.allclose(got, expected, atol=1e-6)


@settings(max_examples=200, deadline=None)
@given(K_=st.integers(-3, 30), N=st.integers(-3, 30), M=st.integers(-3, 30), nsa=st.integers(1, 10))
def test_design_parameters_valid_or_named(K_, N, M, nsa):
    try:
        validate_parameters(K_, N, M, nsa)
    except DesignError as exc:
        assert str(exc).split(":")[0] in {"K", "N", "M"}


_values = st.one_of(
    st.integers(-5, 70000),
    st.floats(allow_nan=True),
    st.text(max_size=5),
    st.booleans(),
    st.none(),
    st.lists(st.integers(-2, 12), max_size=4),
)
_keys = st.sampled_from(
    [
        "synthetic.K",
        "synthetic.rounds",
        "synthetic.r",
        "synthetic.dim",
        "synthetic.signal",
        "synthetic.watermarked",
        "secagg.backend",
        "secagg.min_members",
        "secagg.ring_bits",
        "secagg.frac_bits",
        "secagg.clip",
        "secagg.prg",
        "secagg.release_budget",
        "attribution.protocol.N",
        "attribution.protocol.M",
        "attribution.paper.threshold",
        "attribution.protocol.mode",
        "attribution.bogus",
        "nosection.x",
    ]
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(overrides=st.dictionaries(_keys, _values, max_size=4))
def test_any_configuration_loads_or_fails_with_a_config_error(overrides):
    import json

    items = [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    try:
        load(DemoConfig, None, items)
    except (ConfigError, DesignError, SecAggError) as exc:
        assert str(exc)  # a message, naming what is wrong
