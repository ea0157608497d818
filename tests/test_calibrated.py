"""The calibrated statistic: changes read with the key, exact tails, family-wise flags."""

import numpy as np
import pytest
import torch
from scipy.stats import norm

from fedattr.attribution import AttributionConfig, FedAttr, LinearScorer, draw_design
from fedattr.attribution.calibrated.sums import CalibratedNull
from fedattr.attribution.config import CalibratedConfig
from fedattr.attribution.scoring import DEFAULT_STATISTIC
from fedattr.cli import main
from fedattr.config import ConfigError, load
from fedattr.errors import UserError
from fedattr.experiments.calibration import clopper_pearson
from fedattr.pipeline.config import DemoConfig, RunConfig
from fedattr.pipeline.run import run_demo

PAPER = 'variants=[{"name": "paper", "statistic": "paper"}]'
REALISTIC = [
    "synthetic.common=1.0",
    "synthetic.heterogeneity=0.5",
    "synthetic.dim=256",
    "secagg.backend=plaintext",
    PAPER,
]


def _null_p(seeds, r):
    """Null p-values of both statistics on the bed that fails like a real model."""
    cal, paper = [], []
    for seed in seeds:
        cfg = load(
            DemoConfig,
            None,
            [*REALISTIC, f"synthetic.r={r}", f"synthetic.seed={seed}", f"attribution.seed={seed}"],
        )
        res = run_demo(cfg, progress=lambda _m: None)
        clean = [c for c in res.report.clients if not c.watermarked]
        cal += [c.p for c in clean]
        paper += [
            float(norm.sf(c["Z"])) for c in res.variants["paper"]["clients"] if not c["watermarked"]
        ]
    return np.array(cal), np.array(paper)


@pytest.mark.slow
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
        assert all(c.tail == "exact" for c in rep.clients)


def test_decorrelation_recovers_each_clients_own_change():
    rng = np.random.default_rng(0)
    K, dim = 8, 64
    designs = [draw_design(range(K), i, 4, 3, rng) for i in range(K)]
    own = rng.normal(size=(K, dim))  # each client's own change
    A = np.array([[d.coefficients()[j] for j in range(K)] for d in designs])
    Y = A @ own  # what the estimates carry: own change plus alpha-weighted cross-talk
    scorer = LinearScorer(torch.tensor(rng.normal(size=dim)))
    changes = [{DEFAULT_STATISTIC: torch.tensor(y)} for y in Y]
    null = CalibratedNull(decorrelate=True, null_keys=0)
    shown = null.add_round(
        null.plan(1, list(range(K)), list(range(K)), designs, scorer), changes, None, scorer
    )
    assert null.decorrelated[1]
    centred = own - np.median(own, axis=0)
    for i in range(K):
        want = centred[i] / np.linalg.norm(centred[i]) * np.sqrt(dim)  # unit null variance
        got = null.W[i][DEFAULT_STATISTIC].double().reshape(-1).numpy()
        assert got == pytest.approx(want, rel=1e-4, abs=1e-4)
        # The round's displayed statistic is the owner's value, with unit null variance.
        assert shown[i][DEFAULT_STATISTIC] == pytest.approx(
            float((scorer.direction / scorer.direction.norm()).numpy() @ want), rel=1e-4, abs=1e-4
        )
    # Without decorrelation the SA mean's change is the centre (hardened mode's case).
    plain = CalibratedNull(decorrelate=False, null_keys=0)
    plain.add_round(
        plain.plan(1, list(range(K)), list(range(K)), designs, scorer),
        changes,
        {DEFAULT_STATISTIC: torch.tensor(Y.mean(0))},
        scorer,
    )
    assert not plain.decorrelated[1]


def _add_linear(null, scorer, cid, W):
    """Round 1 of client ``cid``: change ``W`` read by ``scorer``'s one key."""
    null.add(
        1,
        cid,
        {DEFAULT_STATISTIC: W},
        scorer.owner_values(DEFAULT_STATISTIC, W),
        scorer.key_laws(),
        {DEFAULT_STATISTIC: DEFAULT_STATISTIC},
    )


def test_the_verdict_reads_the_exact_tail_of_the_summed_change():
    rng = np.random.default_rng(3)
    dim = 50
    key = torch.tensor(rng.normal(size=dim))
    key = key / key.norm()
    scorer = LinearScorer(key)
    null = CalibratedNull(alpha=0.05, null_keys=99)
    strong = torch.tensor(rng.normal(size=dim)) + 8 * key
    weak = torch.tensor(rng.normal(size=dim))
    for cid, W in ((0, strong), (1, weak)):
        _add_linear(null, scorer, cid, W * np.sqrt(dim) / W.norm())
    rep = null.report({0: True, 1: False})
    by = {c.id: c for c in rep.clients}
    assert by[0].tail == "exact" and by[0].flagged and by[0].p < 1e-6
    assert by[0].p_rank == pytest.approx(1 / 100)  # beyond every random key
    assert not by[1].flagged and by[1].p > 0.025
    assert rep.level == pytest.approx(0.025)
    # A later round under another key law is refused before anything is added.
    from fedattr.watermarks.tail.laws import Directions

    with pytest.raises(UserError, match="another key law"):
        null.add(
            2,
            0,
            {DEFAULT_STATISTIC: strong},
            {DEFAULT_STATISTIC: 1.0},
            {DEFAULT_STATISTIC: Directions(3)},
            {DEFAULT_STATISTIC: DEFAULT_STATISTIC},
        )


def test_an_uncalibrated_detector_is_reported_but_names_no_one_unless_asked():
    rng = np.random.default_rng(4)
    for ask in (False, True):
        null = CalibratedNull(alpha=0.05, null_keys=0, name_uncalibrated=ask)
        scorer = LinearScorer(torch.tensor(rng.normal(size=20)))
        W = 5 * scorer.direction / scorer.direction.norm() * np.sqrt(20)
        null.add(
            1,
            0,
            {DEFAULT_STATISTIC: W},
            scorer.owner_values(DEFAULT_STATISTIC, W),
            scorer.key_laws(),
            {DEFAULT_STATISTIC: DEFAULT_STATISTIC},
            valid=False,
        )
        rep = null.report({0: True})
        assert rep.uncalibrated == [DEFAULT_STATISTIC] and not rep.clients[0].calibrated
        assert rep.clients[0].p < 1e-3 and rep.clients[0].flagged is ask


class _FirstRoundScorer(LinearScorer):
    """A detector whose key is exchangeable with a random one in round 1 only (as FK's)."""

    exchangeable_rounds = 1


def test_a_key_exchangeable_in_round_one_only_is_read_there_or_reported_uncalibrated():
    rng = np.random.default_rng(7)
    K, dim = 6, 48
    designs = [draw_design(range(K), i, 3, 3, rng) for i in range(K)]
    scorer = _FirstRoundScorer(torch.tensor(rng.normal(size=dim)))
    # Client 0 carries the key in round 1; in round 2 (the reference has learned the owner's
    # secret) every client moves along it. The estimates carry cross-talk (A @ own).
    A = np.array([[d.coefficients()[j] for j in range(K)] for d in designs])
    key = scorer.direction.numpy() / np.linalg.norm(scorer.direction.numpy())
    signal = {1: [8.0] + [0.0] * (K - 1), 2: [3.0 * i for i in range(K)]}
    rounds = {
        t: A @ np.array([rng.normal(size=dim) + a * key for a in amp]) for t, amp in signal.items()
    }
    for late, centre in (("skip", "first"), ("read", "every"), ("read", "first")):
        null = CalibratedNull(alpha=0.05, null_keys=0, late_rounds=late, centre=centre)
        assert null.reads(1, scorer) and null.reads(2, scorer) is (late == "read")
        for t, own in rounds.items():
            changes = [{DEFAULT_STATISTIC: torch.tensor(x)} for x in own]
            shown = null.add_round(
                null.plan(t, list(range(K)), list(range(K)), designs, scorer), changes, None, scorer
            )
            assert bool(shown) is (t == 1 or late == "read")
        rep = null.report({i: i == 0 for i in range(K)})
        assert all(set(c.z) == ({1} if late == "skip" else {1, 2}) for c in rep.clients)
        if late == "skip":
            # Round 1 alone: exact, calibrated, and it names the client that carried the key.
            assert rep.rounds_read == {DEFAULT_STATISTIC: 1} and not rep.uncalibrated
            assert rep.flagged == [0] and all(c.calibrated for c in rep.clients)
        elif centre == "every":
            # Every round read centred by the round's median (the statistic before
            # 2026-11-28): reported, uncalibrated, names no one without being asked.
            assert rep.uncalibrated == [DEFAULT_STATISTIC] and not rep.rounds_read
            assert rep.flagged == [] and not any(c.calibrated for c in rep.clients)
        else:
            # Read uncentred after round 1: calibrated under the one assumption left, that a
            # clean client does not move towards a key its reference learned. Round 2 here
            # breaks exactly that (every client moves along the key), and clients are named:
            # what the stress beds measure on real models.
            assert not rep.uncalibrated and all(c.calibrated for c in rep.clients)
            assert 0 in rep.flagged
    with pytest.raises(ConfigError, match=r"attribution\.calibrated\.late_rounds"):
        load(RunConfig, None, ["attribution.calibrated.late_rounds=sometimes"])


def test_calibrated_needs_a_detector_with_random_keys():
    with pytest.raises(ConfigError, match=r"detector=reading"):
        load(RunConfig, None, ["watermark.detector=greedy"])
    assert load(RunConfig, None, ["watermark.detector=greedy", "attribution.statistic=paper"])
    with pytest.raises(ConfigError, match=r"attribution\.calibrated\.alpha"):
        load(RunConfig, None, ["attribution.calibrated.alpha=1.5"])
    fed = FedAttr(AttributionConfig())
    assert fed.null == "key-randomised"
    assert LinearScorer  # the synthetic scorer has key statistics (used above)


def _synthetic_calibration(seeds: str, *extra: str) -> list[str]:
    """``experiment calibration`` on a small, quick synthetic bed (r = 0 and 3)."""
    return [
        "experiment",
        "calibration",
        "--seeds",
        seeds,
        "--r",
        "0,3",
        *extra,
        "--set",
        "synthetic.dim=64",
        "--set",
        "secagg.backend=plaintext",
    ]


@pytest.mark.slow
def test_calibration_command_writes_its_files_and_resumes(tmp_path, capsys):
    out = tmp_path / "cal"
    args = _synthetic_calibration("0-2", "--out", str(out))
    assert main(args) == 0
    assert {p.name for p in out.iterdir()} >= {
        "calibration.json",
        "calibration.md",
        "qq.png",
        "r0-seed0",
        "r3-seed2",
    }
    md = (out / "calibration.md").read_text()
    assert "| calibrated | 51 |" in md and "| paper | 51 |" in md  # 30 + 3 x 7 null pairs
    before = (out / "r0-seed1" / "results.json").read_bytes()
    assert main(args) == 0  # finished runs are kept
    assert (out / "r0-seed1" / "results.json").read_bytes() == before
    capsys.readouterr()
    assert main([*args[:-4], "--set", "synthetic.dim=32"]) == 2
    assert "another configuration" in capsys.readouterr().err
    assert main(["experiment", "calibration", "--bed", "nope"]) == 2


def test_token_centring_removes_drift_no_key_sees_and_keeps_the_null_exact():
    from fedattr.attribution.calibrated.plan import plan_round
    from fedattr.attribution.calibrated.standardise import standardise_round
    from fedattr.watermarks.tail.laws import RowSubsets

    rng = np.random.default_rng(11)
    K, rows, V = 6, 30, 64
    designs = [draw_design(range(K), i, 3, 3, rng) for i in range(K)]
    drift = np.zeros(V)
    drift[:4] = 5.0  # every context moves mass to the same few tokens
    changes = [
        {"p": torch.tensor(rng.normal(size=(rows, V)) + (3 * drift if i == 0 else 0))}
        for i in range(K)
    ]
    laws = {"p": RowSubsets(16, V)}
    plan = plan_round(1, range(K), range(K), designs, decorrelate=False)
    plain = standardise_round(plan, changes, None, laws)
    kept = standardise_round(plan, changes, None, laws, token_centring=True)
    c = kept[0]["p"].double()
    assert c.mean(dim=0).abs().max() < 1e-6 and c.mean(dim=1).abs().max() < 1e-6
    assert laws["p"].variance(c) == pytest.approx(1.0)  # still one unit of null variance
    # The drift took most of client 0's plain change; centred away, the rest is what is read.
    share = lambda x: float((x.double()[:, :4] ** 2).sum() / (x.double() ** 2).sum())  # noqa: E731
    assert share(plain[0]["p"]) > 0.5 > 0.1 > share(c)


@pytest.mark.slow
def test_calibration_in_parallel_processes_gives_the_same_runs_and_family_wise_counts(tmp_path):
    common = _synthetic_calibration("0-2")
    assert main([*common, "--out", str(tmp_path / "one")]) == 0
    assert main([*common, "--jobs", "2", "--out", str(tmp_path / "two")]) == 0
    import json

    for name in ("r0-seed1", "r3-seed2"):
        a = json.loads((tmp_path / "one" / name / "results.json").read_text())["clients"]
        b = json.loads((tmp_path / "two" / name / "results.json").read_text())["clients"]
        assert [c["p"] for c in a] == [c["p"] for c in b]
    one = json.loads((tmp_path / "one" / "calibration.json").read_text())["statistics"]
    cal = one["calibrated"]
    # The family-wise counts are those of the runs' own verdicts, counted afresh here.
    wrong = 0
    for r in (0, 3):
        for seed in range(3):
            res = json.loads((tmp_path / "one" / f"r{r}-seed{seed}" / "results.json").read_text())
            wrong += any(c["flagged"] and not c["watermarked"] for c in res["clients"])
    assert cal["runs_naming_wrong"] == wrong == cal["runs_naming_clean"]
    assert cal["runs_naming_wrong_ci95"] == pytest.approx(list(clopper_pearson(wrong, 6)))
    # Read again in two processes: the same summary, in the same order.
    assert main([*common, "--jobs", "2", "--reread", "--out", str(tmp_path / "two")]) == 0
    again = json.loads((tmp_path / "two" / "calibration.json").read_text())
    assert again["reread"]
    assert again["statistics"]["calibrated"]["null_p"] == pytest.approx(cal["null_p"], rel=1e-4)
    assert main([*common, "--jobs", "0", "--out", str(tmp_path / "bad")]) == 2


def test_hardened_rounds_keep_cross_talk_so_their_clients_are_not_named_by_default():
    for ask in (False, True):
        cfg = load(
            DemoConfig,
            None,
            [
                *REALISTIC,
                "synthetic.seed=0",
                "synthetic.r=3",
                "synthetic.signal=6",
                "attribution.protocol.mode=hardened",
                "attribution.calibrated.across_rounds=keep",
                f"attribution.calibrated.name_uncalibrated={str(ask).lower()}",
            ],
        )
        rep = run_demo(cfg, progress=lambda _m: None).report
        assert rep.cross_talk and all(
            not c.calibrated for c in rep.clients if c.id in rep.cross_talk
        )
        assert bool(rep.flagged) is ask


def test_llm_calibration_runs_draw_their_own_owner_keys():
    """Family-wise error is over random keys: runs sharing one key would all measure its luck."""
    from fedattr.experiments.calibration import CalibrationSpec

    spec = CalibrationSpec(bed="tiny", seeds=(0, 1))
    a, b = spec.run_config(0, 0), spec.run_config(0, 1)
    assert a.watermark.key_seed != b.watermark.key_seed
    assert (a.fl.seed, a.data.seed) != (b.fl.seed, b.data.seed)


def test_report_reads_every_client_tail_in_threads_with_the_same_verdicts():
    """Clients' tails run in torch's thread count of threads: the verdicts do not depend on
    it (a vocabulary-sized change takes seconds a client)."""
    rng = np.random.default_rng(4)
    dim = 40
    key = torch.tensor(rng.normal(size=dim))
    scorer = LinearScorer(key / key.norm())
    null = CalibratedNull(alpha=0.05, null_keys=49)
    for cid in range(6):
        W = torch.tensor(rng.normal(size=dim)) + (6.0 if cid < 2 else 0.0) * scorer.direction
        _add_linear(null, scorer, cid, W)
    before = torch.get_num_threads()
    try:
        reports = []
        for threads in (1, 3):
            torch.set_num_threads(threads)
            rep = null.report({c: c < 2 for c in range(6)})
            reports.append([(c.id, c.log10_p, c.tail, c.flagged) for c in rep.clients])
    finally:
        torch.set_num_threads(before)
    assert reports[0] == reports[1]
    assert [c[0] for c in reports[0]] == list(range(6))
    assert [c[3] for c in reports[0]] == [True, True, False, False, False, False]


def test_the_rank_check_draws_its_keys_where_the_changes_were_computed(monkeypatch):
    """The sums stay on the CPU (checkpoints), but the rank check's random keys are drawn on
    the device the changes came from (a GPU for an LLM: 200 keys over vocabulary-sized changes
    take minutes on a CPU). Here the device is pretended (``meta``) and the draw recorded."""
    from fedattr.watermarks.tail.laws import RowSubsets

    law = RowSubsets(4, 16)
    null = CalibratedNull(alpha=0.05, null_keys=9)
    for cid in range(3):
        W = law.centre(torch.randn(5, 16, dtype=torch.float64))
        null.add(1, cid, {"probes": W}, {"owner": 0.1 * cid}, {"probes": law}, {"owner": "probes"})
    assert null.device == torch.device("cpu") and null.W[0]["probes"].device.type == "cpu"
    seen = []

    def record(self, Ws, n, seed):
        seen.append({(W.device.type, W.dtype) for W in Ws})
        return np.zeros((len(Ws), n))

    monkeypatch.setattr(RowSubsets, "random_values", record)
    null.report()
    null.device = torch.device("meta")
    null.report()
    assert seen == [{("cpu", torch.float64)}, {("meta", torch.float32)}]


def test_cross_talk_is_undone_on_the_device_of_the_changes(monkeypatch):
    """The changes of an LLM round live on its GPU: undoing cross-talk must stay there (it once
    mixed a CPU accumulator in and failed on the first GPU run). ``meta`` stands in for the GPU;
    the variance, a scalar read, is pretended."""
    from fedattr.attribution.calibrated.plan import RoundPlan
    from fedattr.attribution.calibrated.standardise import standardise_round
    from fedattr.watermarks.tail.laws import RowSubsets

    class Law(RowSubsets):
        def variance(self, W):
            return 1.0

    inverse = np.linalg.inv(np.eye(3) + 0.2)
    plan = RoundPlan(
        round=1, participants=(0, 1, 2), targets=(0, 1, 2), designs=(), inverse=inverse
    )
    changes = [{"probes": torch.randn(5, 16, device="meta")} for _ in range(3)]
    out = standardise_round(plan, changes, None, {"probes": Law(4, 16)})
    assert {o["probes"].device.type for o in out} == {"meta"}


class _CurvedScorer:
    """A detector whose reading saturates (as FK's log-probabilities of a learned fact do):
    its change is not linear in the estimate."""

    exchangeable_rounds = None

    def observe(self, params):
        return params["a"].reshape(-1).double()

    def contrast(self, reference, candidate):
        return 0.0

    def change(self, reference, candidate):
        def curve(x):
            return x + 0.4 * x**2

        return {"owner": curve(candidate) - curve(reference)}

    def key_laws(self):
        from fedattr.watermarks.tail.laws import Directions

        return {"owner": Directions(6)}

    def owner_values(self, part, W):
        return {"owner": float(W.reshape(-1)[0])}


@pytest.mark.parametrize("undo", ["changes", "updates"])
def test_a_small_reading_step_makes_undoing_cross_talk_exact_for_a_curved_reading(undo):
    """Undone on the changes (``undo = "changes"``) and read as applied, a curved detector leaves
    second-order traces of the other clients' updates in each recovered change; read at a small
    step (per unit of the estimate), the recovered change is the client's own (its first-order
    part), whatever the curvature. Undone on the estimates (``undo = "updates"``, the default),
    every reading is the client's own, as applied too."""
    from fedattr.secagg import SecAggConfig, make_aggregator

    K = 10
    gen = torch.Generator().manual_seed(3)
    own = [torch.randn(3, 2, generator=gen, dtype=torch.float64) for _ in range(K)]
    stacked = torch.stack([o.reshape(-1) for o in own]).numpy()
    centred = stacked - np.median(stacked, axis=0)
    want = centred / np.linalg.norm(centred, axis=1, keepdims=True) * np.sqrt(6)
    # Each client's own update read as applied through the curve (what a perfect estimator
    # would give): what undoing cross-talk on the estimates reads at any step.
    curved = stacked + 0.4 * stacked**2
    curved = curved - np.median(curved, axis=0)
    as_own = curved / np.linalg.norm(curved, axis=1, keepdims=True) * np.sqrt(6)
    errors, own_errors = {}, {}
    # (attribution.calibrated.reading_step, the detector's own step)
    for step, own_step in [(1.0, None), (1e-4, None), (None, 1e-4), (1.0, 1e-4), (None, None)]:
        sa = make_aggregator(SecAggConfig(backend="plaintext"))
        sa.open_round(1, range(K))
        for j in range(K):
            sa.submit(j, {"a": own[j]})
        fed = FedAttr(
            AttributionConfig(
                calibrated=CalibratedConfig(null_keys=0, reading_step=step, undo=undo)
            )
        )
        reference = {"a": torch.zeros(3, 2, dtype=torch.float64)}
        scorer = _CurvedScorer()
        if own_step is not None:
            scorer.reading_step = own_step  # a detector asking for a stepped reading (FK)
        record = fed.attribute_round(1, sa, reference, scorer)
        assert record.decorrelated is True
        W = fed.statistic.calibrated.W
        errors[step, own_step] = max(
            float(np.abs(W[i]["owner"].numpy().reshape(-1) - want[i]).max()) for i in range(K)
        )
        own_errors[step, own_step] = max(
            float(np.abs(W[i]["owner"].numpy().reshape(-1) - as_own[i]).max()) for i in range(K)
        )
    exact = [errors[1e-4, None], errors[None, 1e-4]]
    # As applied (the default for a detector that asks nothing, or the setting overriding it).
    applied = [errors[1.0, None], errors[1.0, 1e-4], errors[None, None]]
    assert max(exact) < 1e-3
    if undo == "changes":
        assert min(applied) > 0.1
    else:  # read as applied, each client's own update exactly
        assert max(own_errors[k] for k in [(1.0, None), (1.0, 1e-4), (None, None)]) < 1e-6
    with pytest.raises(ConfigError, match=r"attribution\.calibrated\.reading_step"):
        load(RunConfig, None, ["attribution.calibrated.reading_step=0"])


def test_reread_gives_a_finished_runs_verdicts_again_from_its_saved_changes(tmp_path, capsys):
    """``--reread`` reads every run's verdicts again from ``changes.safetensors`` (no training):
    with the tails that wrote them, the same p-values, flags and family-wise counts; a run
    folder without saved changes is refused in one line."""
    import json

    from fedattr.experiments.calibration import reread_run

    common = _synthetic_calibration("0-1", "--out", str(tmp_path / "cal"))
    assert main(common) == 0
    before = json.loads((tmp_path / "cal" / "calibration.json").read_text())
    run = tmp_path / "cal" / "r3-seed1"
    saved = json.loads((run / "results.json").read_text())
    again = reread_run(run)
    assert again["reread"] and again["flagged"] == saved["flagged"]
    for old, new in zip(saved["clients"], again["clients"], strict=True):
        assert new["log10_p"] == pytest.approx(old["log10_p"], abs=1e-5)
        assert (new["tail"], new["p_rank"], new["z"]) == (old["tail"], old["p_rank"], old["z"])
    assert main([*common, "--reread"]) == 0
    after = json.loads((tmp_path / "cal" / "calibration.json").read_text())
    assert after["reread"] and not before["reread"]
    for name in ("calibrated", "paper"):
        a, b = before["statistics"][name], after["statistics"][name]
        assert a["runs_naming_clean"] == b["runs_naming_clean"] and a["tpr"] == b["tpr"]
    assert "read again" in (tmp_path / "cal" / "calibration.md").read_text()
    (run / "changes.safetensors").unlink()
    capsys.readouterr()
    assert main([*common, "--reread"]) == 2
    assert "holds no changes.safetensors" in capsys.readouterr().err


class _GreenListScorer:
    """A KGW-like detector: each owner's key a green mask over ``[rows, V]``, lent to the
    verdict (``owner_keys``)."""

    exchangeable_rounds = None

    def __init__(self, keys):
        self.keys = keys

    def key_laws(self):
        from fedattr.watermarks.tail.laws import RowSubsets

        G = next(iter(self.keys.values()))
        return {"probes": RowSubsets(int(G[0].sum()), G.shape[1])}

    def owner_values(self, part, W):
        G = next(iter(self.keys.values()))
        W = W.reshape(G.shape).double()
        return {o: float(W[g].sum()) for o, g in self.keys.items()}

    def owner_keys(self, part):
        return dict(self.keys)


@pytest.mark.parametrize("few_cells", ["shifted-keys", "bound"])
def test_a_change_on_few_cells_reads_p_by_shifting_the_owner_key(few_cells):
    """Client 0's change puts a few large cells on owner a's green tokens: its analytic tail is
    only a bound (patterns); with the key lent, p comes from the shifted-key test instead
    (smaller, and never below the floor ``level / 100`` it adds); ``few_cells = "bound"`` keeps
    the bound."""
    from fedattr.attribution.calibrated.verdict import SHIFTED_FLOOR

    rng = np.random.default_rng(2)
    K, rows, V, m = 6, 40, 64, 16
    keys = {}
    for owner in ("a", "b"):
        G = torch.zeros(rows, V, dtype=torch.bool)
        for x in range(rows):
            G[x, torch.from_numpy(rng.choice(V, m, replace=False))] = True
        keys[owner] = G
    own = 0.02 * rng.normal(size=(K, rows, V))
    for x in range(8):  # one large cell in each of eight rows: few effective cells
        v = int(np.flatnonzero(keys["a"][x].numpy())[0])
        own[0, x, v] += 0.4
        own[1 + x % (K - 1), x, rng.integers(V)] += 1.0  # clean clients' large cells, anywhere
    designs = [draw_design(range(K), i, 3, 3, rng) for i in range(K)]
    A = np.array([[d.coefficients()[j] for j in range(K)] for d in designs])
    estimates = np.einsum("ij,jxv->ixv", A, own)
    null = CalibratedNull(alpha=0.05, null_keys=0, few_cells=few_cells)
    changes = [{"probes": torch.tensor(e)} for e in estimates]
    null.add_round(
        null.plan(1, list(range(K)), list(range(K)), designs, _GreenListScorer(keys)),
        changes,
        None,
        _GreenListScorer(keys),
    )
    rep = null.report({i: i == 0 for i in range(K)})
    bound = CalibratedNull(alpha=0.05, null_keys=0, few_cells="bound")
    bound.add_round(
        bound.plan(1, list(range(K)), list(range(K)), designs, _GreenListScorer(keys)),
        changes,
        None,
        _GreenListScorer(keys),
    )
    before = {c.id: c for c in bound.report().clients}
    floor = rep.level * SHIFTED_FLOOR
    for c in rep.clients:
        if few_cells == "bound" or before[c.id].tail not in ("patterns", "chernoff"):
            assert (c.tail, c.log10_p) == (before[c.id].tail, before[c.id].log10_p)
        else:  # Bonferroni over the two owners doubles each owner's p
            assert c.tail == "shifted-keys" and c.p >= 2 * floor
    if few_cells == "shifted-keys":
        assert before[0].tail == "patterns" and rep.clients[0].tail == "shifted-keys"
        assert rep.clients[0].p < before[0].p / 2
    assert rep.clients[0].flagged and not any(c.flagged for c in rep.clients[1:])


def test_reread_rebuilds_a_simulations_keys_and_gives_its_verdicts_again(tiny_cache, tmp_path):
    """``--reread`` rebuilds the simulated owners' keys of a micro LLM run from its config (the
    shifted-key test needs them): they read the saved changes as the run's owners did (each
    value ``Z`` times the change's null sd), and the verdicts come out as the run's; a run read
    with ``few_cells = "bound"`` gets no keys."""
    import json

    from safetensors.torch import load_file

    from conftest import small_overrides
    from fedattr.experiments.calibration import reread_run, simulated_keys
    from fedattr.experiments.main import run_or_reuse
    from fedattr.watermarks.tail.laws import law_from_dict

    for few_cells, probes in [
        ("shifted-keys", "held-out"),
        ("shifted-keys", "documents"),
        ("bound", "documents"),
    ]:
        sets = small_overrides(
            tiny_cache,
            "attribution.calibrated.null_keys=0",
            f"attribution.calibrated.few_cells={few_cells}",
            f"watermark.kgw.probes={probes}",
        )
        folder = tmp_path / f"{few_cells}-{probes}"
        run_or_reuse(load(RunConfig, None, sets), folder)
        saved = json.loads((folder / "results.json").read_text())
        keys = simulated_keys(folder, saved)
        if few_cells == "bound":
            assert keys is None
            continue
        # held-out texts: one part every owner reads; documents: a part per owner, its own
        parts = saved["key_laws"]
        assert len(parts) == (1 if probes == "held-out" else len(keys))
        changes = load_file(str(folder / "changes.safetensors"))
        for owner, rows in saved["by_statistic"].items():
            part = next(iter(parts)) if probes == "held-out" else owner
            law = law_from_dict(parts[part])
            for cid, row in rows.items():
                W = changes[f"{cid}/{part}"].double()
                value = float(W.reshape(keys[owner].shape)[keys[owner]].sum())
                sd = law.variance(W) ** 0.5
                assert value == pytest.approx(row["Z"] * sd, rel=1e-4, abs=1e-6 * sd)
        again = reread_run(folder)
        for old, new in zip(saved["clients"], again["clients"], strict=True):
            assert new["tail"] == old["tail"]
            assert new["log10_p"] == pytest.approx(old["log10_p"], abs=1e-3)


@pytest.mark.parametrize("k", [1, 2, 3, 10, 11])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cellwise_median_is_the_sorted_middle(k, dtype):
    from fedattr.attribution.calibrated.weights import median

    gen = torch.Generator().manual_seed(k)
    X = torch.randn(k, 7, 5, generator=gen).to(dtype)
    X[:, 0, 0] = 1.0  # ties
    s = X.sort(dim=0).values
    expected = s[k // 2] if k % 2 else 0.5 * (s[k // 2 - 1] + s[k // 2])
    got = median(X)
    assert got.dtype == dtype and torch.equal(got, expected)
    assert torch.equal(median(X[:, :, ::2]), expected[:, ::2])  # strided input
    # Off the CPU (here: a dtype the partial sort does not take) by blocks of columns, any size.
    half = X.to(torch.bfloat16)
    s = half.sort(dim=0).values
    expected = s[k // 2] if k % 2 else 0.5 * (s[k // 2 - 1] + s[k // 2])
    for block in (1, 7, 3 * k, 10**6):
        assert torch.equal(median(half, block=block), expected)


def test_reread_reads_runs_whose_owners_read_parts_of_their_own(tiny_cache, tmp_path):
    """FK's owners each read a part named as the owner: ``--reread`` reads every owner's own
    part and gives the run's verdicts (refused before: several key laws)."""
    import json

    from conftest import small_overrides
    from fedattr.experiments.calibration import reread_run
    from fedattr.experiments.main import run_or_reuse

    sets = small_overrides(
        tiny_cache, "watermark.kind=fk", "watermark.r=2", "attribution.calibrated.null_keys=0"
    )
    run_or_reuse(load(RunConfig, None, sets), tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["key_laws"]) == 2
    again = reread_run(tmp_path)
    for old, new in zip(saved["clients"], again["clients"], strict=True):
        assert (new["statistic"], new["tail"]) == (old["statistic"], old["tail"])
        assert new["log10_p"] == pytest.approx(old["log10_p"], abs=1e-3)
