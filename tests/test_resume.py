import json
import subprocess
import sys
import time

import pytest
import torch

from conftest import small_overrides as _small
from fedattr.cli import main


def _args(sets):
    return [a for s in sets for a in ("--set", s)]


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_results(tiny_cache, tmp_path, capsys):
    sets = _small(tiny_cache, "fl.rounds=4", "attribution.protocol.M=3")
    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedattr", "run", "--out", str(killed), *_args(sets)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ckpt = killed / "checkpoint" / "state.pt"
    deadline = time.time() + 300
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.kill()  # SIGKILL: no clean-up of any kind
    proc.wait()
    assert ckpt.exists() and not (killed / "results.json").exists()
    saved = torch.load(ckpt, weights_only=False)
    done = saved["round"]
    assert 1 <= done < 4
    # The checkpoint holds each client's summed change; one written by an earlier fedattr's
    # statistic (sums over random keys) is refused in one line and kept.
    calibrated = saved["observers"]["fedattr"]["fedattr"]["calibrated"]
    assert calibrated["format"] == 2 and calibrated["W"]
    calibrated["format"] = 1
    torch.save(saved, ckpt)
    capsys.readouterr()
    assert main(["run", "--resume", str(killed)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "earlier fedattr" in err[-1] and "start the run over" in err[-1]
    assert torch.load(ckpt, weights_only=False)["round"] == done
    calibrated["format"] = 2
    torch.save(saved, ckpt)
    # The teacher's documents were kept beside the checkpoint: the resume restores them.
    assert (killed / "checkpoint" / "teacher-documents.json").is_file()
    assert main(["run", "--resume", str(killed)]) == 0
    err = capsys.readouterr().err
    assert "restored from the run folder" in err and "teacher: watermarking" not in err
    assert not (killed / "checkpoint").exists()

    whole = tmp_path / "whole"
    assert main(["run", "--out", str(whole), *_args(sets)]) == 0
    a = json.loads((killed / "results.json").read_text())
    b = json.loads((whole / "results.json").read_text())
    for key in ("tpr", "fpr", "flagged", "clients", "sa_queries", "federation", "by_statistic"):
        assert a[key] == b[key], key
    # The teacher's documents are counted once (issue 54: 232 against 116 on a resume).
    assert a["work"]["teacher_documents"] == b["work"]["teacher_documents"] > 0
    assert _query_log(killed) == _query_log(whole)


def _query_log(run_dir):
    lines = (run_dir / "queries.jsonl").read_text().splitlines()
    return [(q["round"], q["subset"], q["coefficients"]) for q in map(json.loads, lines)]


def test_resume_refuses_what_it_cannot_do(tiny_cache, tmp_path, capsys):
    assert main(["run", "--resume", str(tmp_path)]) == 2
    assert "holds no fedattr run to resume" in capsys.readouterr().err
    assert main(["run", "--resume", str(tmp_path), "--set", "fl.K=5"]) == 2
    assert "drop --config/--set/--out" in capsys.readouterr().err


def test_continue_keeps_or_continues_only_a_run_of_the_same_configuration(
    tiny_cache, tmp_path, capsys
):
    assert main(["run", "--continue"]) == 2
    assert "--continue: give --out" in capsys.readouterr().err
    out = tmp_path / "run"
    sets = _args(_small(tiny_cache, "fl.rounds=1"))
    assert main(["run", "--out", str(out), "--continue", *sets]) == 0  # a new folder: a new run
    stamp = (out / "results.json").stat().st_mtime_ns
    capsys.readouterr()
    assert main(["run", "--out", str(out), "--continue", *sets]) == 0
    assert "a finished run of this configuration, kept" in capsys.readouterr().out
    assert (out / "results.json").stat().st_mtime_ns == stamp
    assert main(["run", "--out", str(out), "--continue", *sets, "--set", "fl.seed=9"]) == 2
    assert "holds a run with another configuration" in capsys.readouterr().err
    assert main(["run", "--out", str(out), *sets]) == 2  # without --continue: refused
    assert "holds a finished run" in capsys.readouterr().err
