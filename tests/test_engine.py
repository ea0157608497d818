"""The round engine: one loop for every runtime, observers, two-phase attribution, devices."""

import json

import pytest
import torch

from fedattr.attribution import AttributionConfig, FedAttr, LinearScorer, harden
from fedattr.attribution.audit import audit_queries
from fedattr.attribution.config import CalibratedConfig, PaperConfig, ProtocolConfig
from fedattr.attribution.observer import AttributionObserver
from fedattr.cli import main
from fedattr.errors import UserError
from fedattr.fl import FedAvgServer, Progress, RoundEngine, SyntheticConfig, SyntheticPool
from fedattr.pipeline.config import DemoConfig
from fedattr.pipeline.run import run_demo
from fedattr.secagg import SecAggConfig, make_aggregator

QUIET = Progress(lambda _m: None)


def _engine(syn, secagg, configs):
    pool = SyntheticPool(syn)
    scorer = LinearScorer(pool.direction)
    observers = [
        AttributionObserver(FedAttr(c), scorer, name, primary=(k == 0))
        for k, (name, c) in enumerate(configs.items())
    ]
    sa = make_aggregator(secagg)
    engine = RoundEngine(pool, FedAvgServer(), sa, observers, rounds=syn.rounds, progress=QUIET)
    engine.run(pool.initial_params())
    return engine, observers


def _Z(fedattr):
    return {c.id: c.Z for c in fedattr.report().clients}


def test_two_attribution_observers_on_one_run_equal_two_separate_runs():
    syn = SyntheticConfig(dim=256, rounds=3)
    m5, m10 = (
        AttributionConfig(protocol=ProtocolConfig(M=5)),
        AttributionConfig(protocol=ProtocolConfig(M=10)),
    )
    engine, (a, b) = _engine(syn, SecAggConfig(), {"fedattr": m5, "M10": m10})
    _, (alone5,) = _engine(syn, SecAggConfig(), {"fedattr": m5})
    _, (alone10,) = _engine(syn, SecAggConfig(), {"fedattr": m10})
    assert _Z(a.fedattr) == _Z(alone5.fedattr)
    assert _Z(b.fedattr) == _Z(alone10.fedattr)
    sessions = [q["session"] for q in engine.queries]
    assert sessions.count("fedattr") == 3 * 2 * 5 * 10 and sessions.count("M10") == 3 * 2 * 10 * 10
    assert sessions.count("") == 3  # the training aggregate, once per round


def test_hardened_observers_each_get_their_own_release_budget():
    syn = SyntheticConfig(dim=64, rounds=3)
    hard = AttributionConfig(protocol=ProtocolConfig(mode="hardened"))
    secagg = harden(hard, SecAggConfig(), syn.K)
    engine, (a, b) = _engine(
        syn,
        secagg,
        {
            "fedattr": hard,
            "other": AttributionConfig(seed=7, protocol=ProtocolConfig(mode="hardened")),
        },
    )
    _, (alone,) = _engine(syn, secagg, {"fedattr": hard})
    assert _Z(a.fedattr) == _Z(alone.fedattr)  # the second session spends none of its budget
    assert any(q["session"] == "other" for q in engine.queries)
    assert sum(len(r["targets"]) for r in b.records) > 0  # the second session was admitted too
    audited = audit_queries(engine.queries)
    assert {r.session for r in audited} == {"fedattr", "other"}
    assert all(not r.recoverable for r in audited)
    assert max(r.max_leakage for r in audited) <= secagg.release_budget + 1e-12


def test_hardened_mode_refuses_to_run_without_a_release_policy():
    sa = make_aggregator(SecAggConfig(backend="plaintext"))  # library default: no policy
    sa.open_round(1, range(10))
    for j in range(10):
        sa.submit(j, torch.randn(4))
    fed = FedAttr(AttributionConfig(protocol=ProtocolConfig(mode="hardened")))
    with pytest.raises(UserError, match=r"secagg\.release_budget"):
        fed.attribute_round(1, sa, torch.zeros(4), LinearScorer(torch.ones(4)))
    assert sa.log == []  # refused before any query


class _DeviceScorer:
    """A paired scorer that insists on parameters living on one device (like a GPU model)."""

    def __init__(self, device):
        self.device = device

    def observe(self, params):
        assert all(v.device.type == self.device for v in params.values())
        return 0.0

    def contrast(self, reference, candidate):
        return 0.0


def test_estimates_are_moved_to_the_device_of_the_scoring_parameters():
    # SA answers live on the CPU; the scoring parameters here live on the meta device, as a
    # GPU model's would on CUDA. Adding a CPU estimate to them used to crash.
    sa = make_aggregator(SecAggConfig(backend="plaintext"))
    sa.open_round(1, range(10))
    for j in range(10):
        sa.submit(j, {"a": torch.randn(3, 2), "b": torch.randn(2)})
    reference = {
        "a": torch.zeros(3, 2, device="meta"),
        "b": torch.zeros(2, device="meta"),
        "frozen": torch.zeros(5, device="meta"),
    }
    fed = FedAttr(AttributionConfig(statistic="paper", paper=PaperConfig(mean_reference=True)))
    center = sa.subset_sum(range(10))
    record = fed.attribute_round(1, sa, reference, _DeviceScorer("meta"), center=center)
    assert len(record.targets) == 10


def test_observe_many_sees_every_candidate_of_the_round_at_once():
    class Batched(_DeviceScorer):
        batched = True

        def __init__(self):
            super().__init__("cpu")
            self.batches = []

        def observe(self, params):
            return float(params["a"].sum())

        def observe_many(self, many):
            self.batches.append(len(many))
            return [self.observe(p) for p in many]

        def contrast(self, reference, candidate):
            return candidate - reference

    sa = make_aggregator(SecAggConfig(backend="plaintext"))
    sa.open_round(1, range(10))
    for j in range(10):
        sa.submit(j, {"a": torch.full((2,), float(j))})
    scorer = Batched()
    fed = FedAttr(AttributionConfig(statistic="paper"))
    record = fed.attribute_round(1, sa, {"a": torch.zeros(2)}, scorer)
    assert scorer.batches == [10]
    # Unbiased linear estimate of each client's own coordinate sum (2j), up to masking noise.
    assert {r.target for r in record.targets} == set(range(10))
    # A scorer that says it would only loop (batched = False) is fed one candidate at a time.
    lazy = Batched()
    lazy.batched = False
    again = FedAttr(AttributionConfig(statistic="paper")).attribute_round(
        1, sa, {"a": torch.zeros(2)}, lazy
    )
    assert lazy.batches == [] and [r.z for r in again.targets] == [r.z for r in record.targets]


def test_all_queries_of_a_round_go_to_sa_in_one_batch():
    sa = make_aggregator(SecAggConfig())
    calls = []
    run_queries = sa.run_queries
    sa.run_queries = lambda groups, **kw: calls.append(len(groups)) or run_queries(groups, **kw)
    sa.open_round(1, range(10))
    for j in range(10):
        sa.submit(j, torch.randn(8))
    FedAttr(AttributionConfig()).query_round(1, sa)
    assert calls == [10]


def test_demo_with_centring_runs_through_the_engine():
    cfg = DemoConfig(
        synthetic=SyntheticConfig(dim=64, rounds=2),
        attribution=AttributionConfig(paper=PaperConfig(mean_reference=True)),
    )
    result = run_demo(cfg, progress=lambda _m: None)
    assert len(result.rounds) == 2 and result.sa_queries == 2 * (2 * 5 * 10 + 1)
    assert (
        main(
            [
                "demo-protocol",
                "--quiet",
                "--set",
                "attribution.paper.mean_reference=true",
                "--set",
                "synthetic.dim=64",
            ]
        )
        == 0
    )


def test_pools_without_a_plaintext_tap_refuse_the_baselines():
    with pytest.raises(UserError, match="baselines"):
        SyntheticPool(SyntheticConfig(dim=8)).open_tap()


def test_progress_off_a_terminal_prints_one_line_per_step_with_elapsed_time(capsys):
    progress = Progress()  # stderr is captured by pytest: not a terminal
    progress("stage one")
    steps = progress.steps(2, "round 1 local training")
    steps.step("client 0 loss 1.000")
    steps.step("client 1 loss 0.900")
    steps.close()
    err = capsys.readouterr().err.splitlines()
    assert err[0].endswith("stage one") and err[0].startswith("[0m0")
    assert err[2].endswith("round 1 local training: client 1 loss 0.900 (2/2)")


def test_threads_follow_fedattr_threads(monkeypatch):
    from fedattr.runtime import set_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("FEDATTR_THREADS", "1")
        assert set_threads() == (1, None) and torch.get_num_threads() == 1
        monkeypatch.setenv("FEDATTR_THREADS", "many")
        with pytest.raises(UserError, match="FEDATTR_THREADS"):
            set_threads()
        # Unset: the CPUs other work leaves free, at least one, with a note when fewer.
        import fedattr.runtime as runtime

        monkeypatch.delenv("FEDATTR_THREADS")
        monkeypatch.setattr(runtime, "available_cpus", lambda: 4)
        monkeypatch.setattr(runtime, "busy_cpus", lambda: 3)
        n, note = set_threads()
        assert n == 1 == torch.get_num_threads() and "busy" in note and "FEDATTR_THREADS" in note
        assert runtime.take_note() == note and runtime.take_note() is None  # shown once
        monkeypatch.setattr(runtime, "busy_cpus", lambda: 9)
        assert set_threads()[0] == 1
        monkeypatch.setattr(runtime, "busy_cpus", lambda: 0)
        assert set_threads() == (4, None)
    finally:
        torch.set_num_threads(before)


def test_a_lingering_load_takes_no_thread():
    from fedattr.runtime import busy_cpus

    # A job that ended seconds ago leaves a load of 0.5-0.7; one busy CPU reads about 1.
    loads = (0.0, 0.6, 0.74, 0.8, 1.0, 1.7, 2.2)
    assert [busy_cpus(x) for x in loads] == [0, 0, 0, 1, 1, 1, 2]


def test_bugs_keep_their_traceback(monkeypatch):
    import fedattr.cli as cli
    import fedattr.cli.privacy as privacy_cli

    def broken(_args):
        raise TypeError("a bug")

    monkeypatch.setattr(privacy_cli, "_cmd_privacy", broken)
    with pytest.raises(TypeError, match="a bug"):
        cli.main(["privacy"])


def test_run_folder_refuses_what_would_lose_work(tmp_path, capsys):
    demo = ["demo-protocol", "--quiet", "--set", "synthetic.dim=32", "--set", "synthetic.rounds=1"]
    out = tmp_path / "demo"
    assert main([*demo, "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    # The same folder again: finished, so refused, and nothing in it is rewritten.
    assert main([*demo, "--out", str(out)]) == 2
    assert "holds a finished run" in capsys.readouterr().err
    assert main([*demo, "--set", "attribution.protocol.M=3", "--out", str(out)]) == 2
    assert "another configuration" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # A file, or a folder of other files: refused before anything is computed.
    (tmp_path / "file.txt").write_text("x")
    assert main([*demo, "--out", str(tmp_path / "file.txt")]) == 2
    assert "is a file" in capsys.readouterr().err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.md").write_text("mine")
    assert main([*demo, "--out", str(tmp_path / "other")]) == 2
    assert "holds no fedattr run" in capsys.readouterr().err
    # --resume of a finished run says so.
    assert main(["run", "--resume", str(out)]) == 2
    assert "already finished" in capsys.readouterr().err
    json.loads((out / "results.json").read_text())


def test_damaged_checkpoint_is_one_clear_line(tmp_path):
    from fedattr.reporting.run_folder import RunFolder

    folder = RunFolder(tmp_path / "run")
    folder.claim({"a": 1})
    folder.checkpoint_path.parent.mkdir()
    folder.checkpoint_path.write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match=r"checkpoint .* is damaged"):
        folder.load_checkpoint()
    assert folder.status == "interrupted" and folder.resumable_config() == {"a": 1}


class _KeyedDeviceScorer(_DeviceScorer):
    """The calibrated path's scorer: a key-linear change and its key law."""

    exchangeable_rounds = None

    def change(self, reference, candidate):
        return {"owner": torch.linspace(-1.0, 1.0, 6) * (1.0 + candidate - reference)}

    def key_laws(self):
        from fedattr.watermarks.tail.laws import Directions

        return {"owner": Directions(6)}

    def owner_values(self, part, W):
        return {"owner": float(W.reshape(-1)[0])}


@pytest.mark.parametrize("step", [None, 0.01])
def test_calibrated_statistic_is_device_correct_too(step):
    # step 0.01: the stepped reading (FK's) scales CPU estimates before they meet the device.
    sa = make_aggregator(SecAggConfig(backend="plaintext"))
    sa.open_round(1, range(10))
    for j in range(10):
        sa.submit(j, {"a": torch.randn(3, 2)})
    reference = {"a": torch.zeros(3, 2, device="meta")}
    fed = FedAttr(AttributionConfig(calibrated=CalibratedConfig(null_keys=5, reading_step=step)))
    record = fed.attribute_round(
        1, sa, reference, _KeyedDeviceScorer("meta"), center=sa.subset_sum(range(10))
    )
    assert record.decorrelated is True and len(record.targets) == 10
    report = fed.report()
    assert report.statistic == "calibrated" and report.null_keys == 5


def test_overlapped_scoring_gives_the_same_results_and_whole_round_checkpoints():
    """Scoring in the background (round t while round t+1 trains): the same Z as scoring at
    once; checkpoints are written only once a round's scores are in, with the engine's state
    of that round (not of the round training meanwhile) and the scoring time it took."""
    import copy
    from concurrent.futures import ThreadPoolExecutor

    from fedattr.fl import Checkpointer

    syn = SyntheticConfig(dim=256, rounds=4)
    _, (inline,) = _engine(
        syn, SecAggConfig(), {"fedattr": AttributionConfig(protocol=ProtocolConfig(M=5))}
    )
    pool = SyntheticPool(syn)
    saved = []
    with ThreadPoolExecutor(1) as background:
        observer = AttributionObserver(
            FedAttr(AttributionConfig(protocol=ProtocolConfig(M=5))),
            LinearScorer(pool.direction),
            background=background,
        )
        checkpoint = Checkpointer(lambda snap: saved.append(copy.deepcopy(snap)))  # as on disk
        engine = RoundEngine(
            pool,
            FedAvgServer(),
            make_aggregator(SecAggConfig()),
            [observer, checkpoint],
            rounds=syn.rounds,
            progress=QUIET,
        )
        train, busy = pool.train_round, []

        def watched(*args, **kwargs):  # was the last round still being scored meanwhile?
            busy.append(observer.busy)
            return train(*args, **kwargs)

        pool.train_round = watched
        engine.run(pool.initial_params())
    assert busy == [False, True, True, True]
    assert _Z(observer.fedattr) == _Z(inline.fedattr)
    assert [s["round"] for s in saved] == [1, 2, 3, 4]
    for snap in saved:
        # Whole rounds only: the observer holds exactly the snapshot's rounds.
        assert len(snap["observers"]["fedattr"]["records"]) == snap["round"]
        assert len(snap["history"]) == snap["round"]
        # The reference and 10 estimates (cross-talk undone: the SA mean is not read).
        assert snap["timing"]["counts"]["models_scored"] == 11 * snap["round"]
    # A run resumed from the round-2 checkpoint ends where the uninterrupted one did.
    pool2 = SyntheticPool(syn)
    again = AttributionObserver(
        FedAttr(AttributionConfig(protocol=ProtocolConfig(M=5))), LinearScorer(pool2.direction)
    )
    engine2 = RoundEngine(
        pool2,
        FedAvgServer(),
        make_aggregator(SecAggConfig()),
        [again],
        rounds=syn.rounds,
        progress=QUIET,
    )
    engine2.restore(saved[1])
    engine2.run(pool2.initial_params())
    assert _Z(again.fedattr) == _Z(inline.fedattr)


def test_a_folder_written_before_a_setting_existed_is_read_with_its_default(tmp_path):
    from fedattr.config import to_dict
    from fedattr.reporting.run_folder import CONFIG, RunFolder

    cfg = DemoConfig(synthetic=SyntheticConfig(dim=32, rounds=1))
    run_demo(cfg).write(tmp_path / "old")
    saved = json.loads((tmp_path / "old" / CONFIG).read_text())
    del saved["attribution"]["protocol"]["queries"]  # as a version without it wrote it
    (tmp_path / "old" / CONFIG).write_text(json.dumps(saved))
    folder = RunFolder(tmp_path / "old")
    assert folder.claim(cfg, reuse=True) == "finished"  # the default is what it ran with
    with pytest.raises(UserError, match="another configuration"):
        folder.claim(to_dict(cfg), reuse=True)  # a plain dict is compared as saved
    fused = DemoConfig(
        synthetic=cfg.synthetic,
        attribution=AttributionConfig(protocol=ProtocolConfig(queries="fused")),
    )
    with pytest.raises(UserError, match="another configuration"):
        folder.claim(fused, reuse=True)
    saved["attribution"]["renamed"] = 1  # a setting this version does not know: different
    (tmp_path / "old" / CONFIG).write_text(json.dumps(saved))
    with pytest.raises(UserError, match="another configuration"):
        folder.claim(cfg, reuse=True)


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_an_unwritable_run_folder_is_one_line_and_blocks_no_corrected_run(
    tmp_path, monkeypatch, capsys
):
    """Issue 37, item 1: ``--out`` that cannot be written was a PermissionError traceback.
    Tests run as root here, and a read-only folder does not stop root: an unwritable parent
    is simulated by a *regular file* standing where the parent folder should be, and an
    existing empty folder that refuses ``config.json`` by a write that fails with EACCES."""
    from pathlib import Path

    demo = ["demo-protocol", "--quiet", "--set", "synthetic.dim=32", "--set", "synthetic.rounds=1"]
    blocker = tmp_path / "ro"
    blocker.write_text("a file, not a folder")
    for argv in (
        ["run", "--out", str(blocker / "run1")],  # refused before any training
        [*demo, "--out", str(blocker / "deeper" / "run1")],
    ):
        assert main(argv) == 2
        assert f"--out: '{blocker}' is a file, not a folder" in _one_line(capsys)
    assert blocker.read_text() == "a file, not a folder"

    empty = tmp_path / "empty"
    empty.mkdir()
    real_write = Path.write_text

    def refuse(self, *args, **kwargs):
        if self.name == "config.json":
            raise PermissionError(13, "Permission denied", str(self))
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", refuse)
    assert main([*demo, "--out", str(empty)]) == 2
    assert f"--out: '{empty}' cannot be written (Permission denied)" in _one_line(capsys)
    assert main([*demo, "--out", str(tmp_path / "new" / "run")]) == 2
    _one_line(capsys)
    assert not (tmp_path / "new").exists()  # the folders the claim made are gone again
    monkeypatch.undo()
    assert empty.is_dir() and not any(empty.iterdir())
    assert main([*demo, "--out", str(empty)]) == 0  # the corrected run takes the same folder
    assert (empty / "results.json").is_file()


def test_audit_and_attribute_say_what_the_argument_is(tmp_path, capsys):
    """Issue 37, item 6: a missing folder was said to hold no rounds, a file to lack
    queries.jsonl."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    missing = tmp_path / "nonexistent"
    for command in ("audit", "attribute"):
        assert main([command, str(missing)]) == 2
        assert f"RUN_DIR: '{missing}' does not exist; give a run folder" in _one_line(capsys)
        assert main([command, str(afile)]) == 2
        assert f"RUN_DIR: '{afile}' is a file; give a run folder" in _one_line(capsys)


def test_a_varying_watermark_signal_changes_only_the_watermarked_clients():
    """``synthetic.signal_cv``: each watermarked client's signal along s is scaled per round by
    a draw of mean 1 (its own stream: every other part of the federation is unchanged); 0
    keeps the same signal every round, and a negative value is one clear line."""
    fixed, varied = (
        SyntheticPool(SyntheticConfig(dim=64, seed=3)),
        SyntheticPool(SyntheticConfig(dim=64, seed=3, signal_cv=0.8)),
    )
    s, scales = fixed.direction, []
    for t in (1, 2, 3, 4):
        a, b = fixed.updates(t), varied.updates(t)
        for j in a:
            diff = (b[j] - a[j]).double()
            if j in fixed.watermarked:
                scales.append(float(diff @ s) / 3.0 + 1.0)
                assert torch.allclose(diff, (diff @ s) * s, atol=1e-5)  # along s only
            else:
                assert torch.equal(a[j], b[j])
    assert len(set(round(x, 4) for x in scales)) == len(scales) and min(scales) > 0
    with pytest.raises(ValueError, match=r"synthetic\.signal_cv"):
        SyntheticConfig(signal_cv=-0.1)
