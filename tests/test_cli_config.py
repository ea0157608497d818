import dataclasses
import json
import re
import typing

import pytest

from fedattr.cli import main
from fedattr.config import ConfigError, apply_overrides, literal_fields, load
from fedattr.errors import UserError
from fedattr.pipeline.config import DemoConfig


def test_load_toml_with_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[synthetic]\nK = 12\nwatermarked = [1, 2]\n[secagg]\nbackend = "two-server"\n')
    cfg = load(DemoConfig, f, ["attribution.protocol.M=7", "synthetic.signal=2"])
    assert cfg.synthetic.K == 12 and cfg.synthetic.watermarked == [1, 2]
    assert cfg.secagg.backend == "two-server" and cfg.attribution.protocol.M == 7
    assert cfg.synthetic.signal == 2.0 and isinstance(cfg.synthetic.signal, float)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["attribution.MM=3"], "unknown setting attribution.MM"),
        (["attribution.protocol.M=three"], "attribution.protocol.M: expected an integer"),
        (["attribution.protocol.M=0"], "attribution.protocol.M: must be an integer >= 1"),
        (["secagg.ring_bits=16"], "ring_bits: must be 32 or 64"),
        (["synthetic.watermarked=[1, 1]"], "synthetic.watermarked: ids must be distinct"),
        (["nokey"], "expected key=value"),
    ],
)
def test_bad_settings_name_the_key(overrides, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        load(DemoConfig, None, overrides)


def test_missing_and_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load(DemoConfig, tmp_path / "nope.toml")
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    with pytest.raises(ConfigError, match="is not valid"):
        load(DemoConfig, bad)


def test_overrides_do_not_mutate_input():
    data = {"a": {"b": 1}}
    out = apply_overrides(data, ["a.b=2", 'a.c="x"'])
    assert data == {"a": {"b": 1}} and out == {"a": {"b": 2, "c": "x"}}


def test_cli_privacy_json(capsys):
    assert main(["privacy", "--K", "10", "--N", "5", "--M", "5", "--trials", "4000", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["queries_per_round"] == 100 and 0.83 < out["acceptance"]["rate"] < 0.91
    assert out["joint"]["recoverable_clients"] == 10


def test_cli_errors_are_one_line(capsys):
    assert main(["privacy", "--K", "10", "--N", "9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedattr: error: N: the subset size") and err.count("\n") == 1
    assert main(["demo-protocol", "--set", "secagg.backend=nope"]) == 2
    assert "allowed: plaintext, pairwise-mask, two-server" in capsys.readouterr().err
    assert main(["bench", "secagg", "--dim", "0"]) == 2
    assert "--dim: must be >= 1" in capsys.readouterr().err


def test_cli_demo_writes_run_folder(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(
        [
            "demo-protocol",
            "--quiet",
            "--out",
            str(out),
            "--set",
            "synthetic.dim=64",
            "--set",
            "synthetic.rounds=2",
        ]
    )
    assert code == 0
    res = json.loads((out / "results.json").read_text())
    assert {"tpr", "fpr", "clients", "sa_queries", "timing"} <= set(res)
    assert len(res["clients"]) == 10 and set(res["clients"][0]) >= {"id", "Z", "p", "flagged", "z"}
    assert len((out / "rounds.jsonl").read_text().splitlines()) == 2
    assert "| client |" in (out / "report.md").read_text()
    assert (out / "attribution.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "TPR" in capsys.readouterr().out


def test_cli_bench_small(capsys):
    assert (
        main(["bench", "secagg", "--dim", "1000", "--members", "3", "--repeats", "1", "--json"])
        == 0
    )
    rows = json.loads(capsys.readouterr().out)
    assert {r["backend"] for r in rows} >= {"plain-sum", "plaintext", "pairwise-mask", "two-server"}


def test_cli_bench_verdicts_times_the_end_of_a_calibrated_run(capsys):
    """Sums, rank check and tails on small changes; a bad size is one line naming the flag."""
    argv = ["bench", "verdicts", "--contexts", "4", "--vocab", "256", "--null-keys", "20"]
    assert main([*argv, "--json"]) == 0
    fig = json.loads(capsys.readouterr().out)
    assert fig["cells_per_client"] == 1024 and fig["clients"] == 10 and fig["null_keys"] == 20
    assert fig["tail_methods"] and all(fig[k] >= 0 for k in ("sums_s", "rank_check_s", "tails_s"))
    assert main(["bench", "verdicts", "--owners", "0"]) == 2
    assert "--owners: must be >= 1, got 0" in capsys.readouterr().err


def test_setting_one_nested_key_keeps_the_parents_other_defaults():
    from fedattr.config import load
    from fedattr.pipeline.config import RunConfig

    default = RunConfig().fl.train
    cfg = load(RunConfig, None, ["fl.train.lr=5e-4"])
    assert cfg.fl.train.lr == 5e-4
    assert cfg.fl.train.epochs == default.epochs == 2  # the run's default, not TrainSettings'


def test_unknown_detector_is_named():
    from fedattr.pipeline.config import RunConfig, preset_overrides

    message = r"watermark\.detector: unknown 'magic'; allowed: reading, greedy"
    with pytest.raises(ConfigError, match=message):
        load(RunConfig, None, ["watermark.detector=magic"])
    with pytest.raises(ConfigError, match=r"watermark\.teacher\.batch: must be >= 1, got 0"):
        load(RunConfig, None, ["watermark.teacher.batch=0"])
    assert load(RunConfig, None, preset_overrides("smollm2")).watermark.teacher.batch == 128
    # The CPU preset is the GPU one made smaller, later settings winning.
    cpu = load(RunConfig, None, preset_overrides("smollm2-cpu"))
    assert cpu.model.preset == "smollm2-135m"
    assert (cpu.data.records, cpu.data.max_len, cpu.watermark.teacher.batch) == (500, 64, 32)
    # ... with a watermark its few documents can teach: small steps, 2 epochs, LoRA lr 1e-3
    train = cpu.fl.train
    assert (train.batch_size, train.micro_batch_size, train.epochs, train.lr) == (4, 4, 2, 1e-3)
    # Both SmolLM2 presets fuse each target's queries; the default is the paper's subsets.
    assert (
        cpu.attribution.protocol.queries
        == "fused"
        == load(RunConfig, None, preset_overrides("smollm2")).attribution.protocol.queries
    )
    assert load(RunConfig, None, []).attribution.protocol.queries == "subsets"


def _literal_settings(cls, prefix=""):
    """(dotted key, section class, field, allowed values) of every Literal setting under cls."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _literal_settings(hints[f.name], f"{prefix}{f.name}.")
    for name, allowed in literal_fields(cls).items():
        yield f"{prefix}{name}", cls, name, allowed


def test_every_literal_setting_is_checked_from_files_and_in_python():
    from fedattr.pipeline.config import RunConfig

    settings = list(_literal_settings(RunConfig))
    keys = {key for key, *_ in settings}
    assert {"attribution.protocol.mode", "model.dtype", "secagg.prg", "watermark.detector"} <= keys
    assert "fl.strategy" not in keys and "secagg.backend" not in keys  # registries stay str
    for key, cls, name, allowed in settings:
        message = f"{key}: unknown 'bogus'; allowed: {', '.join(allowed)}"
        with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
            load(RunConfig, None, [f"{key}=bogus"])
        # Built in Python, the section's own check names the same key (and its error class).
        with pytest.raises(UserError, match=f"^{re.escape(message)}$"):
            cls(**{name: "bogus"})


def test_the_prg_setting_allows_every_generator():
    from fedattr.secagg.config import SecAggConfig
    from fedattr.secagg.prg import PRG_NAMES

    assert literal_fields(SecAggConfig)["prg"] == (*PRG_NAMES, "auto")


def test_a_bad_choice_on_the_command_line_is_one_line(capsys):
    assert main(["run", "--set", "attribution.protocol.mode=bogus"]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == "fedattr: error: attribution.protocol.mode: unknown 'bogus'; allowed: paper, hardened, "
        "sealed\n"
    )
    assert main(["demo-protocol", "--set", 'variants=[{"scoring": "x"}]']) == 2
    assert "variants[0].scoring: unknown 'x'; allowed: server, owner" in capsys.readouterr().err


def test_overlap_is_refused_beside_baselines_and_owner_scoring(capsys):
    for extra in ("baselines=true", "attribution.scoring=owner"):
        assert main(["run", "--set", "attribution.overlap=true", "--set", extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1
        assert "attribution.overlap" in err and "allowed there: false" in err


def test_privacy_refuses_bad_numbers_and_what_memory_cannot_hold(capsys):
    for args, message in [
        (["--trials", "0"], "--trials: Monte Carlo draws, must be >= 1, got 0"),
        (["--d-star", "0"], "--d-star: the effective dimension, must be a number > 0, got 0"),
        (["--C", "-1"], "--C: must be a number >= 0, got -1"),
        # 5e14 bytes for one round's joint recovery: no machine; refused before allocating
        (["--K", "1000000"], "--K: K=1000000, M=5 and 20000 trials need about"),
    ]:
        assert main(["privacy", *args]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert "allowed here (half the available memory): at most --K " in err


def test_output_into_a_closed_pipe_ends_quietly():
    # `fedattr audit --json RUN | head`: the reader stops early; no BrokenPipeError traceback.
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)  # the reader is gone before a byte is written
    try:
        done = subprocess.run(
            [sys.executable, "-m", "fedattr", "privacy", "--K", "10", "--trials", "100", "--json"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
    assert done.returncode == 141 and done.stderr == ""


def test_help_tells_the_protocol_demo_from_the_default_run(capsys):
    from fedattr.cli import build_parser

    text = build_parser().format_help()
    demo = " ".join(text[text.index("demo-protocol  ") : text.index("    run  ")].split())
    assert "synthetic" in demo and "the embedded default job is 'fedattr run'" in demo


def test_a_failed_demo_leaves_no_folder(tmp_path, monkeypatch):
    from fedattr.pipeline import run as run_module

    def bug(cfg, progress=None):
        raise TypeError("a bug")

    monkeypatch.setattr(run_module, "run_demo", bug)
    with pytest.raises(TypeError, match="a bug"):
        main(["demo-protocol", "--out", str(tmp_path / "runs" / "demo")])
    assert list(tmp_path.iterdir()) == []  # runs/ made for it is gone too


def test_the_plain_sum_baseline_is_timed_after_a_warm_up(monkeypatch):
    # The first sum starts torch's threads and faults in pages: untimed, as the backends'
    # warm-up query; then at least PLAIN_SUM_REPEATS timed sums and their median.
    from fedattr.experiments import bench

    sums, timed = [], []

    class Vector:
        def to(self, device):
            return self

        def clone(self):
            sums.append(1)
            return self

        def __iadd__(self, other):
            return self

    monkeypatch.setattr(bench.statistics, "median", lambda xs: timed.append(len(xs)) or 0.0)
    bench._plain_sum_ms([Vector(), Vector()], "cpu", repeats=1)
    assert timed == [bench.PLAIN_SUM_REPEATS] and len(sums) == bench.PLAIN_SUM_REPEATS + 1


def test_files_that_are_not_utf8_are_one_line(tmp_path, capsys):
    """Issue 37, item 1: a non-UTF-8 file was a UnicodeDecodeError traceback (``owner
    watermark --in``; the same for ``--config``, ``data.path``, ``owner detect --texts``)."""
    binary = b'{"instruction": "\xd0\xff", "output": "x"}\n'
    (tmp_path / "bin.json").write_bytes(b'{"fl": "\xd0\xff"}')
    (tmp_path / "bin.jsonl").write_bytes(binary)
    from fedattr.watermarks.keys import generate_key, save_key

    key = str(save_key(generate_key(), tmp_path / "owner.key"))
    cases = [
        (["run", "--config", str(tmp_path / "bin.json")], "--config"),
        (["run", "--set", f"data.path={tmp_path / 'bin.jsonl'}"], "data.path"),
        (
            [
                "owner",
                "watermark",
                "--key",
                key,
                "--in",
                str(tmp_path / "bin.jsonl"),
                "--out",
                str(tmp_path / "wm.jsonl"),
            ],
            "--in",
        ),
        (
            [
                "owner",
                "detect",
                "--key",
                key,
                "--model",
                "tiny",
                "--detector",
                "greedy",
                "--texts",
                str(tmp_path / "bin.jsonl"),
            ],
            "--texts",
        ),
    ]
    for argv, option in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert f"{option}: " in err and "is not UTF-8 text" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin.json", "bin.jsonl", "owner.key"]


def test_every_option_of_every_command_has_help():
    """Issue 37, item 6: ``audit --help`` showed ``--json`` with no description."""
    import argparse

    from fedattr.cli import build_parser

    missing = []

    def walk(parser, prefix):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*prefix, name])
            elif action.dest != "help" and not action.help:
                missing.append(" ".join([*prefix, *(action.option_strings or [action.dest])]))

    walk(build_parser(), [])
    assert missing == []


def test_usage_errors_are_one_line(capsys):
    """A value argparse itself refuses (a choice, a type, a missing argument) is one line with
    exit code 2 like every other bad input, not the usage block and then the error."""
    for argv, message in (
        (["owner", "keygen", "--kind", "nope", "--out", "x"], "argument --kind: invalid choice"),
        (["owner", "detect", "--key", "k", "--model", "tiny", "--count", "abc"], "invalid int"),
        ([], "the following arguments are required: command"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.count("\n") == 1 and message in err
        assert "--help" in err


def test_an_experiment_folder_under_a_file_is_refused_before_any_run(tmp_path, capsys):
    """The sweep of issue 37 found ``experiment main --out FILE/x`` a NotADirectoryError
    traceback. Root can write a read-only folder, so the unwritable place is a parent that is
    a regular file."""
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    for argv in (
        ["experiment", "main", "--seeds", "1"],
        ["experiment", "mechanism"],
        ["experiment", "tail-check", str(tmp_path)],
    ):
        assert main([*argv, "--out", str(blocker / "exp")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--out: '{blocker}' is a file, not a folder" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
