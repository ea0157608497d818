"""``scripts/gpu-smollm2.sh``, the one-command SmolLM2 run for a lent GPU, kept working on the
CPU: the same script on the embedded default's micro model (``FEDATTR_PRESET=tiny``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import small_overrides as _small

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_script_runs_r3_and_r0_side_by_side_to_their_verdicts(tiny_cache, tmp_path):
    out = tmp_path / "gpu"
    args = [a for s in _small(tiny_cache, "attribution.null_keys=0") for a in ("--set", s)]
    env = {
        **os.environ,
        "FEDATTR_PRESET": "tiny",
        "FEDATTR_THREADS": "1",
        "PYTHON": sys.executable,
    }
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-smollm2.sh"), str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr + (out / "r3.log").read_text()
    for r in (3, 0):
        res = json.loads((out / f"r{r}" / "results.json").read_text())
        assert sum(c["watermarked"] for c in res["clients"]) == r
        assert set(res["variants"]) == {"ceiling"}
    summary = (out / "summary.md").read_text()
    assert "| r = 3 | yes |" in summary and "| r = 0 | yes |" in summary
    bad = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-smollm2.sh"), str(tmp_path / "x")],
        env={**env, "FEDATTR_PRESET": "smollm2", "FEDATTR_DATA": "/no/such.json"},
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and bad.stderr.strip().startswith("FEDATTR_DATA: no such file")
