"""The in-process client pool: every client's local LoRA training runs in this process."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..models.batched import (
    ClientJob,
    ClientResult,
    clients_at_once,
    train_clients,
    worth_training_together,
)
from ..models.lora import adapter_state, can_stack, load_state, trainable_lora_parameters
from ..models.text import Example
from ..models.training import TrainSettings, train
from ..runtime import release_memory
from ..secagg.aggregator import SecureAggregator
from ..updates import scale_update
from .clients import Profiles, profiles_of
from .node import scaled_update, train_seed, untrained_stats
from .pool import ClientPool, PlaintextTap, require_usable_examples
from .progress import Progress
from .strategy import ClientStrategy
from .timing import Stopwatch

if TYPE_CHECKING:
    from .config import FLConfig


class InProcessPool(ClientPool):
    """Clients that share one model object and train in this process.

    Each client starts from the global state (``strategy.start``), trains on its own examples
    with a seed fixed by (run seed, round, client), and submits only its scaled update, on the
    CPU in float32, to secure aggregation. An open :class:`PlaintextTap` also receives the
    unscaled update (the baselines' view, which FedAttr never has).

    ``batched`` (``fl.batched``): a round's clients are trained together
    (:func:`~fedattr.models.batched.train_clients`, as many at once as memory allows), where
    the strategy and the model allow it and it pays
    (:func:`~fedattr.models.batched.worth_training_together`); otherwise one after another
    (:func:`~fedattr.models.training.train`). :attr:`batched` says which. Either way each
    client's update is what ``strategy.update`` reads from the model holding that client's
    trained factors.

    ``profiles`` (``fl.clients``): clients that train or submit differently (their learning
    rate, epochs, share of their steps, a scale on what they send, rounds they drop out of);
    the rest train with ``settings``.
    """

    def __init__(
        self,
        model: Any,
        examples: Sequence[Sequence[Example]],
        strategy: ClientStrategy,
        settings: TrainSettings,
        pad_id: int,
        seed: int = 0,
        profiles: Profiles | None = None,
        batched: bool = False,
    ) -> None:
        sizes = [len(e) for e in examples]
        require_usable_examples(sizes)
        self.model, self.examples, self.strategy = model, list(examples), strategy
        self.settings, self.pad_id, self.seed = settings, pad_id, seed
        self.profiles = profiles_of(profiles)
        self.batched = (
            batched
            and strategy.trains_together
            and can_stack(model)
            and worth_training_together(
                model, settings.micro_batch_size, [e for e in self.examples if e]
            )
        )
        self._params = trainable_lora_parameters(model)
        self._sizes = sizes
        self._tap: PlaintextTap | None = None

    @classmethod
    def from_config(
        cls,
        model: Any,
        examples: Sequence[Sequence[Example]],
        strategy: ClientStrategy,
        fl: FLConfig,
        pad_id: int,
        profiles: Profiles,
    ) -> InProcessPool:
        """The pool a run's ``fl`` section describes: its training settings, seed and
        ``batched``, with the clients' ``profiles`` resolved from ``fl.clients``."""
        return cls(
            model,
            examples,
            strategy,
            fl.train,
            pad_id,
            seed=fl.seed,
            profiles=profiles,
            batched=fl.batched,
        )

    @property
    def num_clients(self) -> int:
        return len(self.examples)

    def data_sizes(self) -> list[int]:
        return list(self._sizes)

    def open_tap(self) -> PlaintextTap:
        self._tap = self._tap or PlaintextTap()
        return self._tap

    def train_round(
        self,
        round_id: int,
        participants: Sequence[int],
        state: Any,
        sa: SecureAggregator,
        scales: dict[int, float],
        progress: Progress,
        timing: Stopwatch | None = None,
    ) -> dict[int, float]:
        losses: dict[int, float] = {}
        if self._tap is not None:
            self._tap.updates = {}
        steps = progress.steps(len(participants), f"round {round_id} local training")
        dropped = set(self.profiles.drops(round_id, participants))

        def finish(c: int, stats: dict[str, float]) -> None:
            """Client ``c`` has trained (its factors are in the model): send its update."""
            trained = stats["steps"] > 0
            if trained:
                losses[c] = stats["loss"]
            if timing is not None:
                timing.count("train_tokens", stats["tokens"])
                timing.count("train_steps", stats["steps"])
            update = self.strategy.update(self.model, state)
            profile = self.profiles[c]
            if profile.update_scale != 1.0:  # what this client sends of what it learned
                update = scale_update(update, profile.update_scale)
            if c in dropped:
                # Trained, but its update never reaches SA: offline for the rest of the round.
                sa.drop(c)
            else:
                # Only the scaled update leaves the client, and only into secure aggregation.
                sa.submit(c, scaled_update(update, scales[c]))
                if self._tap is not None:
                    self._tap.updates[c] = {k: v.detach().float().cpu() for k, v in update.items()}
            note = " (dropped out)" if c in dropped else ""
            if trained:
                steps.step(f"client {c} loss {stats['loss']:.3f}{note}")
            else:
                steps.step(f"client {c}: no usable example, sends a zero update{note}")

        # A client with no usable example (a shard of prompts too long to leave a token to
        # learn) takes part with nothing learned: a zero update, and its FedAvg weight is 0.
        idle = [c for c in participants if not self.examples[c]]
        for c in idle:
            self.strategy.start(self.model, state, round_id, c)
            finish(c, untrained_stats())
        training = [c for c in participants if self.examples[c]]
        if self.batched:
            self._train_together(round_id, training, state, finish)
        else:
            for c in training:
                profile = self.profiles[c]
                self.strategy.start(self.model, state, round_id, c)
                stats = train(
                    self.model,
                    self._params,
                    self.examples[c],
                    profile.settings(self.settings),
                    self.pad_id,
                    seed=train_seed(self.seed, round_id, c),
                    stop_after=profile.steps,
                )
                finish(c, stats)
                release_memory()  # the training step's freed buffers, before the next client's
        steps.close()
        return losses

    def _train_together(
        self,
        round_id: int,
        participants: Sequence[int],
        state: Any,
        finish: Callable[[int, dict[str, float]], None],
    ) -> None:
        """The participants trained together, as many at a time as memory allows; each
        finished client's trained factors are loaded into the model for ``finish``."""
        per_group = clients_at_once(self.model)
        for g in range(0, len(participants), per_group):
            group = list(participants[g : g + per_group])
            jobs = []
            for c in group:
                profile = self.profiles[c]
                # What the strategy starts this client from: its factors (the rest, the same
                # for every client, stays in the model).
                self.strategy.start(self.model, state, round_id, c)
                jobs.append(
                    ClientJob(
                        adapter_state(self.model),
                        self.examples[c],
                        profile.settings(self.settings),
                        train_seed(self.seed, round_id, c),
                        profile.steps,
                    )
                )

            def done(i: int, result: ClientResult, group: list[int] = group) -> None:
                load_state(self.model, result.adapters)
                result.adapters = {}
                finish(group[i], result.stats())

            train_clients(self.model, jobs, self.pad_id, on_done=done)
            del jobs
            release_memory()
