"""``fedattr experiment sweep`` on micro runs of the tiny model."""

import json

import pytest

from conftest import small_overrides as _small
from fedattr.cli import main
from fedattr.errors import UserError
from fedattr.experiments.sweep import SweepSpec, parse_grid


def test_grid_parsing_and_grouping():
    grid = parse_grid(["attribution.protocol.M=2,3", "watermark.r=0,1"])
    assert [(a.label, [v for v, _ in a.values]) for a in grid] == [
        ("attribution.protocol.M", ["2", "3"]),
        ("watermark.r", ["0", "1"]),
    ]
    assert grid[0].values[1] == ("3", {"attribution.protocol.M": "3"})
    spec = SweepSpec(grid, seeds=[0])
    assert len(spec.points) == 4
    # Attribution-only keys never split a training run; attribution.protocol.mode does (one release
    # policy per run).
    assert sorted(spec.groups()) == ["watermark.r=0", "watermark.r=1"]
    assert all(len(m) == 2 for m in spec.groups().values())
    assert len(SweepSpec(parse_grid(["attribution.protocol.mode=paper,hardened"])).groups()) == 2
    for bad, msg in [
        ([], "at least one"),
        (["M"], "expected KEY=v1"),
        (["a.b="], "expected"),
        (["a.b=1", "a.b=2"], "given twice"),
        (["a.b=1,1"], "repeated"),
    ]:
        with pytest.raises(UserError, match=msg):
            parse_grid(bad)
    with pytest.raises(UserError, match="--preset"):
        SweepSpec(grid, preset="huge")


@pytest.mark.slow
def test_micro_sweep_trains_once_per_training_point_and_resumes(tiny_cache, tmp_path, capsys):
    out = tmp_path / "sweep"
    args = [
        "experiment",
        "sweep",
        "--grid",
        "attribution.protocol.M=2,3",
        "--grid",
        "watermark.r=0,1",
        "--out",
        str(out),
    ]
    for s in _small(tiny_cache, "fl.rounds=1"):
        args += ["--set", s]
    assert main(args) == 0
    runs = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert runs == ["watermark.r=0_seed0", "watermark.r=1_seed0"]  # 4 points, 2 trainings
    summary = json.loads((out / "results.json").read_text())
    assert summary["training_runs"] == 2 and len(summary["points"]) == 4
    by = {
        (p["values"]["attribution.protocol.M"], p["values"]["watermark.r"]): p
        for p in summary["points"]
    }
    # M=3 asks more SA queries than M=2 on the very same training run.
    for r in ("0", "1"):
        assert by[("3", r)]["sa_queries"] > by[("2", r)]["sa_queries"]
        assert by[("3", r)]["runs"] == by[("2", r)]["runs"]
        assert by[("3", r)]["run_s"] == by[("2", r)]["run_s"]
    assert by[("2", "0")]["tpr"] is None and by[("2", "1")]["tpr"] in (0.0, 1.0)
    res = json.loads((out / "watermark.r=1_seed0" / "results.json").read_text())
    assert set(res["variants"]) == {"M=3"}
    table = (out / "table.md").read_text()
    assert table.count("\n| ") == 5  # header + 4 points
    assert (out / "table.csv").read_text().count("\n") == 5
    for key in ("attribution.protocol.M", "watermark.r"):
        assert (out / f"plot-{key}.png").read_bytes()[:4] == b"\x89PNG"
    # Re-running keeps the finished runs (nothing retrained) and writes the same summary.
    stamp = (out / "watermark.r=1_seed0" / "results.json").stat().st_mtime_ns
    capsys.readouterr()
    assert main(args) == 0
    assert (out / "watermark.r=1_seed0" / "results.json").stat().st_mtime_ns == stamp
    assert json.loads((out / "results.json").read_text()) == summary
    # Another configuration into the same folder is refused with one line.
    assert main([*args, "--set", "fl.train.lr=7e-4"]) == 2
    assert "another configuration" in capsys.readouterr().err


def test_named_tables_resolve_and_their_extra_columns():
    from fedattr.config import load
    from fedattr.experiments.tables import TABLES, table_spec
    from fedattr.pipeline.config import RunConfig

    for name in TABLES:  # every preset builds valid configurations before any work
        spec = table_spec(name, [0])
        for members in spec.groups().values():
            spec.run_config(members, 0)
    sizes = table_spec("subset-size", [0])
    assert len(sizes.groups()) == 1  # N is attribution-only: one training run, 6 observers
    assert sizes.extra["variance factor"]({"attribution.protocol.N": "5"}, RunConfig()) == "2.50"
    partial = table_spec("partial", [0])
    cfg = load(RunConfig, None, ["fl.K=20", "fl.rounds=10", "fl.participation=0.5"])
    assert partial.extra["rounds per client (T·C/K)"]({}, cfg) == "5.0"
    scal = table_spec("scalability", [0])
    assert len(scal.points) == 8 and len(scal.groups()) == 4  # fixed and proportional N share
    with pytest.raises(UserError, match="allowed: prevalence"):
        table_spec("table-9", [0])


@pytest.mark.slow
def test_micro_named_table(tiny_cache, tmp_path, capsys):
    out = tmp_path / "queries"
    args = ["experiment", "table", "queries", "--out", str(out)]
    for s in _small(tiny_cache, "fl.rounds=1"):
        args += ["--set", s]
    assert main(args) == 0
    summary = json.loads((out / "results.json").read_text())
    assert summary["name"] == "queries" and summary["training_runs"] == 1
    queries = [p["sa_queries"] for p in summary["points"]]
    assert queries == sorted(queries) and len(queries) == 5  # 2MK grows with M
    assert "Queries per side M" in (out / "table.md").read_text()
    assert main(["experiment", "table", "nope"]) == 2
    assert "allowed: prevalence" in capsys.readouterr().err


def test_overhead_layout_reports_work_per_stage(tiny_cache, tmp_path):
    from fedattr.experiments.sweep import Axis, run_sweep
    from fedattr.experiments.tables import TABLES

    assert TABLES["overhead"].layout == "overhead"
    spec = SweepSpec(
        [Axis.of_key("fl.K", ["4"])],
        seeds=[0],
        overrides=_small(tiny_cache, "fl.rounds=1"),
        name="overhead",
        extra=dict(TABLES["overhead"].extra),
        layout="overhead",
    )
    summary = run_sweep(spec, tmp_path / "ovh", progress=lambda _m: None)
    (point,) = summary["points"]
    # 2MKT subset queries (M=2, K=4, T=1) plus the round's aggregate; K candidates and the
    # reference read by the detector (cross-talk undone: the SA mean is not read).
    assert point["2MKT"] == "16" and point["sa_queries"] == 17
    assert point["models_scored"] == 5 and point["train_s"] > 0
    text = (tmp_path / "ovh" / "table.md").read_text()
    assert "| per query ms |" in text and "% of training" in text and "| 17 |" in text


@pytest.mark.slow
def test_a_sweep_killed_mid_run_resumes_to_the_same_table(tiny_cache, tmp_path, monkeypatch):
    from fedattr.experiments import main as main_module

    args = ["experiment", "sweep", "--grid", "watermark.r=0,1"]
    for s in _small(tiny_cache):
        args += ["--set", s]
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    real, calls = main_module.run_experiment, []

    def killed_in_round_two_of_the_second_run(cfg, progress=None, folder=None):
        calls.append(1)

        def say(message):
            if len(calls) == 2 and "round 2" in message:
                raise KeyboardInterrupt  # after round 1's checkpoint

        return real(cfg, progress=say, folder=folder)

    monkeypatch.setattr(main_module, "run_experiment", killed_in_round_two_of_the_second_run)
    out = tmp_path / "cut"
    assert main([*args, "--out", str(out)]) == 130
    from fedattr.reporting.run_folder import RunFolder

    assert RunFolder(out / "watermark.r=0_seed0").status == "finished"
    assert RunFolder(out / "watermark.r=1_seed0").status == "interrupted"
    monkeypatch.setattr(main_module, "run_experiment", real)
    assert main([*args, "--out", str(out)]) == 0
    timing = ("run_s", "train_s", "attribution_s", "sa_s", "scoring_s", "verdict_s")

    def points(folder):
        summary = json.loads((folder / "results.json").read_text())
        return [{k: v for k, v in p.items() if k not in timing} for p in summary["points"]]

    assert points(out) == points(tmp_path / "whole")
