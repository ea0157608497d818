"""The ``[fl]`` section: federated training."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import check_choice
from ..models.training import TrainSettings
from .clients import ClientGroup
from .registry import STRATEGIES


@dataclass
class FLConfig:
    """Federated training."""

    K: int = 10
    """Clients in the federation, >= 3."""
    rounds: int = 5
    """Federated rounds T, >= 1."""
    participation: float = 1.0
    """Fraction C/K of clients sampled each round."""
    strategy: str = "fedit"
    """``fedit`` or ``flora`` (see :data:`fedattr.fl.registry.STRATEGIES`)."""
    train: TrainSettings = field(default_factory=lambda: TrainSettings(lr=1e-3, epochs=2))
    """Local training. The tiny default trains 2 epochs at peak LR 1e-3 (a from-scratch 2-layer
    model learns little in the paper's 1 epoch at 2e-4); the smollm2 preset uses 1 at 2e-4."""
    seed: int = 0
    """Seed of the federation: which clients are watermarked (``watermark.r``) and which
    differ (``clients``), the clients sampled each round, the adapters' initialisation and each
    client's local training."""
    batched: bool = True
    """Train a round's clients together, in-process: one batched pass over the shared frozen
    base for every client, each with its own LoRA factors, data, optimizer, schedule and steps
    (:mod:`fedattr.models.batched`); ``false``: one client after another, as the Flower
    runtime's clients always train. The same training up to float rounding with
    ``lora.dropout=0``; with dropout, each client's masks are drawn from its own stream (the same
    rate, other draws). Strategies that cannot be trained together (a plugin's) train one after
    another either way."""
    clients: list[ClientGroup] = field(default_factory=list)
    """Clients that train or submit differently from the rest (free-riders, stragglers, other
    learning rates or epochs, clients that drop out of rounds): a list of groups, e.g.
    ``--set 'fl.clients=[{"count": 2, "update_scale": 0}]'`` makes two clean clients, drawn by
    seed, free-riders (see :class:`~fedattr.fl.clients.ClientGroup`)."""

    def __post_init__(self) -> None:
        if self.K < 3:
            raise ValueError(f"fl.K: must be >= 3, got {self.K}")
        if self.rounds < 1:
            raise ValueError(f"fl.rounds: must be >= 1, got {self.rounds}")
        if not 0.0 < self.participation <= 1.0:
            raise ValueError(f"fl.participation: must be in (0, 1], got {self.participation}")
        # A registry, not a Literal: a plugin may add a strategy to STRATEGIES.
        check_choice(self.strategy, STRATEGIES, "fl.strategy")

    @property
    def per_round(self) -> int:
        """Clients sampled per round, ``max(1, round(C/K * K))``."""
        return max(1, round(self.participation * self.K))
