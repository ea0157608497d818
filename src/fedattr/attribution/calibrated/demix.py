"""De-mixing across rounds: the rounds whose cross-talk is kept (hardened mode), stacked.

Round t's changes are ``Y_t = A_t X^t`` (rows: the round's targets, ``A_t`` their known design
rows over every client). Under a persistent-mean model ``X_j^t = m_j + e_j^t``, the generalised
least squares estimate of every client's mean change solves

    F m = sum_t A_t^+ Y_t,    F = sum_t A_t^+ A_t,

the stack :class:`~fedattr.linalg.StackedGLS` that the cross-round audit
(:mod:`fedattr.attribution.crossround`) reads for the updates: ``m_j`` is identifiable when
``e_j`` is in the range of ``F``. Then ``m_hat = F^+ sum_t P_t X^t = m + sum_t B_t e^t`` with
``B_t = F^+ P_t`` and ``sum_t B_t = I``: each client's mean change exactly, plus the round
deviations with known coefficients whose sum over rounds vanishes off the diagonal. So a
watermarked client's key-aligned change leaks into another client's de-mixed change only
through its *variation* across rounds; where it is the same every round (the synthetic bed) it
cancels exactly and a clean client's de-mixed change does not depend on the owner's key. The
designs are drawn independently of any key, and ``F`` and the sums are functions of the
released answers only: the de-mixed means are what the cross-round audit already shows the
answers determine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from ...linalg import StackedGLS
from ...watermarks.tail.laws import KeyLaw
from ..contract import LinearKeyScorer, Parts
from ..design import QueryDesign
from .crosstalk import combination, design_matrix
from .weights import median, over_vocabulary


class DeMixer:
    """Rounds whose cross-talk is kept, stacked (:meth:`add`) and de-mixed (:meth:`solve`)."""

    def __init__(self) -> None:
        self.gls = StackedGLS()
        """``F = sum_t A_t^+ A_t`` over every client in a stacked round's design row."""
        self.b: dict[str, dict[int, torch.Tensor]] = {}
        """Part -> client -> ``[sum_t A_t^+ Y_t]_client`` (flat, float64)."""
        self.shapes: dict[str, tuple[int, ...]] = {}

    @property
    def ids(self) -> list[int]:
        """Every client in a stacked round's design row (the order of ``F``)."""
        return self.gls.ids

    def add(
        self,
        targets: Sequence[int],
        designs: Sequence[QueryDesign],
        changes: Sequence[Parts],
        laws: Mapping[str, KeyLaw],
        weights: Parts | None = None,
        mean: tuple[Sequence[int], Parts] | None = None,
    ) -> None:
        """One round: each target's raw change and design (``weights``: the round's key-free
        cell weights, applied first as :func:`~.standardise.standardise_round` does). ``mean``:
        the round's participants and the change of its SA mean, the equal-weight mean of their
        (submitted) updates: the public row. With it in every round, a term common to all
        clients passes into every de-mixed change alike (the median removes it); without it,
        it leaks with client-specific coefficients and swamps the key's signal."""
        if not targets:
            return
        members = {p for d in designs for p in d.coefficients()} | set(targets)
        if mean is not None:
            members |= set(mean[0])
        self.gls.extend(sorted(members))
        A = design_matrix(designs, self.ids)
        if mean is not None:
            row = np.zeros((1, len(self.ids)))
            row[0, [self.ids.index(p) for p in mean[0]]] = 1.0 / len(mean[0])
            A = np.vstack([A, row])
            changes = [*changes, mean[1]]
        pinv = self.gls.add(A)
        for part in laws:
            Y = [c[part].reshape(-1).double() for c in changes]
            if weights is not None and part in weights:
                w = weights[part].reshape(-1).double()
                Y = [y * w for y in Y]
            self.shapes[part] = tuple(changes[0][part].shape)
            acc = self.b.setdefault(part, {})
            for k, c in enumerate(self.ids):
                if not np.any(pinv[k]):
                    continue
                term = combination(pinv[k], Y)
                acc[c] = acc[c] + term if c in acc else term

    def solve(self) -> tuple[dict[str, dict[int, torch.Tensor]], list[int]]:
        """Part -> client -> its de-mixed mean change ``m_hat``, and the identifiable clients
        (``||P e_j||^2 >= 1 - 1e-9``, P the projector onto ``F``'s range)."""
        if not self.ids:
            return {}, []
        fplus = self.gls.inverse()
        identifiable = [c for c, ok in zip(self.ids, self.gls.identifiable(), strict=True) if ok]
        own: dict[str, dict[int, torch.Tensor]] = {}
        for part, acc in self.b.items():
            zero = torch.zeros_like(next(iter(acc.values())))
            terms = [acc.get(c, zero) for c in self.ids]
            own[part] = {c: combination(fplus[self.ids.index(c)], terms) for c in identifiable}
        return own, identifiable

    def state(self) -> dict:
        """For checkpoints."""
        return {"ids": list(self.ids), "f": self.gls.f, "b": self.b, "shapes": self.shapes}

    @classmethod
    def from_state(cls, state: Mapping | None) -> DeMixer:
        """Restore :meth:`state` (an empty one where the checkpoint has none)."""
        out = cls()
        if state:
            out.gls.ids, out.gls.f = list(state["ids"]), np.array(state["f"], dtype=np.float64)
            out.b, out.shapes = dict(state["b"]), dict(state["shapes"])
        return out


def demixed_evidence(
    mixer: DeMixer,
    laws: Mapping[str, KeyLaw],
    reader: LinearKeyScorer,
    token_centring: bool = False,
    centre: bool = True,
) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, dict[str, float]], list[int]]:
    """Each identifiable client's de-mixed change, centred, standardised and read with its
    owners' keys: ``(client -> part -> W, client -> owner -> <W, G>, the clients the stacked
    rounds do not identify)``. Key-free up to the owners' values, as within a round: the
    centre is the cell-wise median over the identifiable clients (their mean for two or
    fewer), the scale the null standard deviation of the centred change. ``centre = False``:
    no centre of the clients' (the de-mixed means gather every round, those whose reference may
    have learned a key too: see :meth:`~.sums.CalibratedNull.centres`)."""
    own, identifiable = mixer.solve()
    W: dict[int, dict[str, torch.Tensor]] = {}
    values: dict[int, dict[str, float]] = {}
    unidentified = [c for c in mixer.ids if c not in identifiable]
    if not identifiable:
        return W, values, unidentified
    for part, law in laws.items():
        if part not in own:
            continue
        X = torch.stack([own[part][c] for c in identifiable])
        # Key-free centre as where cross-talk is undone: a minority of watermarked clients
        # barely moves the cell-wise median.
        C = median(X) if len(identifiable) > 2 else X.mean(dim=0)
        if not centre:
            C = torch.zeros_like(C)
        tokens = token_centring and over_vocabulary(law)
        for k, c in enumerate(identifiable):
            d = (X[k] - C).reshape(mixer.shapes[part])
            if tokens:
                d = d - d.reshape(-1, d.shape[-1]).mean(dim=0)
            centred = law.centre(d)
            var = law.variance(centred)
            Wc = centred / math.sqrt(var) if var > 0 else torch.zeros_like(centred)
            W.setdefault(c, {})[part] = Wc.to(torch.float64)
            vals = reader.owner_values(part, Wc.float())
            values.setdefault(c, {}).update({o: float(v) for o, v in vals.items()})
    return W, values, unidentified
