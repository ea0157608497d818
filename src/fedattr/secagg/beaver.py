"""Inner products of two secret-shared vectors between two parties, with Beaver triples.

Two parties each hold an additive share (in the ring ``Z_{2^64}``, as fixed point) of every
row of ``X`` (``n x cells``: one row per client) and of one vector ``y`` (an owner's key).
Neither may learn ``X`` or ``y``; the owner wants ``<x_j, y>`` for every row. A dealer that
computes on no data hands each party shares of a random triple: ``A`` (like ``X``), ``b``
(like ``y``) and ``c_j = <a_j, b>``. The parties open ``D = X - A`` and ``e = y - b``: each is
uniform in the ring whatever ``X`` and ``y`` are (one-time pads), so the opening reveals
nothing. Then

    <x_j, y> = <d_j, e> + <d_j, b> + <a_j, e> + c_j,

which each party computes on its shares (the public ``<d_j, e>`` added by party 0 only): two
shares of every inner product, which only the owner adds. Exact in the ring (wrapping int64
arithmetic), so the result is the fixed-point inner product to the last bit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from .errors import SecAggError
from .prg import expand

RING = torch.int64
"""Ring elements: int64, whose arithmetic wraps modulo 2^64."""
FRAC_BITS = 32
"""Fixed-point fractional bits of an encoded value (resolution 2^-32)."""
_LIMIT = float(1 << 62)


def uniform(count: int, seed: bytes | None = None) -> torch.Tensor:
    """``count`` uniform ring elements (ChaCha20 keystream under ``seed``, fresh if none)."""
    return torch.from_numpy(expand(seed or os.urandom(32), count, np.int64).copy())


def encode(values: torch.Tensor, frac_bits: int = FRAC_BITS) -> torch.Tensor:
    """Real values as ring elements ``round(v * 2^frac_bits)``; refused where that would wrap."""
    scaled = torch.round(values.double() * float(1 << frac_bits))
    if scaled.numel() and float(scaled.abs().max()) >= _LIMIT:
        raise SecAggError(
            f"beaver.encode: a value of magnitude {float(values.abs().max()):.3g} does not fit "
            f"the ring at {frac_bits} fractional bits"
        )
    return scaled.to(RING)


def decode(ring: torch.Tensor, frac_bits: int = FRAC_BITS) -> torch.Tensor:
    """Ring elements (a sum of shares) as float64 values."""
    return ring.double() / float(1 << frac_bits)


def split(secret: torch.Tensor, seed: bytes | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Two additive ring shares of ``secret``: a uniform one and the rest."""
    pad = uniform(secret.numel(), seed).reshape(secret.shape)
    return pad, secret - pad


@dataclass(frozen=True)
class TripleShare:
    """One party's share of an inner-product triple: ``A`` (rows x cells), ``b`` (cells) and
    ``c`` (rows), with ``c_j = <a_j, b>`` once both parties' shares are added."""

    A: torch.Tensor
    b: torch.Tensor
    c: torch.Tensor


class Dealer:
    """Deals inner-product triples (a party that sees no data and computes no result: it must
    not collude with either computing party)."""

    def __init__(self) -> None:
        self.dealt = 0
        """Triples dealt (each is used once)."""

    def triples(self, rows: int, cells: int) -> tuple[TripleShare, TripleShare]:
        """Shares of one fresh triple for ``rows`` vectors against one vector of ``cells``."""
        A = uniform(rows * cells).reshape(rows, cells)
        b = uniform(cells)
        c = (A * b).sum(dim=1)
        A0, A1 = split(A)
        b0, b1 = split(b)
        c0, c1 = split(c)
        self.dealt += 1
        return TripleShare(A0, b0, c0), TripleShare(A1, b1, c1)


class InnerProductParty:
    """One computing party of the protocol: its shares of ``X`` and ``y`` and of a triple.

    :meth:`opening` is what it publishes (masked, uniform); :meth:`result` its share of every
    inner product once both openings are known."""

    def __init__(self, index: int, X: torch.Tensor, y: torch.Tensor, triple: TripleShare):
        if index not in (0, 1):
            raise SecAggError(f"index: must be 0 or 1, got {index!r}")
        if X.dtype != RING or y.dtype != RING or X.shape != triple.A.shape:
            raise SecAggError("InnerProductParty: shares must be ring tensors shaped as the triple")
        self.index, self.X, self.y, self.triple = index, X, y, triple

    def opening(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(X_share - A_share, y_share - b_share)``: uniform pads of the secrets."""
        return self.X - self.triple.A, self.y - self.triple.b

    def result(
        self, mine: tuple[torch.Tensor, torch.Tensor], theirs: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """This party's ring share of ``<x_j, y>`` for every row ``j``."""
        D = mine[0] + theirs[0]
        e = mine[1] + theirs[1]
        t = self.triple
        share = (D * t.b).sum(dim=1) + (t.A * e).sum(dim=1) + t.c
        if self.index == 0:
            share = share + (D * e).sum(dim=1)
        return share


def shared_inner_products(
    X: tuple[torch.Tensor, torch.Tensor],
    y: tuple[torch.Tensor, torch.Tensor],
    dealer: Dealer,
) -> tuple[tuple[torch.Tensor, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Both parties' ring shares of ``<x_j, y>`` for shared ``X`` (rows x cells) and ``y``,
    and the two openings (what each party published, for the record of what was seen)."""
    rows, cells = X[0].shape
    t0, t1 = dealer.triples(rows, cells)
    p0 = InnerProductParty(0, X[0], y[0], t0)
    p1 = InnerProductParty(1, X[1], y[1], t1)
    o0, o1 = p0.opening(), p1.opening()
    return (p0.result(o0, o1), p1.result(o1, o0)), [o0, o1]
