"""What a new user hit on a fresh clone (issue 54, item 6): each bad input is one line naming
the parameter and what it takes (exit code 2), before any slow work, leaving nothing behind;
the labels a run prints are true. (The resumed run's teacher: ``test_resume.py``.)"""

import io
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from fedattr.cli import main
from fedattr.errors import UserError
from fedattr.watermarks.keys import generate_key, save_key

PROC = Path("/proc")
needs_proc = pytest.mark.skipif(
    not PROC.is_dir(), reason="needs /proc, a folder where no file can be created (Linux)"
)


def _one_line(capsys, *parts: str) -> str:
    """The one error line the last command wrote, holding every part."""
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fedattr: error: "), err
    for part in parts:
        assert part in err, err
    return err


def _no_model(monkeypatch):
    """Any model load fails the test: the input must be refused before it."""
    import fedattr.models.loading as loading

    def no_model(*_a, **_k):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(loading, "load_model", no_model)
    monkeypatch.setattr(loading, "load_tokenizer", no_model)


def _key(tmp_path) -> str:
    return str(save_key(generate_key(), tmp_path / "owner.key"))


def _corpus(tmp_path) -> str:
    path = tmp_path / "corpus.jsonl"
    path.write_text(json.dumps({"instruction": "Say hi", "input": "", "output": "hello"}) + "\n")
    return str(path)


# 1 --------------------------------------------------------------------------------------------
def test_flower_app_in_a_folder_that_cannot_be_made_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file where a folder should be")
    assert main(["flower", "app", str(blocker / "sub" / "app")]) == 2
    _one_line(capsys, f"app folder: {str(blocker)!r} is a file, not a folder")
    if PROC.is_dir():  # a folder that does not exist and cannot be made
        assert main(["flower", "app", "/proc/fedattr-app"]) == 2
        _one_line(capsys, "app folder: '/proc/fedattr-app' cannot be written")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # nothing left
    assert main(["flower", "app", str(tmp_path / "new" / "app")]) == 0
    assert (tmp_path / "new" / "app" / "pyproject.toml").is_file()


# 2 --------------------------------------------------------------------------------------------
@needs_proc
def test_watermark_out_in_a_folder_that_refuses_files_is_refused_before_the_model(
    tmp_path, monkeypatch, capsys
):
    import fedattr.errors

    _no_model(monkeypatch)
    # Permission bits that say yes, as they do to root everywhere: only creating a file tells.
    monkeypatch.setattr(fedattr.errors.os, "access", lambda *_a, **_k: True)
    args = ["owner", "watermark", "--key", _key(tmp_path), "--in", _corpus(tmp_path)]
    assert main([*args, "--out", "/proc/watermarked.jsonl"]) == 2
    _one_line(capsys, "--out: '/proc' cannot be written", "choose a folder you can write to")
    assert main([*args, "--out", str(tmp_path / "no" / "wm.jsonl")]) == 2
    _one_line(capsys, f"--out: folder {str(tmp_path / 'no')!r} does not exist")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "owner.key"]


# 3 --------------------------------------------------------------------------------------------
def test_owner_check_reads_stdin_that_is_not_utf8_as_it_reads_the_file(
    micro, tmp_path, monkeypatch, capsys
):
    data = "café au lait".encode("latin-1")
    (tmp_path / "latin1.txt").write_bytes(data)
    args = ["owner", "check", "--key", _key(tmp_path), "--model", str(micro[0])]
    assert main([*args, "--in", str(tmp_path / "latin1.txt")]) == 2
    by_path = _one_line(capsys, "is not UTF-8 text (invalid continuation byte at byte 3)")
    # Python's standard input as a C/POSIX locale opens it: bytes that are not UTF-8 come
    # through as lone surrogates, on which the tokenizer failed with a TypeError.
    stdin = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="surrogateescape")
    monkeypatch.setattr(sys, "stdin", stdin)
    assert main([*args, "--in", "-"]) == 2
    by_stdin = _one_line(capsys, "--in: <stdin> is not UTF-8 text")
    assert by_stdin.replace("<stdin>", "X") == by_path.replace(
        repr(str(tmp_path / "latin1.txt")), "X"
    )
    good = "une tasse de café".encode()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(good), encoding="utf-8"))
    assert main([*args, "--in", "-", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["documents"][0]["name"] == "<stdin>"


# 4 --------------------------------------------------------------------------------------------
def test_owner_scoring_with_the_paper_statistic_is_refused_with_the_settings(
    tmp_path, monkeypatch, capsys
):
    from fedattr.config import load
    from fedattr.pipeline.config import RunConfig

    sets = ["attribution.scoring=owner", "attribution.statistic=paper"]
    with pytest.raises(UserError, match=r"needs attribution\.statistic=calibrated"):
        load(RunConfig, None, sets)
    _no_model(monkeypatch)  # the teacher needs the model: refused before both
    out = tmp_path / "run"
    assert main(["run", "--out", str(out), *[a for s in sets for a in ("--set", s)]]) == 2
    _one_line(capsys, "attribution.scoring=owner: needs attribution.statistic=calibrated")
    assert not out.exists()


# 5 --------------------------------------------------------------------------------------------
def test_a_bad_jsonl_row_is_reported_on_its_own_line(tmp_path, monkeypatch, capsys):
    from fedattr.data.loaders import json_lines_values
    from fedattr.owner.check import read_documents
    from fedattr.owner.corpus import read_rows

    row = json.dumps({"instruction": "a", "output": "b"})
    path = tmp_path / "rows.jsonl"
    path.write_text(f"{row}\r\n\r\n{{'instruction': 'single quotes'}}\r\n{row}\r\n")
    with pytest.raises(UserError, match=r"line 3\)"):
        read_rows(path)
    with pytest.raises(UserError, match=r"line 3\)"):
        read_documents(str(path))
    with pytest.raises(json.JSONDecodeError) as caught:
        json_lines_values(f"{row}\n{row}\n[1, oops]\n")
    assert (caught.value.lineno, caught.value.colno) == (3, 5)
    assert json_lines_values(f"{row}\n\n{row}\n") == [json.loads(row)] * 2
    _no_model(monkeypatch)
    args = ["owner", "watermark", "--key", _key(tmp_path), "--in", str(path)]
    assert main([*args, "--out", str(tmp_path / "wm.jsonl")]) == 2
    _one_line(capsys, "is not valid JSON Lines (Expecting property name enclosed", "line 3)")


# 6 --------------------------------------------------------------------------------------------
def test_a_descending_seed_range_says_it_is_empty_and_what_is_expected(tmp_path, capsys):
    out = str(tmp_path / "exp")
    assert main(["experiment", "main", "--seeds", "5-1", "--out", out]) == 2
    _one_line(capsys, "--seeds: the range '5-1' is empty (it runs down)", "FIRST <= LAST")
    assert main(["experiment", "main", "--seeds", ",", "--out", out]) == 2
    _one_line(capsys, "--seeds: none given", "e.g. 1,2,3 or 0-199")
    assert main(["experiment", "calibration", "--r", "3-0", "--out", out]) == 2
    _one_line(capsys, "--r: the range '3-0' is empty")
    assert not (tmp_path / "exp").exists()


# 7 --------------------------------------------------------------------------------------------
def test_detect_with_a_model_that_is_not_there_names_model(tmp_path, monkeypatch, capsys):
    _no_model(monkeypatch)
    missing = str(tmp_path / "nonexistent")
    assert main(["owner", "detect", "--key", _key(tmp_path), "--model", missing]) == 2
    err = _one_line(capsys, f"--model: {missing!r} does not exist")
    assert "--reference" not in err


# 8 --------------------------------------------------------------------------------------------
def test_a_txt_corpus_to_watermark_names_the_formats_taken(tmp_path, monkeypatch, capsys):
    _no_model(monkeypatch)
    text = tmp_path / "corpus.txt"
    text.write_text("A plain text, one document.\n")
    args = ["owner", "watermark", "--key", _key(tmp_path), "--in", str(text)]
    assert main([*args, "--out", str(tmp_path / "wm.jsonl")]) == 2
    _one_line(capsys, f"--in: {str(text)!r} is not valid JSON", ".jsonl file", ".json file")


# 9 --------------------------------------------------------------------------------------------
def test_audit_cross_round_without_json_prints_the_cross_round_audit(tmp_path, capsys):
    from fedattr.config import load
    from fedattr.pipeline.config import DemoConfig
    from fedattr.pipeline.run import run_demo

    cfg = load(DemoConfig, None, ["synthetic.dim=32", "synthetic.rounds=2"])
    run_demo(cfg, progress=lambda _m: None).write(tmp_path / "run")
    assert main(["audit", str(tmp_path / "run")]) == 0
    both = capsys.readouterr().out
    assert both.startswith("| round | session |") and "## Across rounds" in both
    assert main(["audit", str(tmp_path / "run"), "--cross-round"]) == 0
    alone = capsys.readouterr().out
    assert alone.startswith("## Across rounds") and "| round | session |" not in alone
    assert alone.strip() in both


# 10 -------------------------------------------------------------------------------------------
def test_bench_secagg_refuses_a_subset_of_one(capsys):
    assert main(["bench", "secagg", "--members", "1", "--dim", "8", "--repeats", "1"]) == 2
    _one_line(capsys, "--members: clients in the queried subset, must be >= 2", "got 1")


# 11 -------------------------------------------------------------------------------------------
def test_the_gguf_dequantising_bar_is_off_when_stderr_is_not_a_terminal(
    tmp_path, monkeypatch, capsys
):
    import transformers
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    import fedattr.models.loading as loading
    from fedattr.models.config import ModelConfig

    def from_pretrained(source, **kwargs):
        """What transformers does with a GGUF file: a tqdm bar over its tensors."""
        assert kwargs.get("gguf_file") == "model.gguf"
        for _ in gguf_utils.tqdm(range(5), desc="Converting and de-quantizing GGUF tensors..."):
            pass
        return SimpleNamespace(
            pad_token_id=0, to=lambda _device: None, eval=lambda: None, eos_token="</s>"
        )

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    # No cache can be written: the file is read as it is (the dequantising copy has its tests).
    monkeypatch.setattr(loading, "gguf_cache_roots", lambda _path: [])
    (tmp_path / "model.gguf").write_bytes(b"")
    cfg = ModelConfig(preset="hf", name_or_path=str(tmp_path / "model.gguf"), device="cpu")
    capsys.readouterr()
    loading.load_model(cfg)
    loading.load_tokenizer(cfg)
    assert "de-quantizing" not in capsys.readouterr().err  # captured: not a terminal
    assert gguf_utils.tqdm is not None and not hasattr(gguf_utils.tqdm, "func")  # restored
    monkeypatch.setattr(loading, "_is_terminal", lambda _stream: True)
    loading.load_model(cfg)  # on a terminal the bar stays: it shows a long load moving
    assert "de-quantizing" in capsys.readouterr().err


# 13 -------------------------------------------------------------------------------------------
def test_a_tail_that_is_an_upper_bound_is_labelled_one(tmp_path):
    from fedattr.attribution.calibrated.verdict import BOUNDS
    from fedattr.attribution.stouffer import AttributionReport, ClientAttribution
    from fedattr.reporting.markdown import UPPER_BOUNDS, attribution_table

    assert set(UPPER_BOUNDS) == set(BOUNDS)

    def client(i: int, tail: str) -> ClientAttribution:
        return ClientAttribution(
            id=i,
            z={1: 1.0},
            Z=1.0,
            p=0.5,
            log10_p=-0.3,
            flagged=False,
            watermarked=False,
            statistic="kgw:owner0",
            p_rank=0.5,
            tail=tail,
        )

    bounded = AttributionReport(
        4.0, [client(0, "chernoff"), client(1, "exact")], statistic="calibrated", alpha=0.01
    )
    text = attribution_table(bounded)
    assert "| chernoff (upper bound) |" in text and "| exact |" in text
    assert "or an upper bound on it, where the tail says so" in text
    exact = AttributionReport(4.0, [client(0, "exact")], statistic="calibrated", alpha=0.01)
    assert "upper bound" not in attribution_table(exact)
    pytest.importorskip("matplotlib", reason="the plots extra is not installed")
    from fedattr.reporting.plots import build_attribution_figure

    for report, label in ((bounded, "exact tail or its upper bound"), (exact, "(exact tail,")):
        fig = build_attribution_figure(report)
        try:
            assert label in fig.axes[1].get_ylabel()
        finally:
            import matplotlib.pyplot as plt

            plt.close(fig)


# 14 -------------------------------------------------------------------------------------------
def test_getting_started_shows_the_teacher_line_the_run_prints(monkeypatch):
    import fedattr.watermarks.registry as registry
    from fedattr.data.records import Record
    from fedattr.watermarks.config import WatermarkConfig

    monkeypatch.setattr(registry, "watermark_records", lambda *_a, **_k: [])
    said: list[str] = []
    shard = [Record("i", "o")] * 200
    registry.WATERMARKS["kgw"].documents(
        WatermarkConfig(), None, None, "kgw:owner0", None, 0, shard, 40, 0, said.append
    )
    page = (Path(__file__).parents[1] / "docs" / "getting-started.md").read_text()
    assert said == ["teacher: watermarking 40 of 200 client 0's documents (kgw:owner0)"]
    # on a terminal the line as said, piped with the elapsed time before it
    assert f"\n{said[0]}\n" in page
    assert re.search(r"\n\[\dm\d\ds\] " + re.escape(said[0]) + "\n", page)
