"""ChaCha20 keystream (RFC 8439 block function) in torch integer ops, on any device.

The pairwise masks of secure aggregation are keystream expanded from per-pair seeds; producing
them where the update lives (a GPU) avoids moving every mask across the bus. This is the plain
block function, vectorised over blocks and over several keys at once: a ``[16, blocks]`` state
of int32 words whose additions wrap modulo 2**32 (two's complement), rotations built from
shifts and masks. It is bit-exact with the ``cryptography`` package's ChaCha20 (OpenSSL) for a
zero nonce and counter, which a test checks, so a mask is the same on every device.

``torch.compile`` fuses the ~1,000 elementwise steps into one kernel; :func:`keystream` uses it
on CUDA when available (``compile=None``) and runs eagerly elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# "expand 32-byte k" as four little-endian words.
_CONSTANTS = (0x61707865, 0x3320646E, 0x79622D32, 0x6B206574)
_BLOCK_BYTES = 64
_compiled = None


def _signed(word: int) -> int:
    """A 32-bit word as the int32 with the same bits."""
    return word - (1 << 32) if word >= 1 << 31 else word


def _rotl(x: torch.Tensor, n: int) -> torch.Tensor:
    # Arithmetic right shift copies the sign bit; masking keeps only the bits rotated in.
    return (x << n) | ((x >> (32 - n)) & ((1 << n) - 1))


def _quarter(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One quarter round (functional, so ``torch.compile`` fuses the whole block function)."""
    a = a + b
    d = _rotl(d ^ a, 16)
    c = c + d
    b = _rotl(b ^ c, 12)
    a = a + b
    d = _rotl(d ^ a, 8)
    c = c + d
    b = _rotl(b ^ c, 7)
    return a, b, c, d


_COLUMNS = ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15))
_DIAGONALS = ((0, 5, 10, 15), (1, 6, 11, 12), (2, 7, 8, 13), (3, 4, 9, 14))


def _blocks(state: torch.Tensor) -> torch.Tensor:
    """The ChaCha20 block function on a ``[16, n]`` int32 state: returns ``[n, 16]`` words."""
    x = list(state.unbind(0))
    for _ in range(10):
        for quads in (_COLUMNS, _DIAGONALS):
            for i, j, k, m in quads:
                x[i], x[j], x[k], x[m] = _quarter(x[i], x[j], x[k], x[m])
    return torch.stack(x, dim=1) + state.T


def _initial_state(keys: Sequence[bytes], blocks: int, device: torch.device) -> torch.Tensor:
    """``[16, len(keys) * blocks]`` initial states: key-major, block counter from 0."""
    words = []
    for key in keys:
        if len(key) != 32:
            raise ValueError(f"ChaCha20 key must be 32 bytes, got {len(key)}")
        words.append([_signed(int.from_bytes(key[i : i + 4], "little")) for i in range(0, 32, 4)])
    n = len(keys)
    key_words = torch.tensor(words, dtype=torch.int32, device=device)  # [n, 8]
    state = torch.zeros((16, n, blocks), dtype=torch.int32, device=device)
    for i, const in enumerate(_CONSTANTS):
        state[i] = _signed(const)
    state[4:12] = key_words.T.unsqueeze(-1)
    # 64-bit block counter in words 12 and 13 (OpenSSL carries into the nonce's first word);
    # the nonce words stay zero.
    counter = torch.arange(blocks, dtype=torch.int64, device=device)
    state[12] = (counter & 0xFFFFFFFF).to(torch.int32)  # low word (wraps into int32's range)
    state[13] = (counter >> 32).to(torch.int32)
    return state.reshape(16, n * blocks)


def keystream(
    keys: Sequence[bytes],
    nbytes: int,
    device: torch.device | str = "cpu",
    compile: bool | None = None,
) -> torch.Tensor:
    """``[len(keys), nbytes]`` uint8: the first ``nbytes`` of each key's ChaCha20 keystream
    (zero nonce and counter), computed on ``device``."""
    device = torch.device(device)
    if nbytes < 0:
        raise ValueError(f"nbytes: must be >= 0, got {nbytes}")
    blocks = -(-nbytes // _BLOCK_BYTES)
    state = _initial_state(keys, blocks, device)
    use_compile = device.type == "cuda" if compile is None else compile
    fn = _blocks
    if use_compile:
        global _compiled
        if _compiled is None:
            _compiled = torch.compile(_blocks, dynamic=True)
        fn = _compiled
    words = fn(state).contiguous()  # [n * blocks, 16] little-endian words of each block
    out = words.view(torch.uint8).reshape(len(keys), blocks * _BLOCK_BYTES)
    return out[:, :nbytes]
