"""FedIT (Zhang et al., ICASSP'24): the sample-weighted mean of the LoRA factors A and B."""

from __future__ import annotations

from ..models.lora import adapter_state, load_state
from ..updates import add_update
from .aggregate import subtract_states
from .strategy import State, Strategy


class FedIT(Strategy):
    """Update space: the LoRA factors. ``A <- A + sum p_i dA_i``, ``B <- B + sum p_i dB_i``.

    Averaging A and B separately is not the average of the products ``B_i A_i``; that is
    FedIT's known approximation, kept as the paper uses it (FLoRA is the exact alternative).
    """

    name = "fedit"

    def initial_state(self, model) -> State:
        return adapter_state(model)

    def client_start(self, model, state: State, round_id: int, client_id: int) -> None:
        load_state(model, state)

    def client_update(self, model, state: State) -> State:
        return subtract_states(adapter_state(model), state)

    def apply_aggregate(self, state: State, mean_update: State) -> State:
        return add_update(state, mean_update)

    def scoring_params(self, state: State) -> State:
        return dict(state)

    def load_for_scoring(self, model, params: State) -> None:
        load_state(model, params)
