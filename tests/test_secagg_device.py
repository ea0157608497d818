"""The device code path of secure aggregation, run on the CPU: torch ChaCha20 and ring tensors."""

import os

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from fedattr.secagg import SecAggConfig, SecAggError, make_aggregator
from fedattr.secagg import prg as prg_module
from fedattr.secagg.chacha20 import keystream
from fedattr.secagg.prg import masks


def _openssl(key: bytes, n: int) -> bytes:
    return Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor().update(bytes(n))


def test_torch_chacha20_is_bit_exact_with_openssl():
    keys = [os.urandom(32) for _ in range(3)] + [bytes(32)]
    for n in (0, 1, 63, 64, 65, 1000, 3 * 4096 + 7):
        out = keystream(keys, n)
        assert out.shape == (len(keys), n) and out.dtype == torch.uint8
        for row, key in zip(out, keys, strict=True):
            assert bytes(row.numpy()) == _openssl(key, n)
    with pytest.raises(ValueError, match="32 bytes"):
        keystream([b"short"], 10)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_masks_are_the_same_bits_from_openssl_and_torch(monkeypatch, dtype):
    seeds = [bytes([i]) * 32 for i in range(3)]
    cpu = list(masks(seeds, 1001, dtype, "chacha20", torch.device("cpu")))
    monkeypatch.setattr(prg_module, "_OPENSSL_ON_CPU", False)
    dev = list(masks(seeds, 1001, dtype, "chacha20", torch.device("cpu")))
    assert all(a.dtype == dtype and torch.equal(a, b) for a, b in zip(cpu, dev, strict=True))
    with pytest.raises(SecAggError, match=r"allowed with secagg\.device=meta: chacha20"):
        masks(seeds, 10, dtype, "aes-ctr", torch.device("meta"))


@pytest.mark.parametrize("backend", ["pairwise-mask", "two-server"])
@pytest.mark.parametrize("ring", [(64, 32), (32, 16)])
def test_backends_on_the_device_path_answer_exactly(monkeypatch, backend, ring):
    monkeypatch.setattr(prg_module, "_OPENSSL_ON_CPU", False)
    bits, frac = ring
    gen = torch.Generator().manual_seed(3)
    ups = [torch.randn(300, generator=gen, dtype=torch.float64) for _ in range(5)]
    sa = make_aggregator(
        SecAggConfig(
            backend,
            min_members=2,
            ring_bits=bits,
            frac_bits=frac,
            clip=8.0,
            device="cpu",
            prg="chacha20",
        )
    )
    sa.open_round(0, range(5))
    for j, u in enumerate(ups):
        sa.submit(j, u)
    tol = 5 * 0.5 / 2**frac
    got = sa.subset_sum_flat([0, 2, 3])
    assert np.allclose(got, (ups[0] + ups[2] + ups[3]).numpy(), atol=tol, rtol=0)
    fused = sa.combination_flat({0: 2, 1: -1, 4: -1}, denominator=2)
    assert np.allclose(fused, ((2 * ups[0] - ups[1] - ups[4]) / 2).numpy(), atol=tol, rtol=0)


def test_device_setting_errors_name_the_allowed_values():
    with pytest.raises(SecAggError, match="allowed: cpu, cuda, cuda:N, auto"):
        SecAggConfig(device="tpu")
    with pytest.raises(SecAggError, match="allowed: chacha20, auto"):
        SecAggConfig(device="cuda", prg="aes-ctr")  # refused by syntax alone, on any machine
    assert SecAggConfig(device="auto").torch_device().type in ("cpu", "cuda")
    if not torch.cuda.is_available():
        with pytest.raises(SecAggError, match="no CUDA device"):
            SecAggConfig(device="cuda").torch_device()


def test_loading_a_gpu_config_never_probes_the_hardware(monkeypatch, tmp_path):
    # A config.json written on a GPU machine loads on a CPU one (an owner's run_config_of,
    # --resume, attribute); the device is checked when a run starts, in one line.
    import json

    from fedattr.config import from_dict, load
    from fedattr.pipeline.config import DemoConfig, RunConfig

    def probe():
        raise AssertionError("loading a configuration probed the hardware")

    monkeypatch.setattr(torch.cuda, "is_available", probe)
    monkeypatch.setattr(torch.cuda, "device_count", probe)
    settings = {"secagg": {"device": "cuda:1", "prg": "chacha20"}, "model": {"device": "cuda"}}
    cfg = from_dict(RunConfig, settings)
    assert cfg.secagg.device == "cuda:1" and cfg.model.device == "cuda"
    (tmp_path / "config.json").write_text(json.dumps({"secagg": {"device": "cuda"}}))
    assert load(DemoConfig, tmp_path / "config.json").secagg.device == "cuda"
    assert SecAggConfig(device="auto", prg="aes-ctr").device == "auto"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SecAggError, match=r"^secagg\.device=cuda: torch sees no CUDA device"):
        make_aggregator(SecAggConfig(backend="plaintext", device="cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SecAggError, match=r"secagg\.device=cuda:1: torch sees 1 CUDA device"):
        SecAggConfig(device="cuda:1").torch_device()
    # auto is a GPU here, which AES-CTR (CPU only) cannot mask on: refused when the run starts.
    with pytest.raises(SecAggError, match=r"secagg\.prg=aes-ctr runs on the CPU only"):
        SecAggConfig(device="auto", prg="aes-ctr").torch_device()


@pytest.mark.parametrize(
    ("command", "setting", "match"),
    [
        ("demo-protocol", "secagg.device=cuda", "secagg.device=cuda: torch sees no CUDA device"),
        ("run", "secagg.device=cuda", "secagg.device=cuda: torch sees no CUDA device"),
        ("run", "model.device=cuda", "model.device: cuda was requested"),
    ],
)
def test_a_run_on_a_missing_device_is_refused_in_one_line_before_any_folder(
    monkeypatch, tmp_path, capsys, command, setting, match
):
    from fedattr.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "runs" / "gpu"
    assert main([command, "--set", setting, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and "\n" not in err
    assert list(tmp_path.iterdir()) == []


def test_resuming_a_gpu_run_on_a_cpu_machine_is_refused_and_keeps_the_folder(
    monkeypatch, tmp_path, capsys
):
    from fedattr.cli import main
    from fedattr.config import from_dict, to_dict
    from fedattr.pipeline.config import RunConfig
    from fedattr.reporting.run_folder import RunFolder

    folder = RunFolder(tmp_path / "run")
    folder.claim(to_dict(from_dict(RunConfig, {"secagg": {"device": "cuda"}})))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["run", "--resume", str(folder.path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "secagg.device=cuda: torch sees no CUDA device" in err and "\n" not in err
    assert (folder.path / "config.json").is_file()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("openssl", [True, False])
def test_masked_upload_is_scaled_update_plus_signed_masks(monkeypatch, dtype, openssl):
    monkeypatch.setattr(prg_module, "_OPENSSL_ON_CPU", openssl)
    monkeypatch.setattr(prg_module, "_APPLY_CHUNK", 256)  # many slices, a ragged last one
    gen = torch.Generator().manual_seed(1)
    base = torch.randint(-(2**30), 2**30, (1001,), generator=gen, dtype=torch.int64).to(dtype)
    seeds = [bytes([i + 1]) * 32 for i in range(3)]
    signs = [1, -1, 1]
    for prg in ("chacha20", "aes-ctr") if openssl else ("chacha20",):
        whole = list(masks(seeds, base.numel(), dtype, prg, torch.device("cpu")))
        for coefficient in (1, -3):
            want = base * coefficient
            for sign, mask in zip(signs, whole, strict=True):
                want = want + sign * mask  # wrapping ring arithmetic
            assert torch.equal(prg_module.masked(base, coefficient, seeds, signs, prg), want)
            spare = torch.full_like(base, 7)  # stale contents must be overwritten
            got = prg_module.masked(base, coefficient, seeds, signs, prg, out=spare)
            assert got is spare and torch.equal(got, want)
    with pytest.raises(SecAggError, match="one sign in"):
        prg_module.masked(base, 1, seeds, [1, 0, 1], "chacha20")
    with pytest.raises(SecAggError, match="out must be"):
        prg_module.masked(base, 1, seeds, signs, "chacha20", out=base[:10].clone())


def test_concurrent_members_give_the_same_sum_and_reuse_buffers():
    gen = torch.Generator().manual_seed(4)
    ups = [torch.randn(5000, generator=gen, dtype=torch.float64) for _ in range(6)]
    answers = []
    for threads in (1, 3):
        torch_threads = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            sa = make_aggregator(SecAggConfig("pairwise-mask", min_members=2))
            sa.open_round(0, range(6))
            for j, u in enumerate(ups):
                sa.submit(j, u)
            answers.append([sa.subset_sum_flat(w) for w in ([0, 1, 2, 3, 4, 5], [1, 2, 5])])
            # Buffers come back after each query: the uploads in flight, the one being added
            # and the sum at most.
            assert 1 <= len(sa._spare) <= threads + 2
        finally:
            torch.set_num_threads(torch_threads)
    for a, b in zip(*answers, strict=True):
        assert np.array_equal(a, b)
    assert np.allclose(answers[0][1], (ups[1] + ups[2] + ups[5]).numpy(), atol=1e-8, rtol=0)


@pytest.mark.slow
def test_compiled_torch_chacha20_is_bit_exact_with_openssl():
    """The kernel a GPU runs by default is the torch.compile'd one; compiled here for the CPU
    (inductor, ~40 s on 2 cores), it must give OpenSSL's keystream too, for every length."""
    keys = [os.urandom(32) for _ in range(3)]
    for n in (1, 64, 1000, 70_000):
        out = keystream(keys, n, "cpu", compile=True)
        for row, key in zip(out, keys, strict=True):
            assert bytes(row.numpy()) == _openssl(key, n)


@pytest.mark.parametrize("ring", [(64, 32), (32, 16)])
def test_decode_on_the_cpu_equals_the_torch_decode(ring):
    from fedattr.secagg.fixedpoint import FixedPointCodec

    codec = FixedPointCodec(ring_bits=ring[0], frac_bits=ring[1], clip=8.0)
    gen = torch.Generator().manual_seed(2)
    values = torch.randint(-(2**62), 2**62, (1000,), generator=gen).to(codec.dtype)
    want = (values.to(torch.float64) / codec.scale).numpy()
    got = codec.decode(values)
    assert got.dtype == np.float64 and np.array_equal(got, want)
