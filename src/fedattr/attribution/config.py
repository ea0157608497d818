"""FedAttr's settings (the ``[attribution]`` section and its ``protocol``, ``calibrated`` and
``paper`` sections) and the hardened-mode default budget."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import numpy as np

from ..config import check_literal
from ..secagg.config import SecAggConfig
from .design import DesignError, single_estimate_budget


@dataclass
class ProtocolConfig:
    """How each target's estimate is asked of secure aggregation: the subset design, the mode
    and the SA queries."""

    mode: Literal["paper", "hardened", "sealed"] = "paper"
    """``paper``: 2M subset-sum queries per target, every target every round (as published).
    ``hardened``: one fused query per target, and only targets the SA release policy admits
    (rotating, seeded order); the statistic reads each client's targeted rounds only.
    ``sealed``: no subset sum at all; each update is held as additive shares by two
    non-colluding servers, which read its first-order change on their shares and open only
    the round's aggregate and, at the end, each (client, owner)'s verdict statistics to that
    owner (``[attribution.sealed]``, :mod:`fedattr.attribution.sealed`)."""
    N: int = 5
    """Size of the V-subsets (U-subsets have N+1 members)."""
    M: int = 5
    """Query pairs per target and round."""
    queries: Literal["subsets", "fused"] = "subsets"
    """How a target's estimate is asked of SA in ``paper`` mode. ``subsets`` (the paper): its
    ``2M`` subset sums, averaged by the server. ``fused``: one SA session for the combination
    ``sum_j (c_j / M) Delta_j`` with the design's integer coefficients, which is the same
    estimate (exact ring arithmetic instead of averaging decoded sums: equal up to float
    rounding) while the subset sums behind it are never released. ``hardened`` mode always
    fuses."""
    policy_attempts: int = 20
    """Designs tried per target (after release-policy refusals or failed queries) before the
    target is skipped for the round."""
    max_redraws: int = 10_000
    """Give up on a target after this many rejected designs in a row."""

    def __post_init__(self) -> None:
        check_literal(self, "attribution.protocol", DesignError)
        for name, least in (("N", 1), ("M", 1), ("policy_attempts", 1), ("max_redraws", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise DesignError(
                    f"attribution.protocol.{name}: must be an integer >= {least}, got {value!r}"
                )


@dataclass
class CalibratedConfig:
    """The calibrated statistic: each client's change read with the owner's key, exact p-values
    under a random key, a family-wise level ``alpha`` (see
    :mod:`fedattr.attribution.calibrated`)."""

    alpha: float = 0.01
    """Family-wise level over clients x owners: a client is named when its Bonferroni-adjusted
    p is below ``alpha / K``."""
    null_keys: int = 200
    """Random keys that read each client's summed change once at the end, a check of the exact
    tail (``p_rank``, resolution ``1 / (null_keys + 1)``); 0 skips it."""
    name_uncalibrated: bool = False
    """Also name clients by p-values that are not calibrated (FK reading every round,
    ``late_rounds = "read"``: its key is not exchangeable with a random one once the reference
    model has learned the owner's facts; clients whose rounds kept cross-talk); by default they
    are reported, marked uncalibrated, and never named."""
    reading_step: float | None = None
    """Read ``w^{t-1} + s * Delta_hat_i`` (and the SA mean's likewise) and divide each change by
    ``s``. 1 reads the estimate as applied. A small ``s`` reads the change's first-order part,
    which is linear in the estimate, so undoing cross-talk with the design matrix is exact; read
    as applied, a detector that saturates (FK: a learned fact's log-probability) leaves
    second-order traces of the other clients' updates, watermarked ones included, in a clean
    client's change. ``None``: the detector's own (FK 0.01, KGW 1)."""
    late_rounds: Literal["read", "skip"] = "read"
    """The rounds after the first, whose reference model may have learned an owner's key from
    the watermarked clients (a detector says how many rounds read its key as exchangeable with a
    random one: 1 for KGW and FK). ``read``: read them too, with nothing made of the other
    clients' changes or of that reference (see ``centre`` and ``cell_weights``): a clean
    client's reading then depends on the key only through its own reaction to the reference,
    forgetting, which reads against the key. ``skip``: read round 1 only, whose p-values are
    exact (less evidence)."""
    centre: Literal["first", "none", "every"] = "first"
    """The centre subtracted from each client's change before it is read. ``first``: the
    cell-wise median over the round's clients in round 1 only, whose reference model is the base
    model that no client's update has reached (a key-free centre that a minority of watermarked
    clients barely moves). From round 2 the reference may have learned a key and every client's
    change depends on it (a clean client forgets what the reference learned), so a centre made
    of the other clients' changes would carry their forgetting into each reading and a client
    that updates less than the median (a free-rider, a straggler, a small shard) would read as
    evidence: later rounds are read uncentred (rows are still centred). ``none``: no centre in
    any round. ``every``: the round's median in every round (its later rounds are not calibrated
    once the reference has learned a key)."""
    cell_weights: Literal["first", "round"] = "first"
    """With KGW: where the key-free cell weights (``taper``, ``spread``) come from. ``first``:
    round 1's (the base model's probabilities, round 1's clients' spread), kept for every later
    round. ``round``: each round's own reference model and clients' spread, which from round 2
    depend on what the reference learned (later rounds then uncalibrated)."""
    taper: float = 0.5
    """With KGW: read each cell of a change with weight ``min(1, taper_from / p) ** taper``,
    ``p`` its token's probability under the round's reference model (key-free: the exact tail
    still holds), in [0, 2]. 0.5 reads a likely token's change over ``sqrt(p)``, the
    Fisher-information scale of a probability, where it is mostly the client's drift rather than
    a key's signal; 0 reads every cell alike (see
    :func:`~fedattr.attribution.calibrated.weights.taper_weights`)."""
    taper_from: float = 0.01
    """With KGW: the probability above which ``taper`` lowers a cell's weight (below it every
    cell keeps weight 1), in (0, 1]."""
    spread: float = 0.25
    """With KGW, rounds read within the round (paper mode; not the de-mixed reading of hardened
    mode): after centring, read each cell with weight ``max(S, S_row) ** -spread``, ``S`` the
    median over the round's clients of the cell's centred change (its spread: large where every
    client drifts, on likely tokens and common contexts) and ``S_row`` its row's median ``S`` (a
    floor), in [0, 1]. A function of every client's change and of no key, as the cell-wise
    median that centres it; 0 reads every cell as the taper leaves it (see
    :func:`~fedattr.attribution.calibrated.weights.spread_weights`)."""
    token_centring: bool = False
    """With KGW: remove from each client's change what it does to a token in every context alike
    (drift towards frequent tokens, which no per-context green list is aligned with) before it is
    read with the key. Key-free, so the exact tail still holds."""
    few_cells: Literal["shifted-keys", "bound"] = "shifted-keys"
    """Where a change sits on few cells and the analytic tail is only an upper bound
    (``patterns``, ``chernoff``; 2-4x above the tail): ``shifted-keys`` reads p by a
    randomization test over the owner's key shifted row by row, exact at any number of keys,
    where the detector lends the key (KGW reading; not ``--reread`` or owner scoring, which keep
    the bound); ``bound`` keeps the bound (see
    :func:`~fedattr.watermarks.tail.methods.shifted_keys_p`)."""
    decorrelate: bool = True
    """When every participant is a target of the round, undo cross-talk with the known design
    matrix (each client's own statistic per key, from its estimates only)."""
    undo: Literal["updates", "changes"] = "updates"
    """Where cross-talk is undone: ``updates`` applies the inverse design matrix to the round's
    estimates and reads each client's own update (exact whatever the detector's curvature; it
    reveals nothing the estimates do not already determine jointly); ``changes`` applies it to
    the read changes instead, exact only for their part that is linear in the estimate (see
    ``reading_step``)."""
    across_rounds: Literal["demix", "keep"] = "demix"
    """For rounds whose cross-talk cannot be undone within the round (hardened mode: one fused
    query per admitted target). ``demix``: stack every such round's changes with their known
    design rows and solve, per client, for its mean change over rounds by generalised least
    squares (``F m = sum_t A_t^+ Y_t``, as the cross-round audit does for the updates), then
    read that de-mixed change with the owner's key against its exact tail: the watermarked
    clients' persistent signal is removed from every other client's change, so those clients are
    calibrated and named (a client whose mean the stacked rounds do not identify gets no
    evidence and is reported uncalibrated). It reveals nothing the released answers do not
    already determine (see ``fedattr audit --cross-round``). ``keep``: sum each round's mixed
    change; such clients are then uncalibrated and named only under ``name_uncalibrated``. Owner
    scoring (``attribution.scoring = "owner"``, ``fedattr attribute``) always keeps: its rounds
    are combined from the owners' per-round scores."""
    late_demix: Literal["uncalibrated", "read"] | None = None
    """The de-mixed evidence (``across_rounds = "demix"``) once a stacked round's reference
    model may have learned a key (past the detector's exchangeable rounds: round 2 on for KGW
    and FK). A clean client's de-mixed change carries the other clients' round-to-round changes
    with known coefficients of either sign; from round 2 those depend on the key (clean clients
    forget it by amounts that vary from round to round, watermarked clients learn it), so no
    argument bounds its level. ``uncalibrated``: reported, marked uncalibrated and named only
    under ``name_uncalibrated``. ``read``: read against the exact tail as calibrated. ``None``
    (default): ``uncalibrated`` in hardened mode, where every round is de-mixed (on a bed with
    half the clients a round it named a wrong pair in half the runs); ``read`` in paper mode,
    where only rounds with dropouts are, and each client that answered such a round is a target
    with a design over the clients that answered: the round identifies its change exactly, so
    its de-mixed mean is its own change, with none of the other clients' in it."""
    spill: bool = False
    """Keep each client's summed change on disk (float32, a temporary folder) rather than in
    memory (float64), and standardise each round a block of rows at a time from its changes,
    written to disk as they are read, so the verdict's memory does not grow with clients x
    contexts x vocabulary (:mod:`fedattr.rows`). Its p-values agree with the in-memory sums' to
    about 1e-6 in ``log10 p`` (float32 sums); the rank check draws its keys by rows (other keys
    of the same law)."""

    def __post_init__(self) -> None:
        check_literal(self, "attribution.calibrated", DesignError)
        key = "attribution.calibrated"
        if not 0.0 < self.alpha < 1.0:
            raise DesignError(f"{key}.alpha: must be in (0, 1), got {self.alpha!r}")
        step = self.reading_step
        if step is not None and not (isinstance(step, int | float) and 0 < step <= 1):
            raise DesignError(f"{key}.reading_step: must be in (0, 1], got {step!r}")
        if not (isinstance(self.taper, int | float) and 0.0 <= self.taper <= 2.0):
            raise DesignError(f"{key}.taper: must be in [0, 2], got {self.taper!r}")
        if not (isinstance(self.spread, int | float) and 0.0 <= self.spread <= 1.0):
            raise DesignError(f"{key}.spread: must be in [0, 1], got {self.spread!r}")
        if not (isinstance(self.taper_from, int | float) and 0.0 < self.taper_from <= 1.0):
            raise DesignError(f"{key}.taper_from: must be in (0, 1], got {self.taper_from!r}")
        if not isinstance(self.null_keys, int) or self.null_keys < 0:
            raise DesignError(f"{key}.null_keys: must be an integer >= 0, got {self.null_keys!r}")


@dataclass
class PaperConfig:
    """The paper's statistic: each round's differential scores, Stouffer over a client's rounds,
    a client flagged when its Z exceeds ``threshold``."""

    threshold: float = 4.0
    """Flag a client when its Stouffer Z exceeds this (the paper's gamma; also the baselines'
    rule and the line of the calibrated statistic's per-round display)."""
    null: Literal["auto", "theoretical", "empirical"] = "auto"
    """``theoretical`` (the paper): each differential score is taken as N(0, 1) under the null.
    ``empirical``: each round's scores per statistic are standardised by their median and MAD
    over the round's targets before Stouffer (see ``stouffer.empirical_null``). ``auto``:
    empirical for a scorer whose statistic has no null scale of its own (it says so with
    ``null = "empirical"``, e.g. the FK margin), theoretical otherwise."""
    mean_reference: bool = False
    """``False`` (the paper): score ``w^{t-1} + Delta_hat_i`` against ``w^{t-1}``. ``True``:
    score ``w^{t-1} + Delta_bar + (Delta_hat_i - Delta_bar)`` against ``w^{t-1} + Delta_bar``
    (``Delta_bar`` = the round's SA mean), so that the round's common learning direction is in
    both models and only the client's deviation from it is tested."""

    def __post_init__(self) -> None:
        check_literal(self, "attribution.paper", DesignError)
        if not np.isfinite(self.threshold):
            raise DesignError(
                f"attribution.paper.threshold: must be a finite number, got {self.threshold!r}"
            )


@dataclass
class SealedConfig:
    """The sealed mode (``attribution.protocol.mode = "sealed"``): what the shares and the
    verdict's openings are made of (:mod:`fedattr.attribution.sealed`)."""

    mask_scale: float = 100.0
    """Each client's reading shares are ``(u + R, -R)``, ``R`` Gaussian with a standard
    deviation per coordinate of ``mask_scale`` times the root mean square of the round's
    reference adapter (public, never of an update), so a server's share is the update under
    noise that much larger than the model's own factors. Larger hides more; the first-order
    reading of a share is exact to float32 rounding, ``1e-7 x mask_scale`` of the update's
    reading, so above ~1e4 that rounding is noise in every change (key-free: the verdict's
    level is kept, its power is not)."""
    random_keys: int = 0
    """Random keys (exact draws of the owners' key law) against which each owner's value is
    ranked: the p-value is ``(1 + #{keys reading at least as high}) / (random_keys + 1)``,
    exact at any number. 0: the smallest ``2^n - 1`` whose resolution reaches the family-wise
    level ``alpha / (clients x owners)`` (4,095 for 10 clients and 3 owners). The owner sees
    this many values per client, linear in the client's summed change."""
    frac_bits: int = 32
    """Fixed-point fractional bits of the changes' ring shares in the owner-key inner products
    (Beaver triples), in 16..40."""

    def __post_init__(self) -> None:
        key = "attribution.sealed"
        scale = self.mask_scale
        if not (isinstance(scale, int | float) and math.isfinite(scale) and scale > 0):
            raise DesignError(f"{key}.mask_scale: must be a number > 0, got {scale!r}")
        keys = self.random_keys
        if not isinstance(keys, int) or isinstance(keys, bool) or keys < 0:
            raise DesignError(f"{key}.random_keys: must be an integer >= 0 (0: auto), got {keys!r}")
        bits = self.frac_bits
        if not isinstance(bits, int) or isinstance(bits, bool) or not 16 <= bits <= 40:
            raise DesignError(f"{key}.frac_bits: must be an integer in 16..40, got {bits!r}")

    def keys_for(self, level: float) -> int:
        """The random keys a verdict at per-pair ``level`` reads (``random_keys``, or auto)."""
        if self.random_keys:
            return self.random_keys
        # 2^j > 1 / level: a client above every key reads p = 2^-j, below the level.
        return (1 << max(4, math.floor(math.log2(1.0 / level)) + 1)) - 1


@dataclass
class AttributionConfig:
    """FedAttr: which statistic reads the estimates and where it runs, with a section per
    concern: the SA query protocol (``protocol``), the calibrated statistic (``calibrated``) and
    the paper's (``paper``)."""

    ALIASES: ClassVar[dict[str, str]] = {
        **{k: f"protocol.{k}" for k in ("mode", "N", "M", "queries", "policy_attempts")},
        "max_redraws": "protocol.max_redraws",
        **{
            k: f"calibrated.{k}"
            for k in (
                "alpha",
                "null_keys",
                "name_uncalibrated",
                "reading_step",
                "late_rounds",
                "centre",
                "cell_weights",
                "taper",
                "taper_from",
                "spread",
                "token_centring",
                "few_cells",
                "decorrelate",
                "undo",
                "across_rounds",
                "spill",
            )
        },
        "gamma": "paper.threshold",
        "null": "paper.null",
        "center": "paper.mean_reference",
    }
    """The flat keys before the sections (old key -> its place now): still read, with a note."""

    statistic: Literal["calibrated", "paper"] = "calibrated"
    """``calibrated`` (default): each client's change read with the owner's key, exact p-values
    under a random key and a family-wise level (``[attribution.calibrated]``). ``paper``: the
    published statistic, Stouffer over per-round scores read as N(0, 1) (or the empirical null),
    flag ``Z > threshold`` (``[attribution.paper]``)."""
    scoring: Literal["server", "owner"] = "server"
    """``server``: the server scores with the owners' keys (the simulation plays every party).
    ``owner``: the server holds no key; it exports each round's reference and estimates for the
    owners (``<run>/rounds/``), who score them (``fedattr owner score``); ``fedattr attribute``
    combines their scores into the run's results (calibrated statistic only)."""
    overlap: bool = False
    """Score round ``t`` in the background while the clients train round ``t + 1`` (the
    paper's suggestion; the SA queries still run while SA holds round ``t``). The scorer then
    reads a copy of the model. Same results; a checkpoint is written once a round's scores
    are in."""
    seed: int = 0
    """Seed of the design draws (each round and target gets its own stream) and of the
    calibrated statistic's random keys (its rank check)."""
    protocol: ProtocolConfig = field(default_factory=ProtocolConfig)
    """The paper's defaults: N = M = 5, 2M subset sums per target, every target every round."""
    calibrated: CalibratedConfig = field(default_factory=CalibratedConfig)
    """Read where ``statistic = "calibrated"`` (the default)."""
    paper: PaperConfig = field(default_factory=PaperConfig)
    """Read where ``statistic = "paper"``; its ``threshold`` is also the baselines' rule."""
    sealed: SealedConfig = field(default_factory=SealedConfig)
    """Read where ``protocol.mode = "sealed"``."""

    def __post_init__(self) -> None:
        check_literal(self, "attribution", DesignError)
        if self.protocol.mode == "sealed" and (
            self.statistic != "calibrated" or self.scoring != "server" or self.overlap
        ):
            raise DesignError(
                "attribution.protocol.mode=sealed: needs statistic=calibrated, scoring=server "
                f"and overlap=false (got statistic={self.statistic!r}, "
                f"scoring={self.scoring!r}, overlap={self.overlap!r})"
            )
        if self.scoring == "owner" and self.statistic != "calibrated":
            # refused with the settings, not once the run has reached its first round
            raise DesignError(
                f"attribution.scoring=owner: needs attribution.statistic=calibrated (owners "
                f"return key statistics, not the paper's z), got statistic={self.statistic!r}"
            )


def harden(attribution: AttributionConfig, secagg: SecAggConfig, K: int) -> SecAggConfig:
    """The SA settings hardened mode runs with: without an explicit ``release_budget``, the
    paper's single-estimate bound at (K, N, M), so that no client leaks more jointly than one
    accepted estimate may alone. Paper mode, or an explicit budget, returns ``secagg`` as is."""
    if attribution.protocol.mode == "hardened" and secagg.release_budget == 0:
        p = attribution.protocol
        budget = single_estimate_budget(K, p.N, p.M)
        return dataclasses.replace(secagg, release_budget=budget)
    return secagg
