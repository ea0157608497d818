"""The owners' side of the sealed verdict: what each owner receives, and its exact p-value.

Per client, an owner receives ``s_o = <W_i, G_owner>`` (from the Beaver inner product on the
servers' ring shares) and ``s_k = <W_i, G_k>`` for ``n`` public random keys drawn from the
owners' own key law (each server's share added). Under the null (a change that depends on no
key, or only through forgetting what a reference learned, which reads against the key) the
owner's key is exchangeable with the random ones, so the rank

    p = (1 + #{k : s_k >= s_o - tol}) / (n + 1)

is an exact p-value (``tol`` covers the fixed-point rounding of ``s_o``, ``frac_bits``: it can
only make ``p`` larger). A client is named for an owner when ``p < alpha / (clients x owners)``:
family-wise level ``alpha`` over every (client, owner) pair.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from scipy.stats import norm

from ...secagg.beaver import decode
from ..stouffer import AttributionReport, ClientAttribution, over_statistics

if TYPE_CHECKING:
    from .parties import Verdicts


@dataclass
class OwnerOpenings:
    """What the owners hold at the end, per owner: every client's value under its own key,
    under the public random keys of its part, and the rounding tolerance of the former."""

    clients: list[int]
    keys: int
    owner: dict[str, np.ndarray] = field(default_factory=dict)
    random: dict[str, np.ndarray] = field(default_factory=dict)
    """Owner -> ``[clients, keys]`` float64."""
    tolerance: dict[str, np.ndarray] = field(default_factory=dict)
    """Owner -> per client, a bound on the rounding of each value (see :meth:`add_owner`)."""

    def add_owner(
        self,
        name: str,
        ring_sum: torch.Tensor,
        random: torch.Tensor,
        key_cells: int,
        frac_bits: int,
        l1: np.ndarray,
        cells: int,
    ) -> None:
        """Owner ``name``'s values (the two servers' ring shares added), its random-key values
        (the two servers' float64 values added) and each client's tolerance: the owner's value
        is rounded by at most ``2^-frac`` a key cell (half a unit each of two shares); a random
        key's, summed in float64 over ``cells`` products of shares whose absolute values sum
        to ``l1`` (both servers), by at most ``cells * 2^-53 * l1`` (the worst case of any
        summation order), and once more where the two are added."""
        self.owner[name] = decode(ring_sum, frac_bits).numpy()
        self.random[name] = random.numpy()
        float_bound = (cells + 2) * 2.0**-53 * np.asarray(l1, dtype=np.float64)
        self.tolerance[name] = key_cells * 2.0 ** (-frac_bits) + float_bound

    def merge(self, other: OwnerOpenings) -> None:
        """Take ``other``'s owners (the same clients and keys)."""
        self.owner |= other.owner
        self.random |= other.random
        self.tolerance |= other.tolerance

    def p_values(self, name: str) -> np.ndarray:
        """Each client's rank p under owner ``name``'s key: random keys within the two
        roundings' bound of the owner's value count as reading at least as high (so ``p`` can
        only be larger than the exact rank's)."""
        values, null = self.owner[name], self.random[name]
        slack = 2.0 * np.broadcast_to(self.tolerance[name], values.shape)
        above = (null >= (values - slack)[:, None]).sum(axis=1)
        return (1.0 + above) / (null.shape[1] + 1.0)

    def statistics(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """What owner ``name`` publishes per client: its rank p (:meth:`p_values`) and its
        value standardised by the random keys' mean and SD (for display; 0 where they do not
        vary)."""
        values, null = self.owner[name], self.random[name]
        sd = null.std(axis=1) if null.shape[1] > 1 else np.zeros(len(values))
        mid = null.mean(axis=1) if null.shape[1] else np.zeros(len(values))
        Z = np.where(sd > 0, (values - mid) / np.where(sd > 0, sd, 1.0), 0.0)
        return self.p_values(name), Z


def sealed_report(
    verdicts: Verdicts,
    truth: Mapping[int, bool] | None,
    alpha: float,
    level: float,
) -> AttributionReport:
    """The verdict from what the owners published: rank p per (client, owner), named below
    ``level``; the combined row per client Bonferroni-adjusted over owners."""
    owners = sorted(verdicts.p)
    S = max(1, len(owners))
    threshold = float(norm.isf(level))
    components = {o: AttributionReport(gamma=threshold) for o in owners}
    combined = AttributionReport(gamma=threshold, components=components)
    index = {c: i for i, c in enumerate(verdicts.clients)}
    for c in sorted(set(verdicts.clients) | set(truth or {})):
        watermarked = None if truth is None else bool(truth.get(c, False))
        rows = []
        for o in owners:
            i = index.get(c)
            if i is None:
                row = ClientAttribution(
                    id=c, z={}, Z=0.0, p=1.0, log10_p=0.0, flagged=False,
                    watermarked=watermarked, statistic=o, tail="random-keys",
                )  # fmt: skip
            else:
                pv = float(verdicts.p[o][i])
                row = ClientAttribution(
                    id=c,
                    z={},
                    Z=float(verdicts.Z[o][i]),
                    p=pv,
                    log10_p=math.log10(pv),
                    flagged=pv < level,
                    watermarked=watermarked,
                    statistic=o,
                    p_rank=pv,
                    tail="random-keys",
                )
            components[o].clients.append(row)
            rows.append(row)
        if rows:
            best = min(rows, key=lambda r: (r.log10_p, -r.Z))
            combined.clients.append(over_statistics(best, rows, S))
    for rep in [combined, *components.values()]:
        rep.statistic, rep.alpha, rep.null_keys, rep.level = (
            "calibrated",
            alpha,
            verdicts.keys,
            level,
        )
    return combined
