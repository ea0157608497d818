import numpy as np
import pytest
import torch

from fedattr.attribution import AttributionConfig, FedAttr, LinearScorer
from fedattr.attribution.config import ProtocolConfig
from fedattr.fl.synthetic import SyntheticConfig
from fedattr.pipeline.config import DemoConfig
from fedattr.pipeline.run import run_demo
from fedattr.secagg import QueryFailed, SecAggConfig, SecAggError, make_aggregator

K = 10


def _round(backend="pairwise-mask", **kw):
    sa = make_aggregator(SecAggConfig(backend=backend, min_members=5, **kw))
    sa.open_round(1, range(K))
    for j in range(K):
        sa.submit(j, torch.full((4,), float(j), dtype=torch.float64))
    return sa


def test_offline_member_fails_the_query_and_releases_nothing():
    sa = _round()
    sa.drop(3)
    with pytest.raises(
        QueryFailed, match=r"members \[3\] did not answer; no sum was released"
    ) as e:
        sa.subset_sum_flat([0, 1, 2, 3, 4])
    assert e.value.missing == (3,) and sa.log == []
    total, answered = sa.sum_of_available(range(K))
    assert answered == (0, 1, 2, 4, 5, 6, 7, 8, 9)
    assert torch.allclose(total, torch.full((4,), float(sum(answered)), dtype=torch.float64))
    with pytest.raises(SecAggError, match="not registered"):
        sa.drop(42)


def test_backends_with_one_upload_per_round_do_not_need_clients_online():
    sa = _round("two-server")
    sa.drop(3)
    assert np.allclose(sa.subset_sum_flat([0, 1, 2, 3, 4]), 10.0)


def test_fedattr_redraws_around_a_dropped_client_and_skips_it_as_target():
    sa = _round()
    sa.drop(7)
    fed = FedAttr(AttributionConfig(protocol=ProtocolConfig(N=5, M=3)))
    rec = fed.attribute_round(
        1, sa, torch.zeros(4, dtype=torch.float64), LinearScorer(torch.ones(4))
    )
    assert rec.skipped == [7] and rec.dropouts == [7]
    assert all(7 not in u and 7 not in v for t in rec.targets for u in t.U for v in t.V)
    assert len(rec.targets) == K - 1


@pytest.mark.parametrize("mode", ["paper", "hardened"])
def test_transient_failures_are_survived(mode):
    cfg = DemoConfig(
        synthetic=SyntheticConfig(dim=64, rounds=3),
        secagg=SecAggConfig(dropout=0.03, seed=1),
        attribution=AttributionConfig(protocol=ProtocolConfig(mode=mode)),
    )
    result = run_demo(cfg, progress=lambda _m: None)
    dropped = [c for r in result.rounds for c in r["dropouts"]]
    assert dropped  # failures happened, and the run still completed every round
    assert len(result.rounds) == 3
    with pytest.raises(SecAggError, match="dropout"):
        SecAggConfig(dropout=1.0)
