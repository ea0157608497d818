import copy
import json

import pytest
import torch

from conftest import MICRO_TINY
from conftest import small_overrides as _small
from fedattr.cli import main
from fedattr.config import load, to_dict
from fedattr.models.config import ModelConfig, TinyModelConfig
from fedattr.models.loading import load_model, weights_digest
from fedattr.models.tiny import ensure_tiny
from fedattr.pipeline.config import RunConfig
from fedattr.pipeline.run import run_experiment
from fedattr.runtime import cpu_name


@pytest.mark.parametrize(
    ("strategy", "detector"), [("fedit", "reading"), ("flora", "reading"), ("fedit", "greedy")]
)
def test_short_run_end_to_end(tiny_cache, strategy, detector):
    cfg = load(
        RunConfig,
        None,
        _small(
            tiny_cache,
            f"fl.strategy={strategy}",
            f"watermark.detector={detector}",
            "attribution.statistic=" + ("paper" if detector == "greedy" else "calibrated"),
        ),
    )
    said: list[str] = []
    result = run_experiment(cfg, progress=said.append)
    d = result.to_dict()
    # The verdicts of the calibrated statistic are a stage of their own: announced and timed.
    final = [m for m in said if m.startswith("final verdicts")]
    assert len(final) == (2 if detector == "reading" else 0)
    assert d["sa_queries"] == 2 * (2 * 2 * 4 + 1)  # T * (2MK attribution + 1 aggregate)
    assert d["mode"] == "paper"
    assert {"train_s", "sa_s", "scoring_s", "total_s"} <= set(d["timing"])
    assert len(d["clients"]) == 4 and sum(c["watermarked"] for c in d["clients"]) == 1
    assert all(set(c["z"]) == {"1", "2"} for c in d["clients"])
    assert set(d["by_statistic"]) == {"kgw:owner0", "kgw:owner1"}
    assert d["federation"]["watermarked_docs"]  # the teacher kept some documents
    # The paired reading test has no reference level; the greedy z-test has one per owner.
    refs = [r["reference_score"] for r in result.rounds]
    assert all(r == {} for r in refs) if detector == "reading" else all(len(r) == 2 for r in refs)


def test_run_cli_writes_folder_and_rejects_bad_input(tiny_cache, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["run", "--out", str(out)]
    for s in _small(tiny_cache, "fl.rounds=1"):
        args += ["--set", s]
    assert main(args) == 0
    res = json.loads((out / "results.json").read_text())
    assert {"tpr", "fpr", "clients", "sa_queries", "timing"} <= set(res)
    assert (out / "attribution.png").is_file() and (out / "rounds.jsonl").is_file()
    assert "overhead" in (out / "report.md").read_text()
    # Every stage a run goes through has its seconds and its peak memory.
    stages = {"load", "teacher", "train", "sa", "scoring", "verdict"}
    assert stages <= {k.removesuffix("_s") for k in res["timing"]}
    assert stages <= set(res["memory_gb"]) and all(v > 0 for v in res["memory_gb"].values())
    # ... and the stage profile beside them (on the CPU: no device columns).
    profile = res["timing"]["stages"]
    assert stages <= set(profile)
    assert all(profile[s]["seconds"] == res["timing"][f"{s}_s"] for s in stages)
    assert profile["train"]["peak_rss_gb"] == res["memory_gb"]["train"]
    assert not any("device_busy" in row for row in profile.values())
    assert res["training"] == {"batched": True}  # the embedded default's clients, together
    assert "| verdict_s |" in (out / "report.md").read_text()
    # The weights the run started from, the CPU and torch: a seed's run is the same only there.
    path = ensure_tiny(TinyModelConfig(**MICRO_TINY), tiny_cache)
    started = load_model(ModelConfig(preset="hf", name_or_path=str(path), device="cpu"))[0]
    assert res["model"]["weights"] == weights_digest(started)
    assert res["model"]["cpu"] == cpu_name() and res["model"]["torch"] == torch.__version__
    capsys.readouterr()
    assert main(["run", "--set", "fl.strategy=fedavg"]) == 2
    assert "fl.strategy: unknown 'fedavg'; allowed: fedit, flora" in capsys.readouterr().err
    assert main(["run", "--set", "data.path=/no/such.json"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert (
        main(["run", "--set", "fl.train.batch_size=10", "--set", "fl.train.micro_batch_size=4"])
        == 2
    )
    assert "multiple of" in capsys.readouterr().err


def test_short_run_hardened_stays_within_the_release_budget(tiny_cache):
    from fedattr.attribution.audit import audit_queries

    cfg = load(RunConfig, None, _small(tiny_cache, "attribution.protocol.mode=hardened"))
    assert cfg.secagg.release_budget > 0  # defaulted to the paper's single-estimate bound
    result = run_experiment(cfg, progress=lambda _m: None)
    audited = audit_queries(result.queries)
    assert all(not r.recoverable for r in audited)
    assert max(r.max_leakage for r in audited) <= cfg.secagg.release_budget + 1e-12
    targeted = sum(len(r["targets"]) for r in result.rounds)
    assert result.sa_queries == targeted + 2  # one fused query per target, one aggregate per round


def test_hub_dataset_ids_are_not_mistaken_for_missing_files(tmp_path):
    from fedattr.data.config import DataConfig

    assert DataConfig(path="tatsu-lab/alpaca").path == "tatsu-lab/alpaca"
    with pytest.raises(ValueError, match="does not exist"):
        DataConfig(path=str(tmp_path / "missing.jsonl"))


def test_attribution_variants_share_one_training_run(tiny_cache):
    sets = _small(tiny_cache, 'variants=[{"name": "M3", "protocol": {"M": 3}}]')
    cfg = load(RunConfig, None, sets)
    result = run_experiment(cfg, progress=lambda _m: None)
    alone = run_experiment(
        load(RunConfig, None, _small(tiny_cache, "attribution.protocol.M=3")),
        progress=lambda _m: None,
    )
    v = result.variants["M3"]
    assert v["differs"] == {"protocol.M": 3}
    # The variant's scores are those of a separate run at M=3: same training, own queries.
    assert [c["Z"] for c in v["clients"]] == [c.Z for c in alone.report.clients]
    sessions = {q["session"] for q in result.queries}
    assert sessions == {"", "fedattr", "M3"}
    assert v["sa_queries"] == alone.sa_queries == 2 * (2 * 3 * 4 + 1)
    with pytest.raises(ValueError, match=r"variants\[0\]\.protocol\.mode"):
        load(RunConfig, None, _small(tiny_cache, 'variants=[{"protocol": {"mode": "hardened"}}]'))


def test_bench_pipeline_reports_every_stage_from_the_run(tiny_cache, tmp_path, capsys):
    out = tmp_path / "bench"
    args = ["bench", "pipeline", "--rounds", "1", "--out", str(out), "--json"]
    for s in _small(tiny_cache):
        args += ["--set", s]
    assert main(args) == 0
    fig = json.loads(capsys.readouterr().out)
    st = fig["stages"]
    res = json.loads((out / "results.json").read_text())
    # The counters are the work the run did: K=4 clients' tokens, every SA query, and per
    # round the reference and the 4 candidates (calibrated statistic, cross-talk undone: the
    # SA mean is not read).
    assert st["training"]["tokens"] > 0 and st["training"]["tokens_per_s"] > 0
    assert st["training"]["steps"] == res["work"]["train_steps"] >= 4
    assert st["sa"]["queries"] == res["sa_queries"] > 0
    assert st["scoring"]["models"] == 1 + 4
    assert st["teacher"]["documents"] == sum(res["federation"]["watermarked_docs"].values())
    assert fig["parameters"] > 0 and fig["device"] == "cpu" and st["training"]["mfu"] is None
    assert fig["dtype"] == res["model"]["dtype"] == "float32"
    assert "tokens/s" in (out / "pipeline.md").read_text()
    assert "(CPU, float32)" in (out / "pipeline.md").read_text()
    # A second call reuses the finished run; bad input is one line.
    assert main(args) == 0 and json.loads(capsys.readouterr().out) == fig
    assert main(["bench", "pipeline", "--rounds", "0"]) == 2
    assert "--rounds: must be >= 1" in capsys.readouterr().err


def test_bench_scoring_compares_stacked_and_one_at_a_time_reads(tiny_cache, tmp_path, capsys):
    out = tmp_path / "scoring"
    args = ["bench", "scoring", "--candidates", "3", "--repeats", "1", "--out", str(out), "--json"]
    for s in _small(tiny_cache):
        args += ["--set", s]
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["space"] for r in rows] == ["FedIT (LoRA factors)", "FLoRA (merged weights)"]
    for r in rows:
        assert r["candidates"] == 3 and r["probes"] > 0 and r["device"] == "cpu"
        assert r["one_at_a_time_s"] > 0 and r["stacked_s"] > 0
        assert r["max_abs_difference"] < 1e-3  # the same reads up to float rounding
    assert json.loads((out / "scoring.json").read_text()) == rows
    assert "speedup" in (out / "scoring.md").read_text()
    assert main(["bench", "scoring", "--candidates", "1"]) == 2
    assert "--candidates: must be >= 2" in capsys.readouterr().err


@pytest.mark.parametrize("batched", ["true", "false"])
def test_bench_training_sets_a_round_against_its_matrix_products(
    tiny_cache, tmp_path, capsys, batched
):
    from fedattr.fl.federation import clean_data, partition_records
    from fedattr.models.loading import load_model
    from fedattr.models.text import encode_examples

    out = tmp_path / "training"
    args = ["bench", "training", "--repeats", "2", "--out", str(out), "--json"]
    for s in _small(tiny_cache, f"fl.batched={batched}"):
        args += ["--set", s]
    assert main(args) == 0
    fig = json.loads(capsys.readouterr().out)
    assert fig["batched"] is (batched == "true") and fig["clients"] == 4
    assert len(fig["rounds_s"]) == 2 and fig["round_s"] > 0
    # The round's tokens, counted apart: every client's examples, once per local epoch.
    cfg = load(RunConfig, None, _small(tiny_cache))
    _, tok = load_model(cfg.model)
    records, _ = clean_data(cfg.data, cfg.watermark, cfg.fl.K)
    shards = partition_records(records, cfg.data, cfg.fl.K)
    lengths = sum(len(e.input_ids) for s in shards for e in encode_examples(tok, s, 64))
    assert fig["tokens"] == cfg.fl.train.epochs * lengths
    # Only matrix products are counted, the forward's and the backward's.
    ops = fig["matmul_flops_by_op"]
    assert set(ops) <= {"aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm"} and ops
    assert fig["matmul_flops"] == sum(ops.values()) > 0
    rate = fig["machine"]
    assert rate["flops_per_s"] == max(rate["by_shape"].values()) > 0
    assert "1024x1024x1024" in rate["by_shape"]
    assert fig["floor_s"] == pytest.approx(fig["matmul_flops"] / rate["flops_per_s"])
    assert fig["headroom"] == pytest.approx(fig["round_s"] / fig["floor_s"])
    assert json.loads((out / "training.json").read_text()) == fig
    assert "round / floor" in (out / "training.md").read_text()
    assert main(["bench", "training", "--repeats", "0"]) == 2
    assert "--repeats: must be >= 1" in capsys.readouterr().err


def test_bench_training_trains_the_configured_client_profiles(tiny_cache, capsys):
    from fedattr.fl.federation import clean_data, partition_records
    from fedattr.models.loading import load_model
    from fedattr.models.text import encode_examples

    args = ["bench", "training", "--repeats", "1", "--json"]
    for s in _small(tiny_cache, 'fl.clients=[{"ids": [0], "epochs": 1}]'):
        args += ["--set", s]
    assert main(args) == 0
    fig = json.loads(capsys.readouterr().out)
    cfg = load(RunConfig, None, _small(tiny_cache))
    _, tok = load_model(cfg.model)
    records, _ = clean_data(cfg.data, cfg.watermark, cfg.fl.K)
    shards = partition_records(records, cfg.data, cfg.fl.K)
    lengths = [sum(len(e.input_ids) for e in encode_examples(tok, s, 64)) for s in shards]
    # Client 0 trains one epoch, the others fl.train.epochs (2).
    assert cfg.fl.train.epochs == 2
    assert fig["tokens"] == lengths[0] + 2 * sum(lengths[1:])


def test_overlapped_scoring_on_a_model_copy_gives_the_same_results(tiny_cache, tmp_path):
    from fedattr.reporting.run_folder import RunFolder

    inline = run_experiment(load(RunConfig, None, _small(tiny_cache)), progress=lambda _m: None)
    cfg = load(RunConfig, None, _small(tiny_cache, "attribution.overlap=true"))
    folder = RunFolder(tmp_path / "run")
    folder.claim(to_dict(cfg))
    overlapped = run_experiment(cfg, progress=lambda _m: None, folder=folder)
    assert [c.Z for c in overlapped.report.clients] == [c.Z for c in inline.report.clients]
    assert [c.p for c in overlapped.report.clients] == [c.p for c in inline.report.clients]
    assert overlapped.sa_queries == inline.sa_queries


def test_a_failed_start_leaves_no_folder_to_block_the_corrected_run(tmp_path, monkeypatch, capsys):
    from fedattr.errors import UserError
    from fedattr.pipeline import run as run_module

    monkeypatch.chdir(tmp_path)
    (tmp_path / "wrongfields.json").write_text(json.dumps([{"prompt": "a", "completion": "b"}]))
    bad = ["run", "--set", "data.path=wrongfields.json"]
    # Checked before anything is written: the same command again gets the same one line.
    for args in ([*bad, "--out", "d1"], [*bad, "--out", "d1"], bad):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "data.path: wrongfields.json[0]: expected Alpaca" in err
    assert not (tmp_path / "d1").exists() and not (tmp_path / "runs").exists()

    # A start that fails later (in the run, before its first round) gives its folder back:
    # the one it made, the runs/ it made, or an empty one the user made (empty again).
    def fails(cfg, folder=None, **_):
        assert folder.file("config.json").is_file()
        (folder.path / "partial.txt").write_text("what a failed start wrote")
        raise UserError("model: could not load it")

    monkeypatch.setattr(run_module, "run_experiment", fails)
    (tmp_path / "mine").mkdir()
    for args in (["run"], ["run", "--out", "d1"], ["run", "--out", "mine"]):
        assert main(args) == 2
        assert "model: could not load it" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "d1").exists()
    assert list((tmp_path / "mine").iterdir()) == []

    def bug(cfg, folder=None, **_):
        raise TypeError("a bug")

    monkeypatch.setattr(run_module, "run_experiment", bug)
    with pytest.raises(TypeError, match="a bug"):  # a bug keeps its traceback
        main(["run", "--out", "d1", "--set", "fl.rounds=3"])
    assert not (tmp_path / "d1").exists()

    def interrupted(cfg, folder=None, **_):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "run_experiment", interrupted)
    assert main(["run", "--out", "d1"]) == 130
    assert "before the first round finished; nothing was kept" in capsys.readouterr().err
    assert not (tmp_path / "d1").exists()

    def after_round_one(cfg, folder=None, **_):
        folder.save_checkpoint({"round": 1})
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "run_experiment", after_round_one)
    assert main(["run", "--out", "d1"]) == 130  # a finished round is work: the folder stays
    assert "continue with 'fedattr run --resume d1'" in capsys.readouterr().err
    assert (tmp_path / "d1" / "checkpoint" / "state.pt").is_file()


def test_run_inputs_are_checked_before_the_folder_is_written(tmp_path, monkeypatch, capsys):
    import os

    from fedattr.watermarks.keys import generate_key, save_key

    monkeypatch.chdir(tmp_path)
    (tmp_path / "one.json").write_text(json.dumps([{"instruction": "a", "output": "b"}]))
    (tmp_path / "adir").mkdir()
    os.chmod(save_key(generate_key(), tmp_path / "open.key"), 0o644)
    cases = [
        (
            ["--set", "data.path=one.json"],
            "data.path: 'one.json' holds 1 usable record; 1 held "
            "out as detection texts leaves 0 for fl.K=10 clients, one each at least: give a file "
            "of at least 11 records",
        ),
        (["--set", "data.path=adir"], "data.path: 'adir' is a directory; a .json/.jsonl file"),
        (["--config", "adir"], "--config: 'adir' is a directory; a .json or .toml"),
        (
            ["--set", 'watermark.kgw.key_files=["open.key"]'],
            "watermark.kgw.key_files: 'open.key' can be read by other users (mode 0644)",
        ),
        (
            ["--set", 'watermark.kgw.key_files=["adir"]'],
            "watermark.kgw.key_files: 'adir' is a directory; a key file is expected",
        ),
        (
            ["--set", "watermark.kgw.documents=adir"],
            "watermark.kgw.documents: 'adir' is a directory",
        ),
        (
            ["--set", "model.preset=hf", "--set", "model.name_or_path=./no/model"],
            "model.name_or_path: './no/model' does not exist (no such folder) and is not a "
            "Hugging Face id",
        ),
        (["--set", "data.records=5"], "data.records: must be >= fl.K=10"),
    ]
    for args, message in cases:
        for command in (["run", *args, "--out", "d1"], ["run", *args]):
            assert main(command) == 2
            err = capsys.readouterr().err
            assert message in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "one.json", "open.key"]


def test_without_the_optional_extras_runs_keep_their_results_and_say_what_to_install(
    tmp_path, monkeypatch, capsys
):
    import fedattr.errors
    import fedattr.reporting.run_folder as run_folder

    # No matplotlib: the run's results and report, and one line instead of the plot.
    monkeypatch.setattr(run_folder, "has_module", lambda m: m != "matplotlib")
    out = tmp_path / "demo"
    assert main(["demo-protocol", "--out", str(out), "--set", "synthetic.dim=64"]) == 0
    report = (out / "report.md").read_text()
    assert "attribution.png not drawn: pip install 'fedattr[plots]'" in report
    assert (out / "results.json").is_file() and not (out / "attribution.png").exists()
    # No scikit-learn: baselines refused in one line before any folder is written; the
    # figure-making experiments likewise without matplotlib.
    monkeypatch.setattr(fedattr.errors, "has_module", lambda m: m not in ("sklearn", "matplotlib"))
    capsys.readouterr()
    assert main(["run", "--out", str(tmp_path / "b"), "--set", "baselines=true"]) == 2
    assert "needs sklearn: pip install 'fedattr[baselines]'" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
    assert main(["experiment", "calibration", "--out", str(tmp_path / "c")]) == 2
    assert "needs matplotlib: pip install 'fedattr[plots]'" in capsys.readouterr().err


def test_weights_digest_tells_weights_apart_to_the_last_bit():
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    b = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    b.load_state_dict(a.state_dict())
    assert weights_digest(a) == weights_digest(b)
    with torch.no_grad():  # one float one unit in the last place away
        b[0].weight[1, 2] = torch.nextafter(b[0].weight[1, 2], torch.tensor(1.0))
    assert weights_digest(a) != weights_digest(b)
    # The dtype counts too: the same values in float64 are other weights for a run.
    assert weights_digest(a) != weights_digest(copy.deepcopy(a).double())
