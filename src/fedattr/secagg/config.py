"""Backend selection: :class:`SecAggConfig`, the :data:`BACKENDS` registry and
:func:`make_aggregator`.

Each backend builds itself from a config (``from_config``), so adding a backend means adding it
to :data:`BACKENDS` and nothing else.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch

from ..config import check_choice, check_literal
from .aggregator import SecureAggregator
from .errors import SecAggError
from .fixedpoint import FixedPointCodec
from .pairwise_mask import PairwiseMaskAggregator
from .plaintext import PlaintextAggregator
from .two_server import TwoServerAggregator

BACKENDS: dict[str, type[SecureAggregator]] = {
    cls.name: cls for cls in (PlaintextAggregator, PairwiseMaskAggregator, TwoServerAggregator)
}
"""Every backend by its ``name``."""


@dataclass
class SecAggConfig:
    """Which backend to use and how updates are encoded."""

    backend: str = "pairwise-mask"
    """One of ``plaintext``, ``pairwise-mask``, ``two-server``."""
    min_members: int = 5
    """Secure-aggregation threshold N_sa: the smallest subset whose sum may be released."""
    ring_bits: int = 64
    """Ring Z_{2^b} for masked arithmetic: 32 or 64."""
    frac_bits: int = 32
    """Fixed-point fractional bits (resolution 2^-(frac_bits+1))."""
    clip: float = 1024.0
    """Largest allowed |coordinate| of an update; larger is an error, not a silent clip."""
    prg: Literal["aes-ctr", "chacha20", "auto"] = "auto"  # prg.PRG_NAMES, and auto
    """Mask generator: ``chacha20`` (any device; OpenSSL on the CPU, torch elsewhere, the same
    bits), ``aes-ctr`` (CPU only: OpenSSL with AES-NI, about 1.8x faster there), or ``auto``:
    ``aes-ctr`` where the in-process run masks on the CPU, ``chacha20`` on a GPU and in a
    distributed run (clients resolve their devices apart, and every pair must expand its seed
    with the same cipher). Sums are the same bits whichever: the masks cancel."""
    device: str = "auto"
    """Where masking, shares and sums are computed: ``cpu``, ``cuda``, ``cuda:N``, or ``auto``
    (``cuda`` when torch sees a GPU, else ``cpu``). Answers are the same on every device."""
    dropout: float = 0.0
    """pairwise-mask only: chance that a member fails to answer a given query (simulated
    network failure, seeded); the query then fails and releases nothing."""
    seed: int = 0
    """Seed of the simulated network failures (``dropout``)."""
    release_budget: float = 0.0
    """Release policy: 0 = none (the paper's protocol); > 0 = refuse any query that would make
    a client exactly recoverable or push its joint leakage over this many nats per dimension
    (``inf`` = forbid exact recovery only). Enforced by the party that unmasks."""

    def __post_init__(self) -> None:
        # A registry, not a Literal: a plugin may add a backend to BACKENDS.
        check_choice(self.backend, BACKENDS, "secagg.backend", SecAggError)
        check_literal(self, "secagg", SecAggError)
        if not isinstance(self.min_members, int) or self.min_members < 1:
            raise SecAggError(
                f"secagg.min_members: must be an integer >= 1, got {self.min_members!r}"
            )
        if not self.release_budget >= 0:
            raise SecAggError(
                f"secagg.release_budget: must be >= 0 (0 = no policy), got {self.release_budget}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise SecAggError(f"secagg.dropout: must be in [0, 1), got {self.dropout}")
        self.codec()  # validates ring_bits, frac_bits and clip together
        # Syntax only: loading a configuration never probes the hardware (a config.json written
        # on a GPU machine loads anywhere); :meth:`torch_device` checks it when a run starts.
        if not re.fullmatch(r"cpu|cuda(:\d+)?|auto", str(self.device)):
            raise SecAggError(
                f"secagg.device: unknown {self.device!r}; allowed: cpu, cuda, cuda:N, auto"
            )
        if self.device not in ("cpu", "auto") and self.prg not in ("chacha20", "auto"):
            raise SecAggError(
                f"secagg.prg={self.prg} runs on the CPU only; with secagg.device={self.device} "
                "allowed: chacha20, auto"
            )

    def _resolved(self) -> torch.device:
        """:attr:`device` with ``auto`` resolved, unchecked against the hardware."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_device(self) -> torch.device:
        """The resolved :attr:`device`, checked against this machine: call it when a run
        starts (:func:`make_aggregator` does). A :class:`SecAggError` names ``secagg.device``
        when it is not here (``cuda`` without a GPU, ``cuda:N`` past the last one) or cannot
        run :attr:`prg`."""
        device = self._resolved()
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise SecAggError(
                    f"secagg.device={self.device}: torch sees no CUDA device here; "
                    "allowed: cpu, auto"
                )
            count = torch.cuda.device_count()
            if device.index is not None and device.index >= count:
                raise SecAggError(
                    f"secagg.device={self.device}: torch sees {count} CUDA device(s) here; "
                    f"allowed: cpu, cuda, cuda:0..cuda:{count - 1}, auto"
                )
        if device.type != "cpu" and self.prg not in ("chacha20", "auto"):
            raise SecAggError(
                f"secagg.prg={self.prg} runs on the CPU only; with secagg.device={self.device} "
                f"({device}) allowed: chacha20, auto"
            )
        return device

    def resolved_prg(self, distributed: bool = False) -> str:
        """The cipher :attr:`prg` names here: ``auto`` is ``aes-ctr`` when every party masks
        on this machine's CPU, else ``chacha20`` (``distributed``: parties on other machines)."""
        if self.prg != "auto":
            return self.prg
        return "aes-ctr" if not distributed and self._resolved().type == "cpu" else "chacha20"

    def codec(self) -> FixedPointCodec:
        """The fixed-point codec these settings describe."""
        return FixedPointCodec(self.ring_bits, self.frac_bits, self.clip)


def make_aggregator(config: SecAggConfig) -> SecureAggregator:
    """Build the configured backend; the run starts here, so :attr:`SecAggConfig.device` is
    checked against this machine first."""
    config.torch_device()
    return BACKENDS[config.backend].from_config(config)
