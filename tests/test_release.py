"""Joint-release leakage: audit, fused queries, SA-side release policy, hardened mode."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from fedattr.attribution import (
    AttributionConfig,
    draw_design,
    estimate_update,
    single_estimate_budget,
)
from fedattr.attribution.audit import audit_queries
from fedattr.attribution.config import CalibratedConfig, ProtocolConfig
from fedattr.attribution.design import DesignError
from fedattr.cli import main
from fedattr.fl.synthetic import SyntheticConfig
from fedattr.pipeline.config import DemoConfig
from fedattr.pipeline.run import run_demo
from fedattr.reporting.run_folder import audit_run
from fedattr.secagg import (
    BACKENDS,
    QueryRefused,
    ReleasePolicy,
    SecAggConfig,
    make_aggregator,
)

K, N, M = 10, 5, 5
QUIET = {"progress": lambda _m: None}


def _sa(backend, budget=0.0, D=16):
    gen = torch.Generator().manual_seed(1)
    ups = {j: torch.randn(D, generator=gen, dtype=torch.float64) for j in range(K)}
    sa = make_aggregator(SecAggConfig(backend=backend, min_members=N, release_budget=budget))
    sa.open_round(1, range(K))
    for j, u in ups.items():
        sa.submit(j, u)
    return sa, ups


def test_single_estimate_leakage_is_the_paper_gaussian_term():
    for seed in range(5):
        d = draw_design(range(K), 3, N, M, np.random.default_rng(seed))
        policy = ReleasePolicy()
        policy.reset(range(K))
        policy.record(d.coefficients())
        assert policy.leakage()[3] == pytest.approx(0.5 * math.log1p(1 / d.stats.c), rel=1e-9)
        assert policy.leakage()[3] <= single_estimate_budget(K, N, M) + 1e-12


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_fused_query_gives_the_subset_sum_estimate(backend):
    sa, ups = _sa(backend)
    d = draw_design(range(K), 2, N, M, np.random.default_rng(4), min_members=N)
    fused = estimate_update(sa, d, fused=True)
    assert sa.log[-1].subset == tuple(j for j, c in d.integer_coefficients().items() if c)
    assert sa.log[-1].denominator == M
    assert np.allclose(fused, estimate_update(sa, d), atol=1e-9)
    exact = sum(d.coefficients()[j] * ups[j].numpy() for j in range(K))
    assert np.allclose(fused, exact, atol=1e-8)


def test_fused_query_input_checks():
    sa, _ = _sa("pairwise-mask")
    with pytest.raises(QueryRefused, match="coefficients must be integers"):
        sa.combination_flat({0: 0.5, 1: 1, 2: 1, 3: 1, 4: 1})
    with pytest.raises(QueryRefused, match="below the secure-aggregation threshold"):
        sa.combination_flat({0: 1, 1: -1, 2: 0, 3: 0, 4: 0, 5: 0})
    with pytest.raises(QueryRefused, match="exceeds what the ring holds"):
        sa.combination_flat(dict.fromkeys(range(6), 2**40))


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_release_policy_refuses_the_query_that_exposes_a_client(backend):
    sa, _ = _sa(backend, budget=math.inf)  # forbid exact recovery only
    answered = 0
    with pytest.raises(QueryRefused, match="exactly recoverable") as info:
        for i in range(K):
            d = draw_design(range(K), i, N, M, np.random.default_rng([0, i]), min_members=N)
            for subset in (*d.U, *d.V):
                sa.subset_sum_flat(subset)
                answered += 1
    assert 0 < answered < 2 * M * K
    if backend == "two-server":
        assert "aggregator A" in str(info.value)
    if backend == "pairwise-mask":
        assert set(vars(sa.server)) == {"public_keys"}  # the server enforces nothing itself
    assert not any(math.isinf(v) for v in sa.leakage().values())


def test_budgeted_policy_admits_one_estimate_but_not_all():
    budget = single_estimate_budget(K, N, M)
    sa, _ = _sa("pairwise-mask", budget=budget)
    sa.subset_sum_flat(range(K))  # the FL aggregate
    admitted = 0
    for i in range(K):
        d = draw_design(range(K), i, N, M, np.random.default_rng([1, i]), min_members=N)
        try:
            estimate_update(sa, d, fused=True)
            admitted += 1
        except QueryRefused as exc:
            assert "release policy" in str(exc)
    assert 1 <= admitted < K
    assert max(sa.leakage().values()) <= budget + 1e-12


@pytest.mark.parametrize("backend", ["plaintext", "pairwise-mask"])
def test_reconstruction_attack_recovers_every_update_in_paper_mode(backend):
    sa, ups = _sa(backend, D=32)
    rows, answers = [], []
    for i in range(K):
        d = draw_design(range(K), i, N, M, np.random.default_rng([0, i]), min_members=N)
        for subset in (*d.U, *d.V):
            row = np.zeros(K)
            row[list(subset)] = 1
            rows.append(row)
            answers.append(sa.subset_sum_flat(subset))
    recovered, *_ = np.linalg.lstsq(np.array(rows), np.array(answers), rcond=None)
    truth = np.stack([ups[j].numpy() for j in range(K)])
    assert np.max(np.abs(recovered - truth)) < 1e-8
    assert all(math.isinf(v) for v in sa.leakage().values())


def test_audit_of_paper_and_hardened_runs(tmp_path):
    paper = run_demo(DemoConfig(synthetic=SyntheticConfig(dim=64, rounds=2)), **QUIET)
    paper.write(tmp_path / "paper")
    rounds = audit_run(tmp_path / "paper")
    assert [r.recoverable for r in rounds] == [list(range(K))] * 2
    hard_cfg = DemoConfig(
        synthetic=SyntheticConfig(dim=64, rounds=3),
        attribution=AttributionConfig(protocol=ProtocolConfig(mode="hardened")),
    )
    assert hard_cfg.secagg.release_budget == pytest.approx(single_estimate_budget(K, N, M))
    hard = run_demo(hard_cfg, **QUIET)
    hard.write(tmp_path / "hard")
    audited = audit_run(tmp_path / "hard")
    assert all(not r.recoverable for r in audited)
    assert max(r.max_leakage for r in audited) <= hard_cfg.secagg.release_budget + 1e-12
    # Fused queries: one SA session per admitted target plus the round's aggregate.
    targeted = sum(len(r["targets"]) for r in hard.rounds)
    assert hard.sa_queries == targeted + 3
    assert main(["audit", str(tmp_path / "hard"), "--json"]) == 0


def test_paper_mode_with_fused_queries_gives_the_same_attribution(tmp_path):
    syn = SyntheticConfig(dim=64, rounds=2)
    # Design seed 22 draws one design (round 1, target 4) whose nonzero coefficients cover
    # only 4 clients: SA would refuse that combination, so it is asked as its subset sums.
    subsets = run_demo(DemoConfig(synthetic=syn, attribution=AttributionConfig(seed=22)), **QUIET)
    cfg = DemoConfig(
        synthetic=syn,
        attribution=AttributionConfig(seed=22, protocol=ProtocolConfig(queries="fused")),
    )
    fused = run_demo(cfg, **QUIET)
    small = []
    for a, b in zip(subsets.rounds, fused.rounds, strict=True):
        for ta, tb in zip(a["targets"], b["targets"], strict=True):
            assert (ta["target"], ta["U"], ta["V"]) == (tb["target"], tb["U"], tb["V"])
            coef = {j: 0 for j in range(K)}
            for u in ta["U"]:
                for j in u:
                    coef[j] += 1
            for v in ta["V"]:
                for j in v:
                    coef[j] -= 1
            if sum(1 for c in coef.values() if c) < N:
                small.append((a["round"], ta["target"]))
                assert (tb["fused"], tb["queries"]) == (False, 2 * M)
            else:
                assert (tb["fused"], tb["queries"]) == (True, 1)
            assert (ta["fused"], ta["queries"]) == (False, 2 * M)
            for stat, z in ta["z"].items():
                assert tb["z"][stat] == pytest.approx(z, rel=1e-6, abs=1e-9)
    assert small == [(1, 4)]
    # One SA session per fused target, 2M for the other, plus each round's aggregate.
    assert fused.sa_queries == 2 * (K + 1) - 1 + 2 * M
    assert subsets.sa_queries == 2 * (2 * M * K + 1)
    assert fused.report.flagged == subsets.report.flagged
    # A ring too small for some combinations: those targets are asked as subset sums.
    ring = SecAggConfig(backend="plaintext", ring_bits=32, frac_bits=16, clip=1900.0)
    assert ring.codec().max_members() == 17  # |coefficients| sum to 11-23 here
    small = run_demo(DemoConfig(synthetic=syn, secagg=ring, attribution=cfg.attribution), **QUIET)
    asked = [t["fused"] for r in small.rounds for t in r["targets"]]
    assert 0 < sum(asked) < len(asked)
    for r, s in zip(fused.rounds, small.rounds, strict=True):
        for tf, ts in zip(r["targets"], s["targets"], strict=True):
            for stat, z in tf["z"].items():
                assert ts["z"][stat] == pytest.approx(z, rel=1e-3, abs=1e-6)  # 16 fraction bits
    # The K estimates still determine every update (the README's Finding 1).
    fused.write(tmp_path / "fused")
    assert [r.recoverable for r in audit_run(tmp_path / "fused")] == [list(range(K))] * 2
    message = r"attribution\.protocol\.queries: unknown 'sums'; allowed: subsets, fused"
    with pytest.raises(DesignError, match=message):
        AttributionConfig(protocol=ProtocolConfig(queries="sums"))


def test_hardened_mode_reaches_full_attribution_with_more_rounds():
    # Its rounds keep cross-talk; de-mixed across rounds (the default), every client's mean
    # change is its own and the p-values are calibrated, so they name clients by default.
    cfg = DemoConfig(
        synthetic=SyntheticConfig(rounds=20),
        attribution=AttributionConfig(protocol=ProtocolConfig(mode="hardened")),
    )
    rep = run_demo(cfg, **QUIET).report
    assert rep.tpr == 1.0 and rep.fpr == 0.0
    assert all(c.calibrated for c in rep.clients) and not rep.cross_talk
    # Summed as kept, they are uncalibrated: they name a client only when asked to.
    kept = AttributionConfig(
        protocol=ProtocolConfig(mode="hardened"),
        calibrated=CalibratedConfig(across_rounds="keep", name_uncalibrated=True),
    )
    rep = run_demo(dataclasses.replace(cfg, attribution=kept), **QUIET).report
    assert rep.tpr == 1.0 and rep.fpr == 0.0
    assert not any(c.calibrated for c in rep.clients) and rep.cross_talk
    assert audit_queries([]) == []
