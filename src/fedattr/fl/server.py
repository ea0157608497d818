"""The round engine: the one place a federated round is run (after Flower's ``server/workflow``).

Per round the engine samples participants, opens a secure-aggregation round, has the client
pool train and submit, takes the round's aggregate from SA (training needs it whatever a
release policy admits later), then calls every observer with the round open (attribution,
baselines), moves the global state on with the server strategy, closes the SA round and calls
the observers again (progress, checkpoints). The order is fixed here, so no caller can take
the aggregate after attribution or score against the wrong reference.

Everything that watches a run is an :class:`Observer`; several may watch one training run (two
FedAttr configurations, the baselines, a checkpointer), so a parameter that only affects
attribution is measured without retraining.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..secagg.aggregator import SecureAggregator
from ..updates import Update
from .pool import ClientPool
from .progress import Progress
from .strategy import ServerStrategy
from .timing import Stopwatch


@dataclass
class RoundContext:
    """What observers see of one round (SA still open in ``round_opened``)."""

    round: int
    rounds: int
    participants: list[int]
    answered: tuple[int, ...]
    """Participants whose updates are in the aggregate (all of them without dropouts)."""
    sa: SecureAggregator
    reference: Any
    """Scoring parameters of the global model w^{t-1} the round started from."""
    mean_update: Update
    """The round's SA mean (sample-weighted over ``answered``)."""
    apply: Callable[[Any, Update], Any]
    """How an update is applied to ``reference`` (the server strategy's ``apply_estimate``)."""
    losses: dict[int, float]
    timing: Stopwatch
    progress: Progress


@dataclass
class RunEnd:
    """What observers see when the last round is done."""

    state: Any
    reference: Any
    """Scoring parameters of the final global model."""
    timing: Stopwatch
    progress: Progress


class Observer:
    """Watches an engine run; override what you need. ``name`` keys its checkpoint state."""

    name: str = "observer"

    def attach(self, engine: RoundEngine) -> None:
        """Called once when the engine is built."""

    def round_opened(self, ctx: RoundContext) -> None:
        """SA holds this round's updates and the aggregate is known."""

    def round_closed(self, ctx: RoundContext) -> None:
        """The global state has moved on and the SA round is closed."""

    def run_finished(self, end: RunEnd) -> None:
        """Every round is done."""

    @property
    def busy(self) -> bool:
        """Whether work of a past round still runs in the background (see :meth:`settle`)."""
        return False

    def settle(self) -> None:
        """Finish background work of past rounds. The engine calls it once the next round's
        clients have trained (before any ``round_opened``) and before ``run_finished``."""

    def settled(self) -> None:
        """Every observer has settled (see :class:`Checkpointer`)."""

    def state(self) -> Any:
        """What to checkpoint (``None``: nothing)."""
        return None

    def load(self, state: Any) -> None:
        """Restore :meth:`state` when a run resumes."""


class Checkpointer(Observer):
    """Saves the engine's snapshot after every round through ``save`` (e.g. a run folder's).

    While an observer still works on the round in the background, the engine's part of the
    snapshot is taken at the round's end and written with the observers' states once they
    have settled (after the next round's training): a checkpoint never holds half a round.
    """

    name = "checkpoint"

    def __init__(self, save: Callable[[dict], None]) -> None:
        self.save = save
        self.engine: RoundEngine | None = None
        self._waiting: dict | None = None

    def attach(self, engine: RoundEngine) -> None:
        self.engine = engine

    def round_closed(self, ctx: RoundContext) -> None:
        assert self.engine is not None
        if any(o.busy for o in self.engine.observers):
            self._waiting = self.engine.snapshot(observers=False)
        else:
            self.save(self.engine.snapshot())

    def settled(self) -> None:
        assert self.engine is not None
        if self._waiting is not None:
            snapshot, self._waiting = self._waiting, None
            timing = snapshot["timing"]
            for part, added in self.engine.settled_work.items():
                timing[part] = {
                    k: timing[part].get(k, 0) + added.get(k, 0) for k in {*timing[part], *added}
                }
            self.save({**snapshot, "observers": self.engine.observer_states()})


@dataclass
class RoundSummary:
    """The engine's own record of a round."""

    round: int
    participants: list[int]
    answered: list[int]
    losses: dict[int, float] = field(default_factory=dict)


def _mean(total: Update, weight: float) -> Update:
    if isinstance(total, Mapping):
        return {k: v / weight for k, v in total.items()}
    return total / weight


class RoundEngine:
    """Runs ``rounds`` federated rounds of ``pool`` under ``server`` through ``sa``."""

    def __init__(
        self,
        pool: ClientPool,
        server: ServerStrategy,
        sa: SecureAggregator,
        observers: Sequence[Observer] = (),
        *,
        rounds: int,
        per_round: int | None = None,
        seed: int = 0,
        timing: Stopwatch | None = None,
        progress: Progress | None = None,
    ) -> None:
        names = [o.name for o in observers]
        if len(set(names)) != len(names):
            raise ValueError(f"observers: names must be unique, got {names}")
        self.pool, self.server, self.sa = pool, server, sa
        self.observers = list(observers)
        self.rounds = rounds
        self.per_round = per_round or pool.num_clients
        self.rng = np.random.default_rng([seed, 11])
        self.timing = timing or Stopwatch()
        self.progress = progress or Progress()
        self.history: list[RoundSummary] = []
        self.queries: list[dict] = []
        """Every answered SA query of the run (coefficients, never results)."""
        self.state: Any = None
        self.settled_work: dict = {"seconds": {}, "counts": {}}
        """Stage seconds and counts the last :meth:`_settle` added (background work)."""
        self.round = 0
        """The last finished round."""
        for o in self.observers:
            o.attach(self)

    def snapshot(self, observers: bool = True) -> dict:
        """Everything needed to continue after :attr:`round` (for checkpoints); the engine's
        part alone (copies, so later rounds do not change it) with ``observers=False``."""
        out = {
            "round": self.round,
            "state": self.state,
            "history": list(self.history),
            "queries": list(self.queries),
            "rng": self.rng.bit_generator.state,
            "timing": self.timing.state(),
        }
        if observers:
            out["observers"] = self.observer_states()
        return out

    def observer_states(self) -> dict:
        """Every observer's checkpoint state by name."""
        return {o.name: o.state() for o in self.observers}

    def _settle(self) -> None:
        before = self.timing.state()
        for o in self.observers:
            o.settle()
        after = self.timing.state()
        # What settling added (the past round's background work), for deferred checkpoints.
        self.settled_work = {
            part: {k: v - before[part].get(k, 0) for k, v in after[part].items()}
            for part in ("seconds", "counts")
        }
        for o in self.observers:
            o.settled()

    def restore(self, snapshot: Mapping) -> None:
        """Continue from :meth:`snapshot` (the configuration must be the same)."""
        self.round, self.state = snapshot["round"], snapshot["state"]
        self.history, self.queries = snapshot["history"], snapshot["queries"]
        self.rng.bit_generator.state = snapshot["rng"]
        self.timing.load(snapshot["timing"])
        for o in self.observers:
            o.load(snapshot["observers"].get(o.name))

    def run(self, initial_state: Any) -> RunEnd:
        """Run the remaining rounds (all of them unless :meth:`restore` was called)."""
        if self.round == 0:
            self.state = initial_state
        else:
            self.progress(f"resuming after round {self.round} of {self.rounds}")
        for t in range(self.round + 1, self.rounds + 1):
            self._round(t)
        self._settle()
        end = RunEnd(self.state, self.server.scoring_params(self.state), self.timing, self.progress)
        for o in self.observers:
            o.run_finished(end)
        return end

    def _round(self, t: int) -> None:
        sa, K = self.sa, self.pool.num_clients
        participants = sorted(int(c) for c in self.rng.choice(K, self.per_round, replace=False))
        scales = self.pool.scales(participants)
        sa.open_round(t, participants)
        with self.timing.measure("train_s"):
            losses = self.pool.train_round(
                t, participants, self.state, sa, scales, self.progress, timing=self.timing
            )
        # The round's aggregate first: training needs it whatever the release policy admits.
        with self.timing.measure("sa_s"):
            total, answered = sa.sum_of_available(participants)
            # Clients submitted n * p_i * Delta_i: dividing by the answering clients' sum of
            # n * p_i gives the sample-weighted mean over whoever answered.
            mean_update = _mean(total, sum(scales[c] for c in answered))
        ctx = RoundContext(
            t,
            self.rounds,
            participants,
            answered,
            sa,
            self.server.scoring_params(self.state),
            mean_update,
            self.server.apply_estimate,
            losses,
            self.timing,
            self.progress,
        )
        # Work on the previous round that ran beside this round's training ends here.
        self._settle()
        for o in self.observers:
            o.round_opened(ctx)
        self.state = self.server.aggregate(self.state, mean_update)
        sa.close_round()
        self.queries.extend(q.to_dict() for q in sa.log)
        sa.log.clear()
        self.history.append(RoundSummary(t, participants, list(answered), losses))
        self.round = t
        for o in self.observers:
            o.round_closed(ctx)
