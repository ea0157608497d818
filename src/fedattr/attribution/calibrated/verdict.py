"""Step 5, the verdict: a pure function of the sums (:class:`Evidence`) and the level.

Per client and owner, the owner's statistic ``<W_i, G>`` against its exact tail under a random
key (:meth:`~fedattr.watermarks.tail.laws.KeyLaw.tails`); where the tail is only a bound and the
detector lent the owner's key, p by the randomization test over that key shifted row by row
(:func:`shifted`); ``null_keys`` random keys read every ``W_i`` once as a check
(:func:`rank_values`). Over several owners ``p`` is Bonferroni-adjusted and a client is named
when it is below ``alpha / (clients x owners)``: family-wise level ``alpha``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy.stats import norm

from ...rows import Rows
from ...watermarks.tail.laws import law_from_dict
from ...watermarks.tail.methods import SHIFT_MAX_CELLS, Tail, shifted_keys_p
from ..stouffer import AttributionReport, ClientAttribution, over_statistics

SHIFTED_FLOOR = 0.01
"""The shifted-key test's p is read above ``level x`` this (see :func:`shifted`)."""
BOUNDS = ("patterns", "chernoff")
"""Tail methods that are upper bounds, not the tail itself."""


@dataclass(frozen=True)
class Evidence:
    """What the verdicts read: each client's sums and how they were obtained (key-free up to
    the owners' values). :meth:`~.sums.CalibratedNull.evidence` gives a run's, with the rounds
    kept for de-mixing merged in; nothing here is changed by reading it."""

    W: Mapping[int, Mapping[str, torch.Tensor | Rows]]
    """Client -> part -> ``W_i`` (in memory, or read by row blocks)."""
    values: Mapping[int, Mapping[str, float]]
    """Client -> owner -> ``<W_i, G_owner>``."""
    laws: Mapping[str, Mapping]
    """Part -> its key law (:meth:`~fedattr.watermarks.tail.laws.KeyLaw.describe`)."""
    parts: Mapping[str, str]
    """Owner -> the part its key reads."""
    per_round: Mapping[int, Mapping[str, Mapping[int, float]]] = field(default_factory=dict)
    """Client -> owner -> round -> that round's standardised statistic (display)."""
    valid: Mapping[str, bool] = field(default_factory=dict)
    """Owner -> whether its key is exchangeable with a random one in every round read."""
    cross_talk: frozenset[int] = frozenset()
    """Clients with a round whose cross-talk was kept and not de-mixed (uncalibrated)."""
    rounds_read: Mapping[str, int] = field(default_factory=dict)
    """Owner -> only rounds ``1..n`` read (late rounds skipped)."""
    keys: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """Owner -> its key as a matrix, where the detector lends it (:func:`shifted`)."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where the changes were computed: the rank check's random keys are drawn there."""


def report(
    evidence: Evidence,
    truth: Mapping[int, bool] | None = None,
    *,
    alpha: float,
    null_keys: int = 0,
    seed: int = 0,
    name_uncalibrated: bool = False,
) -> AttributionReport:
    """Per client: Z, exact p and tail method of its strongest owner, Bonferroni over owners,
    named at family-wise ``alpha`` over clients x owners; ``null_keys`` random keys (drawn
    from ``seed``) for the rank check; a client whose p is not calibrated is named only with
    ``name_uncalibrated``."""
    ev = evidence
    clients = sorted(set(ev.W) | set(truth or {}))
    owners = sorted(ev.parts)
    S, K = max(1, len(owners)), max(1, len(clients))
    level = alpha / (K * S)
    threshold = float(norm.isf(level))
    components = {o: AttributionReport(gamma=threshold) for o in owners}
    combined = AttributionReport(gamma=threshold, components=components)
    ranks = rank_values(ev, clients, null_keys, seed)
    found = shifted(ev, tails(ev, clients, owners), level, seed)
    for c in clients:
        watermarked = None if truth is None else bool(truth.get(c, False))
        rows = []
        for o in owners:
            tail = found.get((c, o))
            row = _client_owner(ev, c, o, watermarked, level, ranks, tail, name_uncalibrated)
            components[o].clients.append(row)
            rows.append(row)
        if not rows:
            continue
        best = min(rows, key=lambda r: (r.log10_p, -r.Z))
        combined.clients.append(over_statistics(best, rows, S))
    for rep in [combined, *components.values()]:
        rep.statistic, rep.alpha, rep.null_keys = "calibrated", alpha, null_keys
        rep.level = level
        rep.uncalibrated = sorted(o for o in owners if not ev.valid.get(o, True))
        rep.cross_talk = sorted(ev.cross_talk)
        rep.rounds_read = dict(sorted(ev.rounds_read.items()))
    return combined


def rank_values(
    evidence: Evidence, clients: Sequence[int], null_keys: int, seed: int
) -> dict[str, dict[int, np.ndarray]]:
    """Part -> client -> ``<W_i, key_k>`` for ``null_keys`` random keys (one draw for all
    clients, at the end)."""
    out: dict[str, dict[int, np.ndarray]] = {}
    if null_keys < 1:
        return out
    device = evidence.device
    for part, desc in evidence.laws.items():
        have = [c for c in clients if part in evidence.W.get(c, {})]
        if not have:
            continue

        # On a GPU: 200 keys over ten vocabulary-sized changes are ~1e11 cells, minutes
        # on a CPU (it reads every change once per key), a second there.
        def where(W: torch.Tensor | Rows) -> torch.Tensor | Rows:
            if device.type == "cpu" or isinstance(W, Rows):
                return W
            return W.to(device, torch.float32)

        Ws = [where(evidence.W[c][part]) for c in have]
        values = law_from_dict(desc).random_values(Ws, null_keys, seed)
        out[part] = {c: values[i] for i, c in enumerate(have)}
    return out


def tails(
    evidence: Evidence, clients: Sequence[int], owners: Sequence[str]
) -> dict[tuple[int, str], Tail]:
    """The exact tail of every (client, owner) statistic. Owners reading the same part
    share its CGF (built once per client); clients run in threads (the work is numpy
    over ``W``, which releases the GIL): a vocabulary-sized ``W`` takes seconds."""
    W, values, parts = evidence.W, evidence.values, evidence.parts
    jobs: dict[tuple[int, str], list[str]] = {}
    for c in clients:
        for o in owners:
            if parts[o] in W.get(c, {}) and o in values.get(c, {}):
                jobs.setdefault((c, parts[o]), []).append(o)

    def one(job: tuple[int, str]) -> list[tuple[tuple[int, str], Tail]]:
        c, part = job
        law, names = law_from_dict(evidence.laws[part]), jobs[job]
        found = law.tails(W[c][part], [values[c][o] for o in names])
        return [((c, o), t) for o, t in zip(names, found, strict=True)]

    workers = min(len(jobs), max(1, torch.get_num_threads()))
    if workers <= 1:
        return dict(pair for job in jobs for pair in one(job))
    with ThreadPoolExecutor(workers) as pool:
        return dict(pair for pairs in pool.map(one, jobs) for pair in pairs)


def shifted(
    evidence: Evidence, found: Mapping[tuple[int, str], Tail], level: float, seed: int
) -> dict[tuple[int, str], Tail]:
    """Where a tail is only a bound (a change on few cells) and the owner's key is at hand,
    p by the randomization test over shifted keys, exact at any number of keys.

    The bound is kept where it is already below ``floor = level / 100`` (a client the
    bound names with room to spare keeps its small p); elsewhere p is the test's p plus
    ``floor``. That sum is a valid p-value whatever the bound and the test's correlation:
    ``P(p <= u) <= P(bound <= floor) + P(test <= u - floor) <= u``. Keys are drawn up to
    ``1 / floor``, so the test alone resolves p down to the floor."""
    floor = level * SHIFTED_FLOOR
    owners = sorted(evidence.parts)
    out = dict(found)
    for (client, owner), tail in found.items():
        G = evidence.keys.get(owner)
        W = evidence.W[client][evidence.parts[owner]]
        cells = W.rows * W.cols if isinstance(W, Rows) else W.numel()
        if (
            G is None
            or tail.method not in BOUNDS
            or tail.log10_p <= math.log10(floor)
            or cells > SHIFT_MAX_CELLS
        ):
            continue
        p, _ = shifted_keys_p(
            W.block(0, W.rows) if isinstance(W, Rows) else W.cpu().numpy(),
            G.numpy(),
            [seed, client, owners.index(owner), 0x5E1F],
            max_keys=math.ceil(1.0 / floor),
        )
        out[(client, owner)] = Tail(math.log10(min(1.0, p + floor)), "shifted-keys")
    return out


def _client_owner(
    evidence: Evidence,
    client: int,
    owner: str,
    watermarked: bool | None,
    level: float,
    ranks: Mapping[str, Mapping[int, np.ndarray]],
    tail: Tail | None,
    name_uncalibrated: bool,
) -> ClientAttribution:
    """One (client, owner) row: its statistic, p, rank p and whether it names the client."""
    z = dict(evidence.per_round.get(client, {}).get(owner, {}))
    part = evidence.parts[owner]
    W = evidence.W.get(client, {}).get(part)
    valid = evidence.valid.get(owner, True) and client not in evidence.cross_talk
    if W is None or tail is None:
        return ClientAttribution(
            id=client,
            z=z,
            Z=0.0,
            p=1.0,
            log10_p=0.0,
            flagged=False,
            watermarked=watermarked,
            statistic=owner,
            p_rank=None,
            tail=None,
            calibrated=valid,
        )
    law = law_from_dict(evidence.laws[part])
    value = evidence.values[client][owner]
    sd = math.sqrt(law.variance(W))
    score = value / sd if sd > 0 else 0.0
    p_rank = None
    null = ranks.get(part, {}).get(client)
    if null is not None:
        p_rank = (1 + int(np.sum(null >= value))) / (len(null) + 1)
    named = tail.log10_p < math.log10(level) and (valid or name_uncalibrated)
    return ClientAttribution(
        id=client,
        z=z,
        Z=score,
        p=tail.p,
        log10_p=tail.log10_p,
        flagged=named,
        watermarked=watermarked,
        statistic=owner,
        p_rank=p_rank,
        tail=tail.method,
        calibrated=valid,
    )
