import numpy as np
import pytest
import torch

from fedattr.attribution import draw_design, estimate_update, predicted_error_trace
from fedattr.attribution.privacy import acceptance_rate, expected_c
from fedattr.secagg import SecAggConfig, make_aggregator

K, N, M, D = 10, 5, 5, 6


def _sa(updates, backend="plaintext"):
    sa = make_aggregator(SecAggConfig(backend=backend, min_members=N))
    sa.open_round(0, range(K))
    for j, u in updates.items():
        sa.submit(j, u)
    return sa


@pytest.fixture(scope="module")
def updates():
    gen = torch.Generator().manual_seed(11)
    base = torch.randn(D, generator=gen, dtype=torch.float64)
    return {
        j: base + torch.randn(D, generator=gen, dtype=torch.float64) * (1 + j / 3) for j in range(K)
    }


@pytest.fixture(scope="module")
def draws(updates):
    sa = _sa(updates)
    rng = np.random.default_rng(99)
    target = 2
    est = np.stack(
        [
            estimate_update(sa, draw_design(range(K), target, N, M, rng, min_members=N))
            for _ in range(3000)
        ]
    )
    return target, est


def test_estimate_equals_coefficient_formula_through_every_backend(updates):
    d = draw_design(range(K), 4, N, M, np.random.default_rng(1), min_members=N)
    coef = d.coefficients()
    exact = sum(coef[j] * updates[j].numpy() for j in range(K))
    for backend in ("plaintext", "pairwise-mask", "two-server"):
        got = estimate_update(_sa(updates, backend), d)
        assert np.allclose(got, exact, atol=1e-8)


def test_unbiased(updates, draws):
    target, est = draws
    mean = est.mean(axis=0)
    se = est.std(axis=0, ddof=1) / np.sqrt(len(est))
    assert np.all(np.abs(mean - updates[target].numpy()) < 4.5 * se)


def test_error_trace_matches_theory(updates, draws):
    target, est = draws
    flat = {j: u.numpy() for j, u in updates.items()}
    empirical = float(np.mean(np.sum((est - flat[target]) ** 2, axis=1)))
    acc = acceptance_rate(K, N, M, trials=40_000, seed=5)
    exact = predicted_error_trace(flat, target, acc.mean_c_accepted)
    # Paper's form (2/M) N(K-1-N)/(K-2) * mean_j ||Delta_j - mean||^2, before conditioning:
    paper = predicted_error_trace(flat, target, expected_c(K, N, M))
    assert empirical == pytest.approx(exact, rel=0.08)
    # Rejecting low-c designs raises E[c] by about 10%: the paper's unconditional variance
    # understates the accepted estimator's error by that factor.
    assert 1.0 < acc.mean_c_accepted / expected_c(K, N, M) < 1.2
    assert paper < exact
