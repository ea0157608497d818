"""The two reading servers of the sealed mode: each holds one additive share of every update
and reads it, and its running sum of first-order changes, without ever holding an update.

A detector whose change is linear in the key offers its *first-order* reading
(``first_order(reference, tangents)``: the change ``d/ds change(reference, reference + s u)`` at
``s = 0``, by forward-mode AD), a linear map ``J`` of the update at the public reference. So
``J(u + R) + J(-R) = J(u)``: each server reads its own share, and the two readings add up to
the client's. What a server keeps of a client is its share of ``W_i = sum_t (tau * J_t u_it -
C_t)`` (the public taper ``tau`` of round 1's reference, rows centred, round 1 centred on the
aggregate's change ``C_1``, ``C_t = 0`` after it). At the end it gives the
owners its share of every client's values under public random keys, and enters the owner-key
inner products (Beaver triples) with its ring share of ``W_i``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ...errors import UserError
from ...secagg.beaver import encode
from ...secagg.sealed import ShareServer
from ...updates import UpdateLayout
from ...watermarks.tail.laws import KeyLaw

Parts = dict[str, torch.Tensor]
"""Part -> a flat change (float64)."""
Read = Callable[[Any, Sequence[Any]], list[Parts]]
"""``read(reference, tangents)``: each tangent's first-order change per part, flat (see
:func:`first_order_parts`)."""


def first_order_parts(scorer: Any) -> Read:
    """``scorer``'s first-order reading, each part's change flat (float64)."""

    def read(reference: Any, tangents: Sequence[Any]) -> list[Parts]:
        return [
            {part: d.double().reshape(-1) for part, d in change.items()}
            for change in scorer.first_order(reference, tangents)
        ]

    return read


def weighed(
    change: torch.Tensor,
    part: str,
    weights: Mapping[str, torch.Tensor],
    laws: Mapping[str, KeyLaw],
) -> torch.Tensor:
    """A first-order change as every reading takes it: times the part's public taper (where
    there is one), rows centred, flat."""
    if part in weights:
        change = change * weights[part]
    return laws[part].centre(change).reshape(-1)


class ReadingServer:
    """One server: the round's shares (a :class:`~fedattr.secagg.sealed.ShareServer`, which
    opens only sums over ``min_members`` clients) and its share of every client's summed
    change, per part."""

    def __init__(self, label: str, min_members: int, laws: Mapping[str, KeyLaw]) -> None:
        self.label = label
        self.shares = ShareServer(label, min_members)
        self.laws = dict(laws)
        self.W: dict[int, Parts] = {}
        """Client -> part -> this server's share of its summed change (float64, flat)."""
        self.reads = 0
        """First-order reads of shares over the run."""

    def read_round(
        self,
        read: Read,
        reference: Any,
        layout: UpdateLayout,
        weights: Mapping[str, torch.Tensor],
        centre: Mapping[str, torch.Tensor] | None,
    ) -> None:
        """Read every share of the round (at ``reference``); per part weigh, centre rows,
        subtract the public ``centre`` (server A only: a public constant belongs to one
        share) and add it to the client's running sum."""

        def changes(shares: list[np.ndarray]) -> list[Parts]:
            return read(reference, [layout.unflatten(s) for s in shares])

        for client, parts in self.shares.apply(changes).items():
            self.reads += 1
            sums = self.W.setdefault(client, {})
            for part, change in parts.items():
                change = weighed(change, part, weights, self.laws)
                if centre is not None and self.label == "A":
                    change = change - centre[part]
                sums[part] = sums.get(part, 0.0) + change

    def check_fits(self, frac_bits: int) -> None:
        """Refuse, as soon as it happens, a running sum too large for the ring at
        ``frac_bits`` (the verdict encodes it there)."""
        top = max((float(w.abs().max()) for s in self.W.values() for w in s.values()), default=0)
        if top * 2.0**frac_bits >= 2.0**61:
            raise UserError(
                f"attribution.sealed.frac_bits: {frac_bits} leaves no room in the ring for "
                f"server {self.label}'s sums (|value| up to {top:.3g}); lower it, or "
                "attribution.sealed.mask_scale"
            )

    def l1(self, part: str, clients: Sequence[int]) -> np.ndarray:
        """``sum |W_i|`` of this server's shares over ``part`` (a bound on the float rounding of
        its random-key values, sent to the owners with them)."""
        return np.array([float(self.W[c][part].abs().sum()) for c in clients])

    def ring_shares(self, part: str, clients: Sequence[int], frac_bits: int) -> torch.Tensor:
        """This server's share of every ``W_i`` over ``part`` in the ring (fixed point), for
        the owner-key inner products."""
        return encode(torch.stack([self.W[c][part] for c in clients]), frac_bits)

    def state(self) -> dict:
        return {"W": {str(c): w for c, w in self.W.items()}, "reads": self.reads}

    def load(self, state: Mapping) -> None:
        self.W = {int(c): dict(w) for c, w in state["W"].items()}
        self.reads = int(state["reads"])
