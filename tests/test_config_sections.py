"""The configuration in sections by concern (issue 54, item 4): every old flat key is an alias,
read in a file, in ``--set``, in ``variants`` and in a saved ``config.json``, with one line
naming the new key (none for a saved run); errors name the new key; each section round-trips.

``tests/data/config-flat-run.json`` is the ``config.json`` of ``fedattr run`` (the embedded
default) written at commit 9a55727, before the sections; ``config-flat-demo.json`` that of a
hardened ``demo-protocol`` with ``gamma``, ``spill`` and two variants (``M``, ``null``), written
by the same commit."""

import argparse
import dataclasses
import json
import shutil
import typing
from pathlib import Path

import pytest

from fedattr import config as config_module
from fedattr.attribution.config import (
    AttributionConfig,
    CalibratedConfig,
    PaperConfig,
    ProtocolConfig,
)
from fedattr.cli import main
from fedattr.cli.reference import field_docs
from fedattr.config import (
    ConfigError,
    aliases_of,
    canonical,
    canonical_key,
    from_dict,
    load,
    to_dict,
)
from fedattr.errors import UserError
from fedattr.pipeline.config import DemoConfig, RunConfig
from fedattr.reporting.run_folder import CONFIG, RESULTS, RunFolder
from fedattr.watermarks.config import (
    DetectConfig,
    FKConfig,
    KGWConfig,
    TeacherConfig,
    WatermarkConfig,
)

DATA = Path(__file__).parent / "data"
SECTIONS = (
    AttributionConfig,
    ProtocolConfig,
    CalibratedConfig,
    PaperConfig,
    WatermarkConfig,
    KGWConfig,
    FKConfig,
    TeacherConfig,
    DetectConfig,
)


@pytest.fixture(autouse=True)
def fresh_notes(monkeypatch):
    """Each test sees every old key as not yet noted in this process."""
    monkeypatch.setattr(config_module, "_NOTED", set())


def notes(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("fedattr: note: ")]


# --- the sections -------------------------------------------------------------------------------


def test_one_meaning_per_name():
    """gamma is the green fraction only; the paper's threshold has its own name."""
    assert RunConfig().watermark.kgw.gamma == 0.25
    assert RunConfig().attribution.paper.threshold == 4.0
    for cls in (AttributionConfig, WatermarkConfig):
        assert "gamma" not in {f.name for f in dataclasses.fields(cls)}
    assert aliases_of(AttributionConfig)["gamma"] == "paper.threshold"
    assert aliases_of(WatermarkConfig)["gamma"] == "kgw.gamma"


@pytest.mark.parametrize("cls", [AttributionConfig, WatermarkConfig])
def test_every_alias_names_a_key_that_exists_and_no_key_is_shadowed(cls):
    names = {f.name for f in dataclasses.fields(cls)}
    for old, new in aliases_of(cls).items():
        assert old not in names, f"{old} is both a key and an old name"
        node: typing.Any = cls
        for part in new.split("."):
            fields = {f.name: f for f in dataclasses.fields(node)}
            assert part in fields, f"{cls.__name__}: {old} -> {new}: no {part}"
            node = typing.get_type_hints(node)[part]


def _section_classes(cls: type, seen: dict[str, type]) -> dict[str, type]:
    """Every configuration section class reachable from ``cls`` (itself included), by name."""
    seen[cls.__name__] = cls
    for hint in typing.get_type_hints(cls).values():
        for sub in (hint, *typing.get_args(hint)):
            if isinstance(sub, type) and dataclasses.is_dataclass(sub) and sub not in seen.values():
                _section_classes(sub, seen)
    return seen


ALL_SECTIONS = _section_classes(DemoConfig, _section_classes(RunConfig, {}))


def test_the_walk_finds_the_new_sections_and_the_old_ones():
    assert set(SECTIONS) <= set(ALL_SECTIONS.values())
    assert {"ModelConfig", "TinyModelConfig", "TrainSettings", "SyntheticConfig"} <= set(
        ALL_SECTIONS
    )


@pytest.mark.parametrize("cls", list(ALL_SECTIONS.values()), ids=list(ALL_SECTIONS))
def test_every_key_has_a_docstring(cls):
    """Every key of every section of ``fedattr run`` and ``demo-protocol`` says what it does
    (the reference prints it): a setting by its own docstring, a section by its class's."""
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    missing = []
    for f in dataclasses.fields(cls):
        section = hints[f.name]
        if isinstance(section, type) and dataclasses.is_dataclass(section):
            own = section.__doc__ or ""
            if own.startswith(f"{section.__name__}(") and not docs.get(f.name, "").strip():
                missing.append(f.name)  # the automatic "Name(field: type, ...)" says nothing
        elif not docs.get(f.name, "").strip():
            missing.append(f.name)
    assert not missing, f"{cls.__name__}: no docstring for {missing}"


# Each section with values other than its defaults (valid ones).
CHANGED = {
    ProtocolConfig: {"mode": "hardened", "N": 6, "M": 7, "queries": "fused", "max_redraws": 9},
    CalibratedConfig: {
        "alpha": 0.05,
        "null_keys": 0,
        "reading_step": 0.5,
        "late_rounds": "skip",
        "centre": "every",
        "cell_weights": "round",
        "taper": 0.0,
        "spread": 0.0,
        "few_cells": "bound",
        "undo": "changes",
        "across_rounds": "keep",
        "spill": True,
    },
    PaperConfig: {"threshold": 3.0, "null": "empirical", "mean_reference": True},
    KGWConfig: {"gamma": 0.5, "delta": 2.0, "scheme": "markllm", "probes": "held-out"},
    FKConfig: {"writer": "teacher", "questions": 5, "statistic": "rank", "decoys": 7},
    TeacherConfig: {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 64, "batch": 8},
    DetectConfig: {"prompts": 32, "max_new_tokens": 16, "dedupe": False},
}


PLACE = {
    ProtocolConfig: ("attribution", "protocol"),
    CalibratedConfig: ("attribution", "calibrated"),
    PaperConfig: ("attribution", "paper"),
    KGWConfig: ("watermark", "kgw"),
    FKConfig: ("watermark", "fk"),
    TeacherConfig: ("watermark", "teacher"),
    DetectConfig: ("watermark", "detect"),
}


@pytest.mark.parametrize("cls", list(CHANGED), ids=lambda c: c.__name__)
def test_each_section_round_trips_through_to_dict(cls):
    section = cls(**CHANGED[cls])
    data = to_dict(section)
    assert from_dict(cls, data) == section
    assert from_dict(cls, json.loads(json.dumps(data))) == section
    # and inside the whole configuration, where the section lives
    where, name = PLACE[cls]
    run = load(RunConfig, None, [f"{where}.{name}={json.dumps(data)}"])
    assert getattr(getattr(run, where), name) == section
    assert from_dict(RunConfig, to_dict(run)) == run


def test_setting_one_key_of_a_section_keeps_its_other_defaults():
    cfg = load(RunConfig, None, ["attribution.protocol.M=7", "watermark.fk.decoys=5"])
    assert cfg.attribution.protocol == ProtocolConfig(M=7)
    assert cfg.watermark.fk == FKConfig(decoys=5)
    assert cfg.attribution.calibrated == CalibratedConfig()


# --- old names, where a user gives them ----------------------------------------------------------


def test_old_keys_in_a_toml_file(tmp_path, capsys):
    f = tmp_path / "old.toml"
    f.write_text(
        "[attribution]\nM = 7\ngamma = 3.0\nspill = true\ncenter = true\n"
        '[watermark]\ngamma = 0.5\nfk_decoys = 9\nteacher_batch = 4\nprobes = "held-out"\n'
    )
    cfg = load(RunConfig, f)
    assert cfg.attribution.protocol.M == 7 and cfg.attribution.paper.threshold == 3.0
    assert cfg.attribution.calibrated.spill and cfg.attribution.paper.mean_reference
    wm = cfg.watermark
    assert (wm.kgw.gamma, wm.fk.decoys, wm.teacher.batch, wm.kgw.probes) == (0.5, 9, 4, "held-out")
    assert cfg == load(
        RunConfig,
        None,
        [
            "attribution.protocol.M=7",
            "attribution.paper.threshold=3",
            "attribution.calibrated.spill=true",
            "attribution.paper.mean_reference=true",
            "watermark.kgw.gamma=0.5",
            "watermark.fk.decoys=9",
            "watermark.teacher.batch=4",
            "watermark.kgw.probes=held-out",
        ],
    )
    said = notes(capsys.readouterr().err)
    assert "fedattr: note: attribution.gamma is now attribution.paper.threshold; " in said[1]
    assert len(said) == 8  # one line per old key, each naming its new key
    assert any("watermark.teacher_batch is now watermark.teacher.batch" in s for s in said)


def test_old_keys_in_a_json_file(tmp_path, capsys):
    f = tmp_path / "old.json"
    f.write_text(json.dumps({"synthetic": {"K": 12}, "attribution": {"N": 6, "mode": "hardened"}}))
    cfg = load(DemoConfig, f)
    assert (cfg.attribution.protocol.N, cfg.attribution.protocol.mode) == (6, "hardened")
    assert len(notes(capsys.readouterr().err)) == 2


def test_an_old_key_is_noted_once_per_process(capsys):
    for _ in range(3):
        assert load(RunConfig, None, ["attribution.N=6"]).attribution.protocol.N == 6
    assert notes(capsys.readouterr().err) == [
        "fedattr: note: attribution.N is now attribution.protocol.N; the old name is deprecated"
    ]


def test_an_old_name_on_the_command_line_overrides_the_files_new_one(tmp_path):
    new = tmp_path / "new.toml"
    new.write_text("[attribution.protocol]\nM = 7\n")
    assert load(RunConfig, new, ["attribution.M=3"]).attribution.protocol.M == 3
    old = tmp_path / "old.toml"
    old.write_text("[attribution]\nM = 7\n")
    assert load(RunConfig, old, ["attribution.protocol.M=3"]).attribution.protocol.M == 3


def test_an_old_key_and_its_new_one_disagreeing_is_one_error_naming_both():
    data = {"attribution": {"M": 3, "protocol": {"M": 7}}}
    with pytest.raises(ConfigError, match=r"attribution\.M and attribution\.protocol\.M: both"):
        from_dict(RunConfig, data)
    assert (
        from_dict(RunConfig, {"attribution": {"M": 7, "protocol": {"M": 7}}}).attribution.protocol.M
        == 7
    )


def test_errors_name_the_new_key():
    with pytest.raises(ConfigError, match=r"^attribution\.protocol\.M: must be an integer >= 1"):
        load(RunConfig, None, ["attribution.M=0"])
    with pytest.raises(ConfigError, match=r"^attribution\.paper\.null: unknown 'x'"):
        load(RunConfig, None, ["attribution.null=x"])
    with pytest.raises(ConfigError, match=r"^watermark\.kgw\.gamma: must be in \(0, 1\)"):
        load(RunConfig, None, ["watermark.gamma=2"])
    with pytest.raises(ConfigError, match=r"^watermark\.fk\.decoys: expected an integer"):
        load(RunConfig, None, ["watermark.fk_decoys=many"])


def test_canonical_key_walks_the_sections():
    with config_module.quiet_aliases():
        assert canonical_key(RunConfig, "attribution.gamma") == "attribution.paper.threshold"
        assert canonical_key(RunConfig, "watermark.fk_writer") == "watermark.fk.writer"
        assert canonical_key(RunConfig, "attribution.protocol.M") == "attribution.protocol.M"
        assert canonical_key(RunConfig, "fl.train.lr") == "fl.train.lr"


def test_fedattr_run_takes_an_old_key_with_one_line_naming_the_new_one(capsys):
    """The acceptance line: ``fedattr run --set attribution.<old flat key>=...`` still works."""
    # N=9 needs more clients per round: refused before any work, by its new name
    assert main(["run", "--set", "attribution.N=9"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (
        "fedattr: note: attribution.N is now attribution.protocol.N; the old name is deprecated"
    )
    assert err[1].startswith("fedattr: error: attribution.protocol.N=9 needs N < ")
    assert len(err) == 2


def test_demo_protocol_runs_with_old_keys(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["demo-protocol", "--quiet", "--out", str(out), "--set", "synthetic.dim=64"]
    args += ["--set", "synthetic.rounds=2", "--set", "attribution.M=3"]
    args += ["--set", "attribution.gamma=3.5", "--set", "attribution.statistic=paper"]
    assert main(args) == 0
    said = notes(capsys.readouterr().err)
    assert [s.split(" is now ")[1].split(";")[0] for s in said] == [
        "attribution.protocol.M",
        "attribution.paper.threshold",
    ]
    saved = json.loads((out / CONFIG).read_text())["attribution"]
    assert saved["protocol"]["M"] == 3 and saved["paper"]["threshold"] == 3.5
    assert "M" not in saved and "gamma" not in saved  # written by the new names
    assert json.loads((out / RESULTS).read_text())["gamma"] == 3.5  # results.json as before


def test_old_keys_in_variants(capsys):
    cfg = load(
        RunConfig,
        None,
        ['variants=[{"name": "M3", "M": 3, "alpha": 0.05}, {"name": "p", "gamma": 3}]'],
    )
    assert cfg.variants == [
        {"name": "M3", "protocol": {"M": 3}, "calibrated": {"alpha": 0.05}},
        {"name": "p", "paper": {"threshold": 3}},
    ]
    variants = cfg.attribution_variants()
    assert variants["M3"].protocol.M == 3 and variants["M3"].calibrated.alpha == 0.05
    assert variants["M3"].protocol.N == cfg.attribution.protocol.N
    assert variants["p"].paper.threshold == 3.0
    said = notes(capsys.readouterr().err)
    assert "fedattr: note: variants[0].M is now variants[0].protocol.M; " in said[0]
    assert len(said) == 3
    with pytest.raises(ConfigError, match=r"variants\[0\]\.protocol\.mode: must equal"):
        load(RunConfig, None, ['variants=[{"mode": "hardened"}]'])


def test_an_unknown_key_is_still_one_line_listing_the_allowed_ones(capsys):
    assert main(["demo-protocol", "--set", "attribution.MM=3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(
        "fedattr: error: unknown setting attribution.MM; allowed in this section: "
        "attribution.calibrated, attribution.overlap, attribution.paper, "
        "attribution.protocol, attribution.scoring, attribution.sealed, attribution.seed, "
        "attribution.statistic"
    )
    assert main(["demo-protocol", "--set", "attribution.protocol.gamma=3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "unknown setting attribution.protocol.gamma; allowed in this section: " in err
    assert "attribution.protocol.M, attribution.protocol.N" in err


def test_a_bad_value_under_an_old_key_is_one_line_naming_the_new_key_and_its_values(capsys):
    assert main(["run", "--set", "watermark.fk_statistic=median"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "fedattr: note: watermark.fk_statistic is now watermark.fk.statistic; "
        "the old name is deprecated",
        "fedattr: error: watermark.fk.statistic: unknown 'median'; allowed: margin, rank",
    ]
    # an old name inside a section is not an alias there: one line listing the section's keys
    assert main(["run", "--set", "watermark.kgw.fk_decoys=3"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "fedattr: error: unknown setting watermark.kgw.fk_decoys; allowed in this section: "
        "watermark.kgw.delta, watermark.kgw.documents, watermark.kgw.gamma, "
        "watermark.kgw.key_files, watermark.kgw.probes, watermark.kgw.scheme"
    ]


# --- saved configurations: read by their old names, quietly ---------------------------------------


def _folder(tmp_path: Path, fixture: str, finished: bool = True) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(DATA / fixture, run / CONFIG)
    if finished:
        (run / RESULTS).write_text("{}")
    return run


def test_a_run_folder_written_with_flat_keys_is_the_same_run(tmp_path, capsys):
    """``experiment calibration`` and ``--continue`` keep runs made before the sections."""
    saved = json.loads((DATA / "config-flat-run.json").read_text())
    assert "N" in saved["attribution"] and "gamma" in saved["watermark"]  # the old form
    run = _folder(tmp_path, "config-flat-run.json")
    assert RunFolder(run).claim(load(RunConfig), reuse=True) == "finished"
    assert from_dict(RunConfig, saved, quiet=True) == RunConfig()
    other = load(RunConfig, None, ["attribution.protocol.M=4"])
    with pytest.raises(UserError, match="another configuration"):
        RunFolder(run).claim(other, reuse=True)
    assert notes(capsys.readouterr().err) == []  # a saved run is not the user's mistake


def test_a_demo_folder_with_flat_keys_and_variants_is_the_same_run(tmp_path, capsys):
    run = _folder(tmp_path, "config-flat-demo.json")
    now = load(
        DemoConfig,
        None,
        [
            "attribution.protocol.mode=hardened",
            "attribution.paper.threshold=3.5",
            "attribution.calibrated.spill=true",
            'variants=[{"name": "paper", "statistic": "paper"}, '
            '{"name": "M3", "protocol": {"M": 3}, "paper": {"null": "empirical"}}]',
        ],
    )
    assert RunFolder(run).claim(now, reuse=True) == "finished"
    assert notes(capsys.readouterr().err) == []


def test_resume_reads_an_unfinished_flat_run_quietly(tmp_path, capsys):
    from fedattr.cli.common import resolve_run_config

    run = _folder(tmp_path, "config-flat-run.json", finished=False)
    args = argparse.Namespace(resume=str(run), config=None, set=[])
    cfg, folder = resolve_run_config(args, "tiny", ["--config", "--set"])
    assert cfg == RunConfig() and folder is not None
    assert notes(capsys.readouterr().err) == []


def test_an_owner_reads_a_flat_run_json_quietly(tmp_path, capsys):
    from fedattr.owner.score import run_config_of

    rounds = tmp_path / "rounds"
    (rounds / "round-1").mkdir(parents=True)
    saved = json.loads((DATA / "config-flat-run.json").read_text())
    saved["attribution"]["scoring"] = "owner"
    (rounds / "run.json").write_text(json.dumps(saved))
    cfg = run_config_of(rounds / "round-1")
    assert cfg.attribution.scoring == "owner" and cfg.attribution.protocol.N == 5
    assert notes(capsys.readouterr().err) == []


def test_canonical_reads_a_saved_attribution_table_without_typing_it():
    """What ``experiment calibration --reread`` reads of a saved run (seed, name_uncalibrated)."""
    saved = json.loads((DATA / "config-flat-demo.json").read_text())["attribution"]
    with config_module.quiet_aliases():
        att = canonical(AttributionConfig, saved)
    assert att["seed"] == 0 and att["calibrated"]["name_uncalibrated"] is False
    assert att["paper"]["threshold"] == 3.5 and att["protocol"]["mode"] == "hardened"


def test_the_reference_lists_the_old_names():
    page = (Path(__file__).parents[1] / "docs" / "reference" / "configuration.md").read_text()
    assert "| `attribution.gamma` | `attribution.paper.threshold` |" in page
    assert "| `watermark.teacher_batch` | `watermark.teacher.batch` |" in page
    assert "#### `[attribution.protocol]`" in page and "#### `[watermark.kgw]`" in page
