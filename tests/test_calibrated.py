"""The calibrated statistic: key randomisation, cross-talk undone, family-wise flags."""

import copy

import numpy as np
import pytest
import torch
from scipy.stats import norm
from scipy.stats import t as student_t

from fedattr.attribution import AttributionConfig, FedAttr, LinearScorer, draw_design
from fedattr.attribution.calibrated import CalibratedNull
from fedattr.attribution.scoring import DEFAULT_STATISTIC
from fedattr.cli import main
from fedattr.config import ConfigError, load
from fedattr.errors import UserError
from fedattr.experiments.config import DemoConfig, RunConfig
from fedattr.experiments.run import run_demo
from fedattr.secagg import SecAggConfig, make_aggregator

PAPER = 'variants=[{"name": "paper", "statistic": "paper"}]'
REALISTIC = ["synthetic.common=1.0", "synthetic.heterogeneity=0.5", "synthetic.dim=256",
             "secagg.backend=plaintext", PAPER]  # fmt: skip


def _null_p(seeds, r):
    """Null p-values of both statistics on the bed that fails like a real model."""
    cal, paper = [], []
    for seed in seeds:
        cfg = load(DemoConfig, None, [*REALISTIC, f"synthetic.r={r}", f"synthetic.seed={seed}",
                                      f"attribution.seed={seed}"])  # fmt: skip
        res = run_demo(cfg, progress=lambda _m: None)
        clean = [c for c in res.report.clients if not c.watermarked]
        cal += [c.p for c in clean]
        paper += [float(norm.sf(c["Z"])) for c in res.variants["paper"]["clients"]
                  if not c["watermarked"]]  # fmt: skip
    return np.array(cal), np.array(paper)


def test_paper_statistic_fails_and_calibrated_holds_its_level_on_the_realistic_bed():
    cal, paper = _null_p(range(24), r=0)
    assert len(cal) == 240
    # The shared per-round direction and persistent drift make the paper's p far too small...
    assert np.mean(paper < 0.05) > 0.12
    # ...while key randomisation keeps the level (binomial 99.9% range around 5% of 240).
    assert 0.01 <= np.mean(cal < 0.05) <= 0.10


def test_family_wise_flags_name_the_watermarked_clients_and_no_clean_one():
    for seed in range(3):
        cfg = load(DemoConfig, None, [*REALISTIC, f"synthetic.seed={seed}", "synthetic.r=3"])
        rep = run_demo(cfg, progress=lambda _m: None).report
        assert rep.statistic == "calibrated" and rep.null_keys == 200 and rep.alpha == 0.01
        assert rep.tpr == 1.0 and rep.fpr == 0.0
        wm = [c for c in rep.clients if c.watermarked]
        assert all(c.p_rank == pytest.approx(1 / 201) for c in wm)  # beyond every random key


def test_decorrelation_recovers_each_clients_own_statistic():
    rng = np.random.default_rng(0)
    K, n = 8, 6
    designs = [draw_design(range(K), i, 4, 3, rng) for i in range(K)]
    own = rng.normal(size=(K, 1 + n))  # each client's own statistic, owner key then null keys
    A = np.array([[d.coefficients()[j] for j in range(K)] for d in designs])
    Y = A @ own  # what the estimates carry: own statistic plus alpha-weighted cross-talk
    stats = [{"o": (float(y[0]), y[1:])} for y in Y]
    center = np.median(own, axis=0)
    null = CalibratedNull(decorrelate=True)
    null.add_round(1, list(range(K)), list(range(K)), designs, stats,
                   {"o": (float(center[0]), center[1:])})  # fmt: skip
    recovered = np.array([null.sums[i]["o"] for i in range(K)])
    expected = own - center  # then each round's row is scaled by its spread over all keys
    assert np.allclose(recovered, expected / expected.std(axis=1, ddof=1, keepdims=True))
    assert null.decorrelated[1] is True
    # Without every participant targeted, the estimates are used as they are.
    partial = CalibratedNull(decorrelate=True)
    partial.add_round(1, list(range(K)), [0, 1], designs[:2], stats[:2])
    assert partial.decorrelated[1] is False


def test_a_round_under_other_random_keys_is_refused_before_anything_is_added():
    """Each random key's sum over rounds is one replicate of the null only if it is the same
    key every round: a run resumed on a machine that draws other keys (CPU vs CUDA) stops."""
    rng = np.random.default_rng(1)
    K = 6
    designs = [draw_design(range(K), i, 3, 3, rng) for i in range(K)]

    def add(null, round_id, keys):
        stats = [{"o": (float(x), rng.normal(size=5))} for x in rng.normal(size=K)]
        null.add_round(round_id, list(range(K)), list(range(K)), designs, stats, keys=keys)

    null = CalibratedNull()
    add(null, 1, {"o": "3f2a"})
    add(null, 2, {"o": "3f2a"})
    add(null, 3, {"o": None})  # a scorer whose null does not depend on the machine
    saved = copy.deepcopy(null.state())
    resumed = CalibratedNull()
    resumed.load(copy.deepcopy(saved))
    with pytest.raises(UserError, match=r"^round 4 of owner 'o' .*"
                                        r"other random keys \(9b1c\) .* \(3f2a\)"):
        add(resumed, 4, {"o": "9b1c"})
    assert all(np.array_equal(resumed.sums[c]["o"], saved["sums"][c]["o"]) for c in range(K))
    assert 4 not in resumed.decorrelated and 4 not in resumed.per_round[0]["o"]
    add(resumed, 4, {"o": "3f2a"})  # the same keys again: the run goes on
    # A checkpoint from before keys were named accepts the keys it meets first.
    older = CalibratedNull()
    older.load({k: v for k, v in copy.deepcopy(saved).items() if k != "keys"})
    add(older, 4, {"o": "9b1c"})
    assert older.keys == {"o": "9b1c"}


class _NamedKeys(LinearScorer):
    """The synthetic scorer, drawing its null keys "on a machine" named ``machine``."""

    machine = "cpu"

    def null_identity(self) -> str:
        return self.machine


def test_fedattr_checks_the_scorers_random_keys_against_its_earlier_rounds():
    fed = FedAttr(AttributionConfig(N=3, M=3))
    scorer = _NamedKeys(torch.ones(4))

    def round_(t):
        sa = make_aggregator(SecAggConfig(backend="plaintext", min_members=3))
        sa.open_round(t, range(6))
        for j in range(6):
            sa.submit(j, torch.randn(4, dtype=torch.float64))
        return fed.attribute_round(t, sa, torch.zeros(4, dtype=torch.float64), scorer)

    round_(1)
    assert fed.calibrated.keys == {DEFAULT_STATISTIC: "cpu"}
    scorer.machine = "cuda"
    with pytest.raises(UserError, match=r"^round 2 of owner .* resume a run on the kind of"):
        round_(2)


def test_calibrated_p_is_exact_by_rank_and_t_tail_beyond_it():
    null = CalibratedNull(alpha=0.05)
    rng = np.random.default_rng(3)
    null.sums = {0: {"o": np.concatenate([[10.0], rng.normal(size=99)])},
                 1: {"o": np.concatenate([[0.0], rng.normal(size=99)])}}  # fmt: skip
    rep = null.report({0: True, 1: False})
    by = {c.id: c for c in rep.clients}
    assert by[0].p_rank == pytest.approx(1 / 100) and by[0].p < 1e-10 and by[0].flagged
    assert 0.05 < by[1].p < 0.95 and not by[1].flagged
    # gamma is the t threshold of level alpha / (K * owners) = 0.05 / 2, 98 degrees of freedom.
    assert rep.gamma == pytest.approx(student_t.isf(0.025, 98))


def test_calibrated_needs_a_detector_with_random_keys():
    with pytest.raises(ConfigError, match=r"detector=reading"):
        load(RunConfig, None, ["watermark.detector=greedy"])
    assert load(RunConfig, None, ["watermark.detector=greedy", "attribution.statistic=paper"])
    with pytest.raises(ConfigError, match=r"attribution\.alpha"):
        load(RunConfig, None, ["attribution.alpha=1.5"])
    fed = FedAttr(AttributionConfig())
    assert fed.null == "key-randomised"
    assert LinearScorer  # the synthetic scorer has key statistics (used above)


def test_calibration_command_writes_its_files_and_resumes(tmp_path, capsys):
    out = tmp_path / "cal"
    args = ["experiment", "calibration", "--seeds", "0-2", "--r", "0,3", "--out", str(out),
            "--set", "synthetic.dim=64", "--set", "secagg.backend=plaintext"]  # fmt: skip
    assert main(args) == 0
    assert {p.name for p in out.iterdir()} >= {"calibration.json", "calibration.md", "qq.png",
                                              "r0-seed0", "r3-seed2"}  # fmt: skip
    md = (out / "calibration.md").read_text()
    assert "| calibrated | 51 |" in md and "| paper | 51 |" in md  # 30 + 3 x 7 null pairs
    before = (out / "r0-seed1" / "results.json").read_bytes()
    assert main(args) == 0  # finished runs are kept
    assert (out / "r0-seed1" / "results.json").read_bytes() == before
    capsys.readouterr()
    assert main([*args[:-4], "--set", "synthetic.dim=32"]) == 2
    assert "another configuration" in capsys.readouterr().err
    assert main(["experiment", "calibration", "--bed", "nope"]) == 2
