"""Step 1 over one round: its models read into key-linear changes and handed to the sums.

The reference, every target's model (each client's own update where the plan undoes cross-talk
on the estimates) and, where cross-talk is not undone, the SA mean's model are read in one
pass (:func:`~fedattr.attribution.scoring.observe_each`); each reading is made into its change
(:meth:`~fedattr.attribution.contract.LinearKeyScorer.change`) as soon as it is read and then
dropped, and the round goes to :meth:`~.sums.CalibratedNull.add_round` with its plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

from ...updates import scale_update
from ..config import AttributionConfig
from ..contract import LinearKeyScorer, SpreadReporter, SteppedReading
from ..scoring import ApplyUpdate, observe_each
from .plan import RoundPlan, undo_updates
from .sums import CalibratedNull
from .weights import taper_weights


@dataclass(frozen=True)
class RoundRead:
    """What reading one round gave."""

    display: dict[int, dict[str, float]]
    """Target -> owner -> the round's standardised statistic (for display)."""
    contexts: list[float]
    """Per target (in order): over how many contexts its change is spread, where the detector
    says (:class:`~fedattr.attribution.contract.SpreadReporter`); else empty."""
    models: int
    """Models read: the reference, one per target, and the SA mean's where it was needed."""


def read_round(
    sums: CalibratedNull,
    plan: RoundPlan,
    updates: Sequence[Any],
    reference: Any,
    scorer: LinearKeyScorer,
    apply: ApplyUpdate,
    center: Any,
    *,
    config: AttributionConfig,
    mean_row: bool = True,
) -> RoundRead:
    """Read round ``plan`` (its targets' estimates ``updates``, the SA mean ``center``) with
    ``scorer`` into ``sums``. ``config``: the reading step and the taper; ``mean_row``: whether
    the SA mean is every participant's (no dropouts: de-mixing may stack it)."""
    # The SA mean only matters where the round's cross-talk cannot be undone: not read
    # otherwise.
    if not plan.reads_center:
        center = None
    extra = [] if center is None else [center]
    # Cross-talk undone on the estimates (attribution.calibrated.undo = "updates"): each model
    # read is w + Delta_i itself, made as it is read.
    updates = undo_updates(plan, updates)
    cal = config.calibrated
    step = cal.reading_step
    if step is None:
        step = scorer.reading_step if isinstance(scorer, SteppedReading) else 1.0
    # The reference, every candidate and the SA mean: one batched read when the scorer
    # offers it (else lazily, one candidate's parameters at a time). Scaled as each model is
    # built (not all up front): a lazy read holds one candidate.
    reads = observe_each(
        scorer,
        chain(
            [reference],
            (
                apply(reference, u if step == 1.0 else scale_update(u, step))
                for u in chain(updates, extra)
            ),
        ),
    )
    ref_obs = next(reads)
    # Before the candidates are read: its float64 temporaries then sit beside no change.
    weights = sums.round_weights(
        plan.round, lambda: taper_weights(scorer, ref_obs, cal.taper, cal.taper_from)
    )
    # Each reading made into its change as soon as it is read and then dropped: a round
    # holds its changes, not its readings too (11 x 54 MB each at SmolLM2's 275 contexts).
    # A round read by rows keeps its changes on disk as they are made (spilled sums).
    laws = scorer.key_laws()
    contexts, changes = [], []
    for k, obs in enumerate(reads):
        if isinstance(scorer, SpreadReporter) and k < len(updates):
            contexts.append(scorer.effective_contexts(ref_obs, obs))
        change = scorer.change(ref_obs, obs)
        if step != 1.0:  # read at w + step * estimate: per unit of the estimate
            change = {part: v / step for part, v in change.items()}
        del obs
        changes.append(sums.hold(plan.round, str(k), change, laws) if plan.by_rows else change)
        del change
    del reads, updates, extra  # every model is read: the undone updates are not kept
    middle = changes.pop() if center is not None else None
    try:
        display = sums.add_round(plan, changes, middle, scorer, weights=weights, mean_row=mean_row)
    finally:
        if plan.by_rows:
            sums.release(plan.round)
    return RoundRead(display, contexts, 1 + len(changes) + (middle is not None))
