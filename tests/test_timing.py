"""Seconds, peak memory per stage and FedAttr's overhead (fl/timing.py)."""

from __future__ import annotations

import numpy as np
import pytest

from fedattr.experiments.bench import format_pipeline, pipeline_figures
from fedattr.fl.timing import Stopwatch, overhead
from fedattr.runtime import PeakMemory

MB = 1e6


def _touch(nbytes: int) -> np.ndarray:
    a = np.ones(nbytes // 8)  # written, so resident
    return a


@pytest.mark.skipif(not PeakMemory().resettable, reason="needs a resettable peak (Linux)")
def test_peaks_per_stage_nested_and_after():
    watch = Stopwatch(())
    with watch.measure("outer_s"), watch.measure("inner_s"):
        big = _touch(300 * int(MB))
        del big
    with watch.measure("after_s"):
        small = _touch(1 * int(MB))
        del small
    peaks = watch.peaks
    # The 300 MB sits in the inner stage and, through it, in the outer one; the stage after
    # both starts from a reset mark, so it does not inherit it.
    assert peaks["inner_s"] > peaks["after_s"] + 0.25
    assert peaks["outer_s"] >= peaks["inner_s"]
    assert set(watch.seconds) == {"outer_s", "inner_s", "after_s"}


def test_peaks_carried_across_a_resume():
    first = Stopwatch(())
    first.peaks.update(train_s=2.0, sa_s=0.5)
    state = first.state()
    second = Stopwatch(())
    second.peaks["train_s"] = 1.0
    second.load(state)
    assert second.peaks == {"train_s": 2.0, "sa_s": 0.5}
    # A checkpoint written before peaks were kept still loads.
    old = {k: v for k, v in state.items() if k != "peaks"}
    Stopwatch(()).load(old)


class _FakeDevice:
    """A CUDA device's probe as the stopwatch reads it: peaks and utilisation it is told."""

    def __init__(self, device) -> None:
        self.peak, self.utilisation, self.resets, self.closed = 0.0, 0.5, 0, False

    def peak_gb(self):
        return self.peak

    def reset(self):
        self.resets += 1
        self.peak = 0.0

    def busy(self, since):
        return self.utilisation

    def close(self):
        self.closed = True


def test_a_cuda_runs_profile_has_each_stages_device_memory_and_utilisation(monkeypatch):
    import types

    import fedattr.fl.timing as timing

    monkeypatch.setattr(timing, "DeviceProbe", _FakeDevice)
    watch = Stopwatch(("train_s",), device=types.SimpleNamespace(type="cuda", index=0))
    probe = watch._device
    with watch.measure("train_s"):
        probe.peak, probe.utilisation = 3.0, 0.9
    with watch.measure("scoring_s"):
        probe.peak, probe.utilisation = 1.5, 0.2
    profile = watch.profile()
    assert profile["train"]["device_peak_gb"] == 3.0 and profile["scoring"]["device_peak_gb"] == 1.5
    assert profile["train"]["device_busy"] == pytest.approx(0.9)
    assert profile["scoring"]["device_busy"] == pytest.approx(0.2)
    assert profile["train"]["seconds"] == watch.seconds["train_s"]
    # Carried across a resume: peaks kept, busy time added.
    again = Stopwatch((), device=types.SimpleNamespace(type="cuda", index=0))
    again.load(watch.state())
    assert again.profile()["train"]["device_busy"] == pytest.approx(0.9)
    watch.close()
    assert probe.closed
    # A CPU run: seconds and resident memory only.
    cpu = Stopwatch(("train_s",)).profile()["train"]
    assert set(cpu) == {"seconds", "peak_rss_gb"}


def test_the_report_shows_the_device_columns_of_a_cuda_run():
    from fedattr.reporting.markdown import stages_table

    timing = {
        "train_s": 10.0,
        "total_s": 12.0,
        "overhead": 0.1,
        "stages": {"train": {"seconds": 10.0, "device_peak_gb": 4.25, "device_busy": 0.37}},
    }
    text = stages_table(timing, {"train": 1.5})
    assert "| device peak GB | device busy |" in text
    assert "| train_s | 10.0 | 1.50 | 4.25 | 37% |" in text
    assert "stages" not in text
    assert "device" not in stages_table({"train_s": 1.0, "stages": {"train": {"seconds": 1.0}}})


def test_overhead_counts_the_verdict():
    seconds = {"train_s": 100.0, "sa_s": 2.0, "scoring_s": 5.0, "verdict_s": 1.0, "load_s": 9.0}
    assert overhead(seconds) == pytest.approx(0.08)
    assert overhead({"train_s": 10.0, "sa_s": 1.0, "scoring_s": 1.0}) == pytest.approx(0.2)


def test_pipeline_figures_show_each_stage_peak():
    results = {
        "timing": {
            "load_s": 1.0,
            "teacher_s": 2.0,
            "train_s": 50.0,
            "sa_s": 1.0,
            "scoring_s": 3.0,
            "verdict_s": 0.5,
            "baselines_s": 4.0,
            "overhead": 0.09,
            "total_s": 62.0,
        },
        "work": {"train_tokens": 1000.0, "models_scored": 11.0, "teacher_documents": 5.0},
        "model": {"parameters": 10, "device": "cpu"},
        "sa_queries": 101,
        "memory_gb": {"load": 0.4, "train": 0.6, "verdict": 1.3, "baselines": 0.7},
    }
    fig = pipeline_figures(results)
    assert fig["stages"]["training"]["peak_gb"] == 0.6
    assert fig["stages"]["verdict"] == {"seconds": 0.5, "peak_gb": 1.3}
    assert fig["stages"]["baselines"] == {"seconds": 4.0, "peak_gb": 0.7}
    text = format_pipeline(fig)
    assert "| verdict (exact tails, rank check) | 0.5 |  |  | 1.30 |" in text
    assert "| baselines | 4.0 |  |  | 0.70 |" in text
    assert "| SA queries | 1.0 | 101 queries | 9.9 ms/query | – |" in text


def test_pipeline_figures_of_a_cuda_run_show_the_device():
    stages = {
        "train": {"seconds": 50.0, "peak_rss_gb": 2.0, "device_peak_gb": 12.5, "device_busy": 0.8},
        "scoring": {"seconds": 3.0, "peak_rss_gb": 2.1, "device_peak_gb": 4.0, "device_busy": None},
    }
    timing = {"load_s": 1.0, "teacher_s": 2.0, "train_s": 50.0, "sa_s": 1.0, "scoring_s": 3.0}
    timing.update(verdict_s=0.5, overhead=0.09, total_s=58.0, stages=stages)
    fig = pipeline_figures(
        {"timing": timing, "model": {"parameters": 10, "device": "cuda:0", "gpu": "H200"}}
    )
    assert fig["stages"]["training"]["device_busy"] == 0.8
    text = format_pipeline(fig)
    assert "| device peak GB | device busy |" in text
    assert "| 12.50 | 80% |" in text and "| 4.00 | – |" in text


def test_without_pynvml_the_device_is_read_from_one_streaming_nvidia_smi(tmp_path, monkeypatch):
    import time
    import types

    import torch

    from fedattr.fl.timing import DeviceProbe

    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        '#!/usr/bin/env bash\necho "$@" > "$(dirname "$0")/args"\n'
        'while true; do echo 40; echo "[N/A]"; echo 60; sleep 0.02; done\n'
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")

    def no_pynvml(index):
        raise ModuleNotFoundError("pynvml")

    monkeypatch.setattr(torch.cuda, "utilization", no_pynvml)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid="abc-1")
    )
    probe = DeviceProbe(types.SimpleNamespace(type="cuda", index=0))
    since = time.perf_counter()
    deadline = since + 30
    while len(probe.samples) < 4 and time.perf_counter() < deadline:
        time.sleep(0.05)
    assert probe.readable and probe.busy(since) == pytest.approx(0.5)
    probe.close()
    assert probe._smi.poll() is not None  # the stream is stopped
    args = (tmp_path / "args").read_text().split()
    assert "GPU-abc-1" in args and "-lms=250" in args
