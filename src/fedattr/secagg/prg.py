"""Cryptographic pseudo-random generators that expand a 32-byte seed into ring elements.

A keystream of a stream cipher under a fresh key is indistinguishable from uniform bytes, and
uniform bytes read as ``b``-bit integers are uniform in ``Z_{2^b}``: exactly what one-time
masks in the ring need. Each seed is used for one expansion only (keys are derived per query),
so a fixed all-zero nonce is safe.

:func:`masks` hands the ring elements to the secure-aggregation backends as torch tensors on
the update's device: on the CPU from OpenSSL (through ``cryptography``), elsewhere from the
torch ChaCha20 of :mod:`.chacha20`, which is bit-exact with it, so a mask does not depend on
where it was computed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from .chacha20 import keystream
from .errors import SecAggError

PRG_NAMES = ("aes-ctr", "chacha20")
_ZERO_NONCE = bytes(16)
_CHUNK = 1 << 24  # bytes encrypted per call: bounds the zero buffer's memory
# Bytes of keystream applied per step by :func:`masked` on the CPU: small enough that no mask
# is ever held whole (a 59 MB mask written and read back cost more than the cipher), large
# enough that a small update is a few steps (each step is Python calls that contend for the GIL
# with the other members' threads: 1 MB slices instead of 256 KB took a 131,072-coordinate
# query from 7.2 to 5.5 ms on 2 cores, the same at 7.4M coordinates).
_APPLY_CHUNK = 1 << 20


def _cipher(name: str, seed: bytes) -> Cipher:
    if name == "aes-ctr":
        return Cipher(algorithms.AES(seed), modes.CTR(_ZERO_NONCE))
    if name == "chacha20":
        return Cipher(algorithms.ChaCha20(seed, _ZERO_NONCE), mode=None)
    raise SecAggError(f"prg: unknown generator {name!r}; allowed: {', '.join(PRG_NAMES)}")


def expand(seed: bytes, count: int, dtype: type[np.integer], prg: str = "chacha20") -> np.ndarray:
    """``count`` uniform ring elements of ``dtype`` from the keystream of ``prg`` under ``seed``."""
    if len(seed) != 32:
        raise SecAggError(f"prg seed must be 32 bytes, got {len(seed)}")
    nbytes = count * np.dtype(dtype).itemsize
    out = np.empty(nbytes + 15, dtype=np.uint8)  # update_into needs block_size - 1 spare bytes
    enc = _cipher(prg, seed).encryptor()
    zeros = _zeros(min(nbytes, _CHUNK))
    done = 0
    while done < nbytes:
        step = min(_CHUNK, nbytes - done)
        enc.update_into(zeros[:step], out[done : done + step + 15])  # type: ignore[arg-type]
        done += step
    return out[:nbytes].view(dtype)


_NUMPY_RING: dict[torch.dtype, type[np.integer]] = {torch.int32: np.int32, torch.int64: np.int64}


def masked(
    base: torch.Tensor,
    coefficient: int,
    seeds: Sequence[bytes],
    signs: Sequence[int],
    prg: str,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ring vector ``coefficient * base + sum(sign * mask)``, with the masks of
    :func:`masks` (sign +1 adds a seed's mask, -1 subtracts it; wrapping ring arithmetic),
    written into ``out`` when given (a spare buffer of ``base``'s shape: a fresh one costs
    page faults comparable to the cipher itself) or a new tensor.

    On the CPU the scaling and the keystreams are applied a cache-sized slice at a time, so no
    mask is ever held whole and each slice of the result is written once (the cost is the
    cipher alone, not memory traffic); elsewhere one batched keystream.
    """
    if len(seeds) != len(signs) or any(s not in (1, -1) for s in signs):
        raise SecAggError(f"masked: one sign in (1, -1) per seed, got {list(signs)}")
    if out is not None and (
        out.shape != base.shape
        or out.dtype != base.dtype
        or out.device != base.device
        or not out.is_contiguous()
    ):
        raise SecAggError("masked: out must be a contiguous tensor like base")
    if base.device.type != "cpu" or not _OPENSSL_ON_CPU:
        y = torch.mul(base, coefficient, out=out) if out is not None else base * coefficient
        for sign, m in zip(signs, masks(seeds, y.numel(), y.dtype, prg, y.device), strict=True):
            y.add_(m, alpha=sign)
        return y
    np_dtype = _NUMPY_RING[base.dtype]
    source = base.contiguous().numpy()
    y = torch.empty_like(base, memory_format=torch.contiguous_format) if out is None else out
    ring = y.numpy()  # a view: numpy's integer arithmetic wraps modulo 2^b like the ring
    scale = np.array(coefficient).astype(np_dtype)  # the coefficient's residue in the ring
    step = _APPLY_CHUNK // ring.itemsize
    zeros, buffer = _scratch(step * ring.itemsize)
    mask = buffer[: step * ring.itemsize].view(np_dtype)
    encryptors = []
    for seed in seeds:
        if len(seed) != 32:
            raise SecAggError(f"prg seed must be 32 bytes, got {len(seed)}")
        encryptors.append(_cipher(prg, seed).encryptor())
    for start in range(0, ring.size, step):
        part = ring[start : start + step]
        np.multiply(source[start : start + step], scale, out=part)
        nbytes = part.size * ring.itemsize
        for sign, enc in zip(signs, encryptors, strict=True):
            # One encryptor per seed continues its keystream across slices: the bytes are
            # those :func:`expand` would give for the whole vector.
            enc.update_into(zeros[:nbytes], buffer[: nbytes + 15])  # type: ignore[arg-type]
            (np.add if sign > 0 else np.subtract)(part, mask[: part.size], out=part)
    return y


_ZEROS = np.zeros(0, dtype=np.uint8)  # read-only plaintext of the keystream, shared by threads
_THREAD = threading.local()  # each thread's keystream buffer


def _zeros(nbytes: int) -> np.ndarray:
    """``nbytes`` zero bytes (the plaintext a keystream is read from), one buffer kept for
    every caller: a fresh megabyte is pages the kernel maps and zeroes on first touch."""
    global _ZEROS
    if _ZEROS.size < nbytes:
        _ZEROS = np.zeros(nbytes, dtype=np.uint8)
    return _ZEROS[:nbytes]


def _scratch(nbytes: int) -> tuple[np.ndarray, np.ndarray]:
    """``nbytes`` zero bytes and a keystream buffer of ``nbytes + 15`` (this thread's), kept
    between calls: fresh ones cost half as much as the cipher on a small update (1.9 -> 1.1
    ms for five 131,072-coordinate masks)."""
    buffer = getattr(_THREAD, "buffer", None)
    if buffer is None or buffer.size < nbytes + 15:
        buffer = _THREAD.buffer = np.empty(nbytes + 15, dtype=np.uint8)
    return _zeros(nbytes), buffer


_OPENSSL_ON_CPU = True  # tests switch it off to run the device code path on the CPU


def masks(
    seeds: Sequence[bytes], count: int, dtype: torch.dtype, prg: str, device: torch.device
) -> Iterable[torch.Tensor]:
    """One vector of ``count`` uniform ring elements (``dtype``) per seed, on ``device``.

    On the CPU they are produced one at a time as they are consumed (a member holds one mask,
    not ``|W| - 1``); elsewhere all in one batched keystream."""
    device = torch.device(device)
    if device.type == "cpu" and _OPENSSL_ON_CPU:
        np_dtype = _NUMPY_RING[dtype]
        return (torch.from_numpy(expand(s, count, np_dtype, prg)) for s in seeds)
    if prg != "chacha20":
        raise SecAggError(
            f"secagg.prg={prg} runs on the CPU only; allowed with secagg.device={device}: chacha20"
        )
    if not seeds:
        return []
    stream = keystream(seeds, count * torch.empty((), dtype=dtype).element_size(), device)
    return list(stream.view(dtype))
