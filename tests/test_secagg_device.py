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
    sa = make_aggregator(SecAggConfig(backend, min_members=2, ring_bits=bits, frac_bits=frac,
                                      clip=8.0, device="cpu"))  # fmt: skip
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
    assert SecAggConfig(device="auto").torch_device().type in ("cpu", "cuda")
    if not torch.cuda.is_available():
        with pytest.raises(SecAggError, match="no CUDA device"):
            SecAggConfig(device="cuda")
    else:
        with pytest.raises(SecAggError, match="allowed: chacha20"):
            SecAggConfig(device="cuda", prg="aes-ctr")
