"""A calibration's worker processes leave with it: stopped by ``kill`` (which, unlike Ctrl-C,
reaches only the calibration), its workers must not go on training for minutes."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = """
import os, time
from fedattr.experiments.calibration import _pool

if __name__ == "__main__":
    pool = _pool(1)
    print(pool.submit(os.getpid).result(), flush=True)
    pool.submit(time.sleep, 120)  # a long run in progress
    time.sleep(120)
"""


def _alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        state = next(line for line in status.read_text().splitlines() if line.startswith("State"))
    except FileNotFoundError:
        return False
    return "Z" not in state.split()[1]  # a zombie has exited; only its reaper is late


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_calibration_takes_its_workers_with_it(tmp_path):
    script = tmp_path / "calibrate.py"
    script.write_text(SCRIPT)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    worker = None
    try:
        worker = int(parent.stdout.readline())
        time.sleep(1.0)  # the long task is running
        assert _alive(worker)
        os.kill(parent.pid, signal.SIGTERM)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 20
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(worker)
    finally:
        parent.kill()
        parent.stdout.close()
        if worker is not None and _alive(worker):  # a failed run leaves no sleeper behind
            os.kill(worker, signal.SIGKILL)
