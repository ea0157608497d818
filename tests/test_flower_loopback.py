"""Integration: a real Flower federation on 127.0.0.1 (SuperLink + one SuperNode per client as
separate processes, ``flwr run``) reaches the same per-client Z as the in-process engine, and
every process it started is stopped."""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="the Flower extra is not installed (pip install '.[flower]')")
if shutil.which("flower-superlink", path=str(Path(sys.executable).parent)) is None:
    pytest.skip("flower-superlink is not installed next to this Python", allow_module_level=True)

from conftest import sealed_overrides
from conftest import small_overrides as _small
from fedattr.config import load, to_dict
from fedattr.flower.launch import LoopbackFederation, run_loopback
from fedattr.pipeline.config import DemoConfig, RunConfig
from fedattr.pipeline.run import run_demo, run_experiment
from fedattr.reporting.run_folder import RunFolder

pytestmark = pytest.mark.flower


def _processes_using(path: Path) -> list[int]:
    """Processes whose environment names ``path`` (the federation's FLWR_HOME)."""
    needle = f"FLWR_HOME={path}".encode()
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes():
                    stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                    if stat != "Z":
                        out.append(int(entry.name))
            except OSError:
                continue
    return out


def _z(clients):
    return {int(c["id"]): (round(c["Z"], 9), c["flagged"]) for c in clients}


def _run(tmp_path, command, cfg):
    folder = RunFolder(tmp_path / "run")
    folder.claim(to_dict(cfg))
    data = run_loopback(command, cfg, folder, timeout=900, message_timeout=300)
    assert _processes_using(folder.path / "flower" / "flwr-home") == []
    return data


def test_synthetic_federation_on_flower_processes(tmp_path):
    cfg = load(
        DemoConfig,
        None,
        [
            "synthetic.K=4",
            "synthetic.rounds=1",
            "synthetic.dim=64",
            "synthetic.r=1",
            "attribution.protocol.N=2",
            "attribution.protocol.M=2",
            "secagg.min_members=2",
        ],
    )
    data = _run(tmp_path, "demo", cfg)
    local = run_demo(cfg)
    assert _z(data["clients"]) == _z([c.to_dict() for c in local.report.clients])
    assert data["runtime"]["loopback"]["status"] == "finished:completed"
    assert (tmp_path / "run" / "report.md").is_file()


def _in_process(cfg):
    """``cfg`` run in this process with one thread, as every process of the federation
    (``FEDATTR_THREADS=1``)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_experiment(cfg)
    finally:
        torch.set_num_threads(threads)


def test_tiny_llm_federation_on_flower_processes(tiny_cache, tmp_path):
    # Flower's clients train one after another: so does the in-process reference.
    cfg = load(RunConfig, None, _small(tiny_cache, "fl.rounds=1", "fl.batched=false"))
    data = _run(tmp_path, "run", cfg)
    local = _in_process(cfg)
    assert _z(data["clients"]) == _z([c.to_dict() for c in local.report.clients])
    assert data["runtime"]["nodes"].keys() == {"0", "1", "2", "3"}


def test_the_federation_stops_every_process_it_started(tmp_path):
    fed = LoopbackFederation(2, tmp_path / "fed")
    with fed:
        started = _processes_using(fed.home)
        assert len(started) >= 3  # SuperLink (+ its superexec) and two SuperNodes
    assert _processes_using(fed.home) == []


def test_flower_local_refuses_what_it_cannot_run_before_starting_a_process(
    tmp_path, monkeypatch, capsys
):
    import torch

    from fedattr.cli import main

    def no_process(self):
        raise AssertionError("a process was started before the settings were checked")

    monkeypatch.setattr(LoopbackFederation, "start", no_process)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "one.json").write_text('[{"instruction": "a", "output": "b"}]')
    for args, message in [
        (["--set", "baselines=true"], "baselines: they read plaintext client updates"),
        (["--demo", "--set", "secagg.backend=plaintext"], "secagg.backend: on Flower"),
        (["--set", "data.path=one.json"], "data.path: 'one.json' holds 1 usable record"),
        (["--timeout", "0"], "--timeout: must be > 0 seconds"),
        # The loopback nodes run here: a device this machine lacks is refused before them.
        (["--demo", "--set", "secagg.device=cuda"], "secagg.device=cuda: torch sees no CUDA"),
        (["--set", "secagg.device=cuda"], "secagg.device=cuda: torch sees no CUDA"),
    ]:
        for out in ([], ["--out", "d1"]):
            assert main(["flower", "local", *args, *out]) == 2
            err = capsys.readouterr().err
            assert message in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.json"]  # no runs/, no d1/


def test_a_sealed_run_on_flower_processes_every_party_its_own(tiny_cache, tmp_path):
    import numpy as np

    # Four clients, two share servers and two owners: eight SuperNode processes.
    cfg = load(RunConfig, None, sealed_overrides(tiny_cache, "fl.rounds=1", "fl.batched=false"))
    data = _run(tmp_path, "run", cfg)
    local = _in_process(cfg)
    # Fresh masks each run: the owners' values agree up to the shares' float32 rounding.
    assert [c["flagged"] for c in data["clients"]] == [c.flagged for c in local.report.clients]
    np.testing.assert_allclose(
        [c["Z"] for c in data["clients"]], [c.Z for c in local.report.clients], atol=5e-3
    )
    assert data["sealed"]["share_reads"] == 2 * cfg.fl.K
    assert data["runtime"]["nodes"].keys() == {"0", "1", "2", "3"}
    for s in "AB":
        assert (tmp_path / "run" / "flower" / f"server-{s}" / "sums-round1.pt").is_file()
    # Every party ran with its own key file and the deployment directory that pins the others'.
    keys = tmp_path / "run" / "flower" / "keys"
    pinned = json.loads((keys / "directory.json").read_text())
    assert set(pinned["clients"]) == {"0", "1", "2", "3"} and set(pinned["owners"]) == {"0", "1"}
    assert all((keys / f"{p}.key").stat().st_mode & 0o077 == 0 for p in ("server-A", "client-0"))
