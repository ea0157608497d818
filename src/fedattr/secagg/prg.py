"""Cryptographic pseudo-random generators that expand a 32-byte seed into ring elements.

A keystream of a stream cipher under a fresh key is indistinguishable from uniform bytes, and
uniform bytes read as ``b``-bit integers are uniform in ``Z_{2^b}``: exactly what one-time
masks in the ring need. Each seed is used for one expansion only (keys are derived per query),
so a fixed all-zero nonce is safe.
"""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from .errors import SecAggError

PRG_NAMES = ("aes-ctr", "chacha20")
_ZERO_NONCE = bytes(16)
_CHUNK = 1 << 24  # bytes encrypted per call: bounds the zero buffer's memory


def _cipher(name: str, seed: bytes) -> Cipher:
    if name == "aes-ctr":
        return Cipher(algorithms.AES(seed), modes.CTR(_ZERO_NONCE))
    if name == "chacha20":
        return Cipher(algorithms.ChaCha20(seed, _ZERO_NONCE), mode=None)
    raise SecAggError(f"prg: unknown generator {name!r}; allowed: {', '.join(PRG_NAMES)}")


def expand(
    seed: bytes, count: int, dtype: type[np.unsignedinteger], prg: str = "aes-ctr"
) -> np.ndarray:
    """``count`` uniform ring elements of ``dtype`` from the keystream of ``prg`` under ``seed``."""
    if len(seed) != 32:
        raise SecAggError(f"prg seed must be 32 bytes, got {len(seed)}")
    nbytes = count * np.dtype(dtype).itemsize
    out = np.empty(nbytes + 15, dtype=np.uint8)  # update_into needs block_size - 1 spare bytes
    enc = _cipher(prg, seed).encryptor()
    zeros = np.zeros(min(nbytes, _CHUNK), dtype=np.uint8)
    done = 0
    while done < nbytes:
        step = min(_CHUNK, nbytes - done)
        enc.update_into(zeros[:step], out[done : done + step + 15])
        done += step
    return out[:nbytes].view(dtype)
