"""The ceiling: the same statistic read on each client's true update (``ceiling = true``)."""

import pytest
import torch

from conftest import small_overrides as _small
from fedattr.attribution.config import AttributionConfig
from fedattr.attribution.observer import CeilingObserver
from fedattr.attribution.protocol import FedAttr
from fedattr.config import ConfigError, load
from fedattr.fl.pool import PlaintextTap
from fedattr.fl.server import RoundContext
from fedattr.fl.timing import Stopwatch
from fedattr.pipeline.config import RunConfig
from fedattr.pipeline.run import run_experiment
from fedattr.secagg import SecAggConfig, make_aggregator


def test_the_ceiling_reads_each_clients_submitted_update_with_an_identity_design():
    """Each answering client is a target whose estimate is exactly what it submitted to SA
    (its update times n * p_i) and whose design weighs no other client; no SA query is made."""
    K = 4
    gen = torch.Generator().manual_seed(0)
    updates = {c: {"a": torch.randn(3, 2, generator=gen)} for c in range(K)}
    scales = {c: 0.5 + c for c in range(K)}
    sa = make_aggregator(SecAggConfig(backend="plaintext", min_members=2))
    sa.open_round(1, range(K))
    for c in range(K):
        sa.submit(c, {"a": updates[c]["a"] * scales[c]})
    tap = PlaintextTap()
    tap.updates = updates
    answered = (0, 1, 3)  # client 2 dropped out: not in the aggregate, not a target
    ctx = RoundContext(1, 1, list(range(K)), answered, sa, None, {}, None, {}, Stopwatch(()), None)
    ceiling = CeilingObserver(
        FedAttr(AttributionConfig()), None, tap, lambda ps: {c: scales[c] for c in ps}
    )
    before = len(sa.log)
    est = ceiling._estimates(ctx)
    assert len(sa.log) == before  # nothing asked of SA
    assert [e.target for e in est.estimates] == [0, 1, 3]
    assert est.participants == [0, 1, 3]
    for e in est.estimates:
        want = (updates[e.target]["a"] * scales[e.target]).double().reshape(-1).numpy()
        assert e.flat == pytest.approx(want)
        assert e.design.coefficients() == {c: float(c == e.target) for c in answered}


def test_a_run_with_the_ceiling_reports_it_beside_fedattr(tiny_cache):
    cfg = load(
        RunConfig, None, _small(tiny_cache, "ceiling=true", "attribution.calibrated.null_keys=0")
    )
    result = run_experiment(cfg, progress=lambda _m: None)
    d = result.to_dict()
    ceiling = d["variants"]["ceiling"]
    assert ceiling["sa_queries"] == 0 and ceiling["statistic"] == "calibrated"
    assert [c["id"] for c in ceiling["clients"]] == [c["id"] for c in d["clients"]]
    assert set(ceiling["by_statistic"]) == set(d["by_statistic"])
    # The FedAttr reading is unchanged by the ceiling beside it (two of four clients read per
    # round, T = 2), and the ceiling read the true updates: other values than the estimates'.
    assert d["sa_queries"] == 2 * (2 * 2 * 4 + 1)
    own = {c["id"]: c["Z"] for c in d["clients"]}
    true = {c["id"]: c["Z"] for c in ceiling["clients"]}
    assert own != true
    with pytest.raises(ConfigError, match="ceiling"):
        load(RunConfig, None, ["ceiling=true", "attribution.scoring=owner"])


def test_calibration_summarises_every_reading_the_runs_carry():
    """``experiment calibration`` reports the ceiling (and any variant) beside the run's own
    reading and the paper's, where every run carries it; a calibrated variant's null pairs are
    read by their p, the paper's by its Z."""
    from fedattr.experiments.calibration import summarize

    def clients(flags):
        return [
            {"id": i, "watermarked": i == 0, "flagged": f, "p": 0.5, "Z": 0.0, "statistic": "o"}
            for i, f in enumerate(flags)
        ]

    def run(extra):
        view = {"statistic": "calibrated", "clients": clients([True, False]), "by_statistic": {}}
        variants = {
            "paper": {"statistic": "paper", "clients": clients([True, True]), "by_statistic": {}},
            "ceiling": {**view, "clients": clients([False, False])},
            **extra,
        }
        return {**view, "federation": {"watermarked": {"0": "o"}}, "variants": variants}

    only_one = {"untapered": {"statistic": "calibrated", "clients": clients([1, 0])}}
    summary = summarize([run({}), run(only_one)])
    stats = summary["statistics"]
    assert list(stats) == ["calibrated", "paper", "ceiling"]  # not a variant one run lacks
    assert stats["calibrated"]["tpr"] == 1.0 and stats["ceiling"]["tpr"] == 0.0
    assert stats["paper"]["runs_naming_clean"] == 2 and stats["ceiling"]["runs_naming_clean"] == 0
    assert stats["ceiling"]["null_p"] == [0.5, 0.5]  # the clean client's p, one per run
