"""Aggregation strategies, split like Flower's ``server/strategy``: a server part and a client part.

A strategy fixes the *update space*: what a client submits to secure aggregation
(:class:`ClientStrategy`), how the server turns the SA mean into the next global state and which
parameters the watermark scorer sees (:class:`ServerStrategy`). FedAttr estimates live in the
same space and are applied with :meth:`ServerStrategy.apply_estimate`, so SA sums, aggregation
and attribution always agree. The round engine (:mod:`fedattr.fl.server`) only talks to the
server part; client pools only to the client part.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from ..updates import Update, add_update

State = dict[str, torch.Tensor]


class ServerStrategy(ABC):
    """The server's side: global state, aggregation, and what is scored."""

    name: ClassVar[str]

    @abstractmethod
    def initial_state(self, model: Any) -> Any:
        """The global state before round 1."""

    def aggregate(self, state: Any, mean_update: Update) -> Any:
        """Next global state from the weighted mean of the clients' updates (default: add)."""
        return add_update(state, mean_update)

    def scoring_params(self, state: Any) -> Any:
        """Parameters a scorer loads for the global model ``w^{t-1}`` (default: the state)."""
        return dict(state) if isinstance(state, dict) else state

    def apply_estimate(self, params: Any, delta: Update) -> Any:
        """``w^{t-1} + Delta_hat_i``: key-wise addition (keys absent from delta unchanged)."""
        return add_update(params, delta)


class ClientStrategy(ABC):
    """A client's side: what it starts local training from and what it submits."""

    name: ClassVar[str]
    trains_together: ClassVar[bool] = False
    """Whether a round's clients may be trained together
    (:func:`~fedattr.models.batched.train_clients`): what :meth:`start` loads differs between
    the clients of a round only in their LoRA factors (the rest, the same for all, stays in the
    model), and :meth:`update` reads only the model's adapters and base weights. A strategy that
    says nothing is trained one client after another."""

    @abstractmethod
    def start(self, model: Any, state: Any, round_id: int, client_id: int) -> None:
        """Load what the client starts local training from into ``model``."""

    @abstractmethod
    def update(self, model: Any, state: Any) -> State:
        """The client's update Delta_i (in this strategy's space) after local training."""
