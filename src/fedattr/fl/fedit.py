"""FedIT (Zhang et al., ICASSP'24): the sample-weighted mean of the LoRA factors A and B.

Averaging A and B separately is not the average of the products ``B_i A_i``; that is FedIT's
known approximation, kept as the paper uses it (FLoRA is the exact alternative).
"""

from __future__ import annotations

from ..models.lora import adapter_state, load_state
from .aggregate import subtract_states
from .strategy import ClientStrategy, ServerStrategy, State


class FedITServer(ServerStrategy):
    """Update space: the LoRA factors. ``A <- A + sum p_i dA_i``, ``B <- B + sum p_i dB_i``."""

    name = "fedit"

    @classmethod
    def from_config(cls, fl, lora) -> FedITServer:
        """Nothing to configure."""
        return cls()

    def initial_state(self, model) -> State:
        return adapter_state(model)


class FedITClient(ClientStrategy):
    """Start from the global factors; submit the change of the factors."""

    name = "fedit"
    trains_together = True

    @classmethod
    def from_config(cls, fl, lora) -> FedITClient:
        """Nothing to configure."""
        return cls()

    def start(self, model, state: State, round_id: int, client_id: int) -> None:
        load_state(model, state)

    def update(self, model, state: State) -> State:
        return subtract_states(adapter_state(model), state)
