"""Fixed-point encoding of real-valued updates into the ring Z_{2^b}.

Cryptographic masking needs exact modular arithmetic, so updates are scaled by ``2**frac_bits``,
rounded, and stored as unsigned ``b``-bit integers (two's complement for negatives). A sum of
``m`` encoded values decodes correctly as long as its true magnitude stays below ``2**(b-1)``;
the codec checks that bound instead of letting a sum silently wrap around.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .errors import SecAggError

_RING = {32: torch.int32, 64: torch.int64}


@dataclass(frozen=True)
class FixedPointCodec:
    """Encode float vectors into ``Z_{2^ring_bits}`` with ``frac_bits`` fractional bits.

    ``clip`` bounds every coordinate's magnitude; a coordinate above it is an error (not a
    silent clip), since clipping would bias the FedAttr estimate without anyone noticing.
    """

    ring_bits: int = 64
    frac_bits: int = 32
    clip: float = 1024.0

    def __post_init__(self) -> None:
        if self.ring_bits not in _RING:
            raise SecAggError(f"ring_bits: must be 32 or 64, got {self.ring_bits}")
        if not 0 <= self.frac_bits < self.ring_bits - 1:
            raise SecAggError(
                f"frac_bits: must be in 0..{self.ring_bits - 2} for ring_bits={self.ring_bits}, "
                f"got {self.frac_bits}"
            )
        if not (np.isfinite(self.clip) and self.clip > 0):
            raise SecAggError(f"clip: must be a finite positive number, got {self.clip}")
        if self.clip * self.scale >= 2.0 ** (self.ring_bits - 1):
            raise SecAggError(
                f"clip={self.clip} with frac_bits={self.frac_bits} does not fit one value in a "
                f"{self.ring_bits}-bit ring; lower clip or frac_bits"
            )

    @property
    def scale(self) -> float:
        """Multiplier from real values to ring integers."""
        return float(2**self.frac_bits)

    @property
    def dtype(self) -> torch.dtype:
        """torch dtype of ring elements (arithmetic wraps modulo ``2**ring_bits``)."""
        return _RING[self.ring_bits]

    @property
    def itemsize(self) -> int:
        """Bytes per encoded coordinate."""
        return self.ring_bits // 8

    @property
    def resolution(self) -> float:
        """Worst-case rounding error of one encoded coordinate."""
        return 0.5 / self.scale

    def max_members(self) -> int:
        """Largest number of values of magnitude ``<= clip`` whose sum cannot wrap."""
        return int((2.0 ** (self.ring_bits - 1) - 1) // (self.clip * self.scale))

    def check_capacity(self, members: int) -> None:
        """Raise if a sum over ``members`` clipped values could overflow the ring."""
        limit = self.max_members()
        if members > limit:
            raise SecAggError(
                f"ring_bits={self.ring_bits}, frac_bits={self.frac_bits}, clip={self.clip} can sum "
                f"at most {limit} clients without overflow, but {members} take part; lower "
                f"frac_bits or clip, or use ring_bits=64"
            )

    def check(self, values: np.ndarray | torch.Tensor) -> torch.Tensor:
        """``values`` as a float64 tensor, after checking that :meth:`encode` accepts them.

        Raises :class:`SecAggError` for non-finite values or values above ``clip`` (the
        plaintext backend calls this too, so every backend refuses the same updates).
        """
        values = torch.as_tensor(values).to(torch.float64)
        if not bool(torch.isfinite(values).all()):
            raise SecAggError("update: contains NaN or infinite values; refusing to encode")
        peak = float(values.abs().max()) if values.numel() else 0.0
        if peak > self.clip:
            raise SecAggError(
                f"update: a coordinate of magnitude {peak:.6g} exceeds the fixed-point clip bound "
                f"{self.clip}; raise secagg.clip (allowed while clip * 2**frac_bits < "
                f"2**{self.ring_bits - 1}) or scale the update"
            )
        return values

    def encode(
        self, values: np.ndarray | torch.Tensor, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """Encode float ``values`` into ring elements on ``device`` (default: where they are).

        Raises :class:`SecAggError` for non-finite values or values above ``clip``.
        """
        values = torch.as_tensor(values)
        values = self.check(values.to(device) if device is not None else values)
        # |values| * scale < 2**(b-1) (checked at construction), so the rounded integer fits.
        return torch.round(values * self.scale).to(torch.int64).to(self.dtype)

    def decode(self, ring: torch.Tensor) -> np.ndarray:
        """Decode ring elements (a sum of encodings) back to a float64 NumPy vector."""
        if ring.device.type == "cpu":
            # NumPy, not torch, on the CPU: the same values, without waking torch's worker
            # threads (they spin afterwards, beside the next query's ciphers).
            return ring.numpy().astype(np.float64) / self.scale
        return (ring.to(torch.float64) / self.scale).cpu().numpy()
