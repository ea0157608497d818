"""The GPU scripts kept working on the CPU, on the embedded default's micro model
(``FEDATTR_PRESET=tiny``): ``scripts/gpu-smollm2.sh`` (r = 3 and r = 0 side by side; a cut run
resumes with the same command) and ``scripts/gpu-calibration.sh`` (pairs until a budget; the
same command keeps what is done)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import small_overrides as _small

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra):
    return {
        **os.environ,
        "FEDATTR_PRESET": "tiny",
        "FEDATTR_THREADS": "1",
        "PYTHON": sys.executable,
        **extra,
    }


def _script(name, *args, env, timeout=600):
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / name), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` (``timeout`` puts its command in a process
    group of its own, so killing the script's group would leave the runs going)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # the session id, after state, ppid and pgrp
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(stat.parent.name), signal.SIGKILL)


def test_the_gpu_script_runs_r3_and_r0_side_by_side_and_resumes_a_cut_run(tiny_cache, tmp_path):
    out = tmp_path / "gpu"
    args = [
        a for s in _small(tiny_cache, "attribution.calibrated.null_keys=0") for a in ("--set", s)
    ]
    command = ["bash", str(ROOT / "scripts" / "gpu-smollm2.sh"), str(out), *args]
    env = _env()
    # Cut: the whole command killed (as a lost machine would be) once a run has a checkpoint.
    proc = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    checkpoints = [out / f"r{r}" / "checkpoint" / "state.pt" for r in (3, 0)]
    deadline = time.time() + 300
    while not any(c.exists() for c in checkpoints) and proc.poll() is None:
        assert time.time() < deadline
        time.sleep(0.01)
    _kill_session(proc.pid)
    proc.wait()
    cut = [r for r, c in zip((3, 0), checkpoints, strict=True) if c.exists()]
    assert cut and not (out / f"r{cut[0]}" / "results.json").exists()
    # The same command again: the cut run continues after its last round.
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr + (out / "r3.log").read_text()
    log = (out / f"r{cut[0]}.log").read_text()
    assert "continuing its unfinished run" in log and "resuming after round 1" in log
    for r in (3, 0):
        res = json.loads((out / f"r{r}" / "results.json").read_text())
        assert sum(c["watermarked"] for c in res["clients"]) == r
        assert set(res["variants"]) == {"ceiling"}
    summary = (out / "summary.md").read_text()
    assert "| r = 3 | yes |" in summary and "| r = 0 | yes |" in summary
    # Once more: both finished runs are kept, not run again.
    stamp = (out / "r3" / "results.json").stat().st_mtime_ns
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert (
        again.returncode == 0
        and "finished run of this configuration, kept" in (out / "r0.log").read_text()
    )
    assert (out / "r3" / "results.json").stat().st_mtime_ns == stamp
    bad = _script(
        "gpu-smollm2.sh",
        str(tmp_path / "x"),
        env={**env, "FEDATTR_PRESET": "smollm2", "FEDATTR_DATA": "/no/such.json"},
    )
    assert bad.returncode == 2 and bad.stderr.strip().startswith("FEDATTR_DATA: no such file")


def test_the_calibration_script_runs_pairs_within_its_budget_and_keeps_them(tiny_cache, tmp_path):
    out = tmp_path / "cal"
    args = [a for s in _small(tiny_cache) for a in ("--set", s)]
    first = _script("gpu-calibration.sh", str(out), "3", *args, env=_env(FEDATTR_BUDGET="900"))
    assert first.returncode == 0, first.stdout + first.stderr
    for r in (3, 0):
        run = out / f"r{r}-seed3"
        assert (run / "config.json").is_file() and (run / "results.json").is_file()
        cfg = json.loads((run / "config.json").read_text())
        assert cfg["fl"]["seed"] == 3 and cfg["watermark"]["key_seed"] == 3
        assert cfg["watermark"]["r"] == r
    (pair,) = [json.loads(line) for line in (out / "pairs.jsonl").read_text().splitlines()]
    assert pair["seed"] == 3 and pair["seconds"] > 0
    cal = json.loads((out / "calibration.json").read_text())
    assert cal["pairs"] == 1 and cal["by_seed"][0]["r3"]["watermarked"]
    assert cal["runs_naming_a_wrong_pair"][1] == 2
    # The count is of runs whose results.json lists a wrong pair (here: the runs' own lists).
    lists = [
        json.loads((out / f"r{r}-seed3" / "results.json").read_text())["wrong_pairs"]
        for r in (3, 0)
    ]
    assert cal["runs_naming_a_wrong_pair"][0] == sum(bool(w) for w in lists)
    assert [cal["by_seed"][0][f"r{r}"]["wrong_pairs"] for r in (3, 0)] == lists
    assert "1 finished (r = 3, r = 0) pairs" in (out / "calibration.md").read_text()
    stamp = (out / "r3-seed3" / "results.json").stat().st_mtime_ns
    # Again with seed 4 added and less time left than a pair took: seed 3 kept, seed 4 not
    # started, and the command returns before its budget.
    budget = int(pair["seconds"]) + 5 - 1
    t0 = time.time()
    second = _script(
        "gpu-calibration.sh",
        str(out),
        "3-4",
        *args,
        env=_env(FEDATTR_BUDGET=str(budget), FEDATTR_MARGIN="5"),
    )
    assert second.returncode == 0, second.stdout + second.stderr
    assert time.time() - t0 < budget
    assert "stopping before seed 4" in second.stdout
    assert not (out / "r3-seed4").exists()
    assert (out / "r3-seed3" / "results.json").stat().st_mtime_ns == stamp
    assert json.loads((out / "calibration.json").read_text())["pairs"] == 1
    bad = _script("gpu-calibration.sh", str(out), "a-b", env=_env())
    assert bad.returncode == 2 and bad.stderr.startswith("SEEDS: seeds as 1-40 or 1,2,5")
