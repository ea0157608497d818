import numpy as np
import pytest
import torch

from fedattr.attribution import AttributionConfig, DesignError, FedAttr, LinearScorer
from fedattr.attribution.config import CalibratedConfig, PaperConfig, ProtocolConfig
from fedattr.fl.synthetic import SyntheticConfig
from fedattr.pipeline.config import DemoConfig
from fedattr.pipeline.run import run_demo
from fedattr.secagg import SecAggConfig, make_aggregator

QUIET = {"progress": lambda _m: None}


def test_paper_defaults_flag_exactly_the_watermarked_clients():
    cfg = DemoConfig()  # K=10, N=5, M=5, r=3, T=5, gamma=4, pairwise-mask SA
    assert (
        cfg.synthetic.K,
        cfg.attribution.protocol.N,
        cfg.attribution.protocol.M,
        cfg.synthetic.r,
        cfg.synthetic.rounds,
        cfg.attribution.paper.threshold,
    ) == (10, 5, 5, 3, 5, 4.0)
    assert cfg.secagg.backend == "pairwise-mask"
    result = run_demo(cfg, **QUIET)
    wm = cfg.synthetic.watermarked_ids()
    assert sorted(result.report.flagged) == wm
    assert result.report.tpr == 1.0 and result.report.fpr == 0.0
    assert result.sa_queries == 5 * (2 * 5 * 10 + 1)  # 2MK attribution queries + 1 aggregate


def test_backends_give_the_same_attribution():
    base = DemoConfig(synthetic=SyntheticConfig(dim=64, rounds=2))
    zs = []
    for backend in ("plaintext", "two-server", "pairwise-mask"):
        base.secagg = SecAggConfig(backend=backend)
        rep = run_demo(base, **QUIET).report
        zs.append([c.Z for c in rep.clients])
    assert np.allclose(zs[0], zs[1], atol=1e-6) and np.allclose(zs[0], zs[2], atol=1e-6)


def test_no_watermarked_clients_nobody_flagged():
    cfg = DemoConfig(synthetic=SyntheticConfig(r=0), secagg=SecAggConfig(backend="plaintext"))
    rep = run_demo(cfg, **QUIET).report
    assert rep.flagged == [] and rep.tpr is None and rep.fpr == 0.0


def test_reference_scored_once_per_round_and_partial_participation():
    calls = []
    s = torch.zeros(8, dtype=torch.float64)
    s[0] = 1.0
    lin = LinearScorer(s)

    def scorer(w):
        calls.append(1)
        return lin(w)

    fed = FedAttr(AttributionConfig(statistic="paper", protocol=ProtocolConfig(N=2, M=3)))
    sa = make_aggregator(SecAggConfig(min_members=2))
    records = []
    for t, participants in ((1, [0, 1, 2, 3, 4]), (2, [1, 2, 3, 4, 5])):
        sa.open_round(t, participants)
        for j in participants:
            sa.submit(j, torch.full((8,), float(j)))
        n_before = len(calls)
        record = fed.attribute_round(t, sa, torch.zeros(8), scorer)
        assert len(calls) - n_before == 1 + len(participants)
        records.append(record)
        sa.close_round()
    rep = fed.report()
    by = {c.id: c for c in rep.clients}
    assert set(by[0].z) == {1} and set(by[5].z) == {2} and set(by[3].z) == {1, 2}
    # Linear scorer, unbiased estimate: z concentrates around the client's own coordinate.
    assert records[0].targets[0].queries == 6


def test_round_too_small_for_the_design_is_a_clear_error():
    fed = FedAttr(AttributionConfig(protocol=ProtocolConfig(N=5, M=5)))
    sa = make_aggregator(SecAggConfig(min_members=2))
    sa.open_round(1, range(6))
    for j in range(6):
        sa.submit(j, torch.zeros(3))
    with pytest.raises(DesignError, match="N: the subset size must satisfy 1 <= N < K-1 = 5"):
        fed.attribute_round(1, sa, torch.zeros(3), LinearScorer(torch.ones(3)))


def _plaintext_round(updates: dict) -> object:
    """A plaintext SA round (threshold 2) holding ``updates``."""
    sa = make_aggregator(SecAggConfig(backend="plaintext", min_members=2))
    sa.open_round(1, list(updates))
    for c, u in updates.items():
        sa.submit(c, u)
    return sa


def test_centering_removes_the_common_direction_from_every_score():
    # Every client's update is a common step along the scorer's direction plus its own noise
    # orthogonal to it: uncentred, each differential score carries the common step; centred on
    # the round's mean, none does (the linear scorer then sees only the deviations).
    K, d = 8, 32
    gen = torch.Generator().manual_seed(0)
    s = torch.zeros(d, dtype=torch.float64)
    s[0] = 1.0
    updates = {}
    for c in range(K):
        noise = torch.randn(d, generator=gen, dtype=torch.float64)
        noise[0] = 0.0
        updates[c] = (2.0 * s + noise).float()
    mean = torch.stack(list(updates.values())).mean(0)
    scores = {}
    for center in (False, True):
        sa = _plaintext_round(updates)
        fa = FedAttr(
            AttributionConfig(
                statistic="paper",
                protocol=ProtocolConfig(N=3, M=4),
                paper=PaperConfig(mean_reference=center),
            )
        )
        rec = fa.attribute_round(1, sa, torch.zeros(d), LinearScorer(s), center=mean)
        scores[center] = [t.z["score"] for t in rec.targets]
    assert np.allclose(scores[False], 2.0, atol=1e-4)
    assert np.allclose(scores[True], 0.0, atol=1e-4)
    with pytest.raises(ValueError, match="center"):
        FedAttr(
            AttributionConfig(
                statistic="paper",
                protocol=ProtocolConfig(N=3, M=4),
                paper=PaperConfig(mean_reference=True),
            )
        ).attribute_round(1, sa, torch.zeros(d), LinearScorer(s))


def test_calibrated_round_reads_the_sa_mean_only_where_cross_talk_is_not_undone():
    # Decorrelated rounds (every participant a target) take the common part from the clients'
    # median, so the round's SA mean is not read; without decorrelation it is the center.
    K, d = 8, 16
    gen = torch.Generator().manual_seed(1)
    updates = {c: torch.randn(d, generator=gen) for c in range(K)}
    mean = torch.stack(list(updates.values())).mean(0)

    class Counting(LinearScorer):
        def __init__(self) -> None:
            super().__init__(torch.ones(d))
            self.reads: list[torch.Tensor] = []

        def observe(self, params):
            self.reads.append(params)
            return super().observe(params)

    reads = {}
    for decorrelate in (True, False):
        sa = _plaintext_round(updates)
        fa = FedAttr(
            AttributionConfig(
                protocol=ProtocolConfig(N=3, M=4),
                calibrated=CalibratedConfig(decorrelate=decorrelate),
            )
        )
        scorer = Counting()
        rec = fa.attribute_round(1, sa, torch.zeros(d), scorer, center=mean)
        assert rec.decorrelated is decorrelate
        assert rec.models_scored == len(scorer.reads)
        reads[decorrelate] = scorer.reads
    assert len(reads[True]) == 1 + K  # the reference and every estimate
    assert len(reads[False]) == 2 + K and torch.allclose(reads[False][-1], mean)
