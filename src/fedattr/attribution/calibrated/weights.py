"""Key-free weights and centres: what a round's changes are read with before any key reads them.

Every function here is a function of the reference model or of the round's changes alone, the
same for every key, so the statistic stays linear in each change and its exact tail under a
random key still holds: the taper (:func:`taper_weights`, from the reference model's token
probabilities), the spread weights (:func:`spread_weights`, from the clients' spread over each
cell), and the cell-wise median over the clients (:func:`median`) that centres them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ...watermarks.tail.laws import KeyLaw, RowSubsets
from ..contract import Parts, ReferenceProbabilities


def taper_weights(scorer: Any, reference: Any, exponent: float, start: float) -> Parts | None:
    """Each cell's weight ``min(1, start / p) ** exponent`` from its reference probability
    ``p`` (``None`` where ``exponent`` is 0 or the detector has no such probabilities).

    The change of a likely token is mostly the client's own drift (the model growing more or
    less sure of what it already predicts), while a key's green lists move every token of a
    context in proportion to its probability: above ``start``, a cell's change is read on a
    scale that grows more slowly than ``p`` (``exponent = 0.5``: its change over ``sqrt(p)``,
    the Fisher-information scale of a probability). Below ``start`` every cell keeps weight
    1, so rare tokens, whose changes follow shared embeddings rather than any key, are never
    amplified. The weights depend on the reference model only (the same for every client of
    the round and every key), so the round stays linear in each estimate and the exact tail
    under a random key still holds."""
    if exponent == 0.0 or not isinstance(scorer, ReferenceProbabilities):
        return None
    return {
        part: (start / p.double().clamp_min(1e-30)).clamp(max=1.0).pow(exponent).float()
        for part, p in scorer.reference_probabilities(reference).items()
    }


MEDIAN_BLOCK = 1 << 24
"""Elements sorted at once by :func:`median` off the CPU (0.2 GB of float32 values and their
int64 indices)."""


def _middle(s: torch.Tensor) -> torch.Tensor:
    k = s.shape[0]
    return s[k // 2] if k % 2 else 0.5 * (s[k // 2 - 1] + s[k // 2])


def median(X: torch.Tensor, block: int = MEDIAN_BLOCK) -> torch.Tensor:
    """Cell-wise median over dim 0 (the mean of the two middle values for an even count)."""
    k = X.shape[0]
    if X.device.type == "cpu" and k > 1 and X.dtype in (torch.float32, torch.float64):
        # A partial sort finds the same middle values as a full sort, several times faster
        # than sorting a strided dim 0 (a round's centring and spread weights at every cell).
        middle = [k // 2] if k % 2 else [k // 2 - 1, k // 2]
        return _middle(torch.from_numpy(np.partition(X.numpy(), middle, axis=0)))
    # Elsewhere (a GPU) one sort of the whole of X would hold its values and int64 indices at
    # once, 8 GB for a SmolLM2 round read on 128 probes: sort blocks of columns instead.
    flat = X.reshape(k, -1)
    out = torch.empty(flat.shape[1], dtype=X.dtype, device=X.device)
    step = max(1, block // max(1, k))
    for lo in range(0, flat.shape[1], step):
        out[lo : lo + step] = _middle(flat[:, lo : lo + step].sort(dim=0).values)
    return out.reshape(X.shape[1:])


def spread_weights(D: torch.Tensor, cols: int, exponent: float) -> torch.Tensor:
    """Key-free weight per cell of a round's centred changes ``D`` (``[targets, cells]``, rows
    of ``cols`` cells): ``max(S, S_row) ** -exponent``, ``S`` the cell's median over the targets
    of ``|D|`` and ``S_row`` its row's median of ``S``; a cell no target moves (``0``) gets 0.

    Where the clients' changes spread widely (a likely token, a context every client drifts
    on) a cell carries more of their drift than of a key's signal, and a few such cells would
    dominate the sum and thicken its tail. Row by row (the floor is the row's own), so the
    weights of a block of rows do not depend on the other rows."""
    S = median(D.abs()).reshape(-1, cols)
    floor = median(S.T).unsqueeze(1)
    m = torch.maximum(S, floor)
    w = torch.where(m > 0, m.clamp_min(torch.finfo(m.dtype).tiny) ** -exponent, 0.0)
    return w.reshape(-1)


def over_vocabulary(law: KeyLaw) -> bool:
    """Whether ``law``'s rows each mark several columns (KGW's green lists over a vocabulary):
    only there are per-token drift and the clients' spread over cells things a key can miss
    (token centring, :func:`spread_weights`)."""
    return isinstance(law, RowSubsets) and law.m > 1
