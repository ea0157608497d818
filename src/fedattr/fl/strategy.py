"""The abstract aggregation strategy (after Flower's ``server/strategy/strategy.py``).

A strategy fixes the *update space*: what a client submits to secure aggregation, how the
server turns the SA aggregate into the next global state, and which parameters the watermark
scorer sees. FedAttr estimates live in the same space and are applied with
:meth:`Strategy.apply_estimate`, so SA sums, aggregation and attribution always agree.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..updates import add_update

State = dict[str, torch.Tensor]


class Strategy(ABC):
    """How LoRA client results are turned into SA updates and a new global state."""

    name: str

    @abstractmethod
    def initial_state(self, model) -> State:
        """The global state before round 1."""

    @abstractmethod
    def client_start(self, model, state: State, round_id: int, client_id: int) -> None:
        """Load what a client starts local training from into ``model``."""

    @abstractmethod
    def client_update(self, model, state: State) -> State:
        """The client's update Delta_i (in this strategy's space) after local training."""

    @abstractmethod
    def apply_aggregate(self, state: State, mean_update: State) -> State:
        """Next global state from the weighted mean of the clients' updates."""

    @abstractmethod
    def scoring_params(self, state: State) -> State:
        """Parameters the scorer loads for the global model ``w^{t-1}``."""

    @abstractmethod
    def load_for_scoring(self, model, params: State) -> None:
        """Put ``params`` (a scoring state, possibly plus an estimate) into ``model``."""

    def apply_estimate(self, params: State, delta: State) -> State:
        """``w^{t-1} + Delta_hat_i``: key-wise addition (keys absent from delta unchanged)."""
        return add_update(params, delta)
