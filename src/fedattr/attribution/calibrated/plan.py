"""How one round is read: decided once, from the round's public designs and the settings.

A round's cross-talk is undone when every participant is a target and the design is well conditioned
(:func:`~.crosstalk.cross_talk`); where it is, it is undone either on the estimates
(``attribution.calibrated.undo = "updates"``: each model read is the client's own update) or on the
read changes (``"changes"``); where it is not, the round is centred on its SA mean and, in hardened
mode, stacked for de-mixing across rounds. :class:`RoundPlan` holds those decisions and ``A^{-1}``;
every step that reads the round takes the plan instead of deciding again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..design import QueryDesign
from .crosstalk import UndoneUpdates, cross_talk


@dataclass(frozen=True, eq=False)
class RoundPlan:
    """How one round is read (key-free: a function of its designs and the settings alone)."""

    round: int
    participants: tuple[int, ...]
    targets: tuple[int, ...]
    designs: tuple[QueryDesign, ...]
    """The targets' designs as SA answered them (what de-mixing stacks)."""
    inverse: np.ndarray | None = None
    """``A^{-1}`` (targets x targets) where the round's cross-talk is undone, else ``None``."""
    on_updates: bool = False
    """Cross-talk undone on the estimates themselves (``attribution.calibrated.undo =
    "updates"``): each change read is its client's own already, and nothing is left to undo on
    the changes."""
    by_rows: bool = False
    """Standardised a block of rows at a time into sums on disk (spilled sums and a detector
    that reads its owners by rows); a round de-mixed across rounds is kept whole."""
    demix: bool = False
    """Cross-talk kept and the round stacked for de-mixing across rounds (hardened mode,
    ``attribution.calibrated.across_rounds = "demix"``)."""
    centred: bool = True
    """Whether the round's changes are centred by a centre made of its clients (the cell-wise
    median where cross-talk is undone, else the SA mean's change): only in a round whose
    reference no client's update has reached, by default (``attribution.calibrated.centre``)."""

    @property
    def undone(self) -> bool:
        """Whether the round's cross-talk is undone (on the estimates or on the changes): the
        round's centre, where it has one, is then the cell-wise median over its clients."""
        return self.inverse is not None

    @property
    def on_changes(self) -> np.ndarray | None:
        """``A^{-1}`` where it is applied to the read changes, else ``None``."""
        return None if self.on_updates else self.inverse

    @property
    def reads_center(self) -> bool:
        """Whether the round needs its SA mean's change: only where cross-talk is not undone
        (else the caller need not read that model)."""
        return not self.undone


def plan_round(
    round_id: int,
    participants: Sequence[int],
    targets: Sequence[int],
    designs: Sequence[QueryDesign],
    *,
    decorrelate: bool = True,
    undo: str = "changes",
    across_rounds: str = "demix",
    by_rows: bool = False,
    centred: bool = True,
) -> RoundPlan:
    """The plan of one round. ``undo``: where cross-talk is undone (``updates``: the caller
    builds each model from :func:`undo_updates`); ``by_rows``: whether spilled sums and the
    detector allow reading the round by rows (the plan reads it so unless it is de-mixed);
    ``centred``: whether the round subtracts a centre made of its clients."""
    A = cross_talk(participants, targets, designs, decorrelate)
    inverse = np.linalg.inv(A) if A is not None else None
    undone = inverse is not None
    return RoundPlan(
        round=round_id,
        participants=tuple(participants),
        targets=tuple(targets),
        designs=tuple(designs),
        inverse=inverse,
        on_updates=undone and undo == "updates",
        by_rows=by_rows and (across_rounds != "demix" or undone),
        demix=not undone and across_rounds == "demix",
        centred=centred,
    )


def undo_updates(plan: RoundPlan, updates: Sequence[Any]) -> Sequence[Any]:
    """The updates the round's models are built from: each target's own update,
    ``A^{-1}`` applied to the estimates themselves, where the plan undoes cross-talk on them
    (formed as each is read, :class:`~.crosstalk.UndoneUpdates`); else the estimates.

    Undoing cross-talk on the changes instead (``A^{-1}`` over the read changes) is exact only
    for the part of a change that is linear in the estimate: read as applied, a curved detector
    (a softmax) keeps second-order traces of the other clients' updates in each recovered
    change, and loses part of the client's own. Undone here, every model read is
    ``w^{t-1} + Delta_i`` exactly (up to float rounding), as a perfect estimator would give.
    This reveals nothing the released estimates do not already determine jointly: ``A`` is
    invertible exactly when they do (Finding 1)."""
    if not plan.on_updates or plan.inverse is None:
        return updates
    return UndoneUpdates(plan.inverse, updates)
