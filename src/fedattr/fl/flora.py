"""FLoRA (Wang et al., NeurIPS'24): stack every client's LoRA factors, merge, reset adapters.

Stacking ``[p_1 B_1, ..., p_K B_K] @ [A_1; ...; A_K] = sum_i p_i B_i A_i``, so the exact
aggregate lives in the space of merged low-rank products per module. That is the update space
here: client i submits ``scaling * B_i @ A_i`` for every adapted module (a dense matrix shaped
like the module's weight), SA sums are sums of merged deltas, the server adds the weighted mean
into the base weights, and every round starts from fresh adapters (B = 0, A re-drawn). The
FedAttr estimate is applied the same way: ``W^{t-1} + Delta_hat_i`` on the base weights.
"""

from __future__ import annotations

import numpy as np
import torch

from ..models.lora import adapter_state, base_state, load_state, lora_layers, merged_delta
from .strategy import ClientStrategy, ServerStrategy, State


class FLoRAServer(ServerStrategy):
    """Update space: merged per-module deltas ``scaling * B @ A`` added into the base weights."""

    name = "flora"

    @classmethod
    def from_config(cls, fl, lora) -> FLoRAServer:
        """Nothing to configure."""
        return cls()

    def initial_state(self, model) -> State:
        # Zeroed B factors for scoring: with B = 0 the adapters add nothing to the base weights.
        self._zero_b = {
            f"{name}.lora_B": torch.zeros_like(layer.lora_B["default"].weight)
            for name, layer in lora_layers(model).items()
        }
        return base_state(model)

    def scoring_params(self, state: State) -> State:
        return {**state, **self._zero_b}


class FLoRAClient(ClientStrategy):
    """Start from the merged base weights with fresh adapters; submit the merged product."""

    name = "flora"
    trains_together = True

    def __init__(self, scaling: float, seed: int = 0) -> None:
        self.scaling = scaling
        self.seed = seed

    @classmethod
    def from_config(cls, fl, lora) -> FLoRAClient:
        """The LoRA scaling ``alpha / r`` and the run's seed (fresh adapters per round)."""
        return cls(scaling=lora.scaling, seed=fl.seed)

    def _fresh_adapters(self, model, round_id: int, client_id: int) -> State:
        seed = int(np.random.default_rng([self.seed, round_id, client_id]).integers(2**62))
        gen = torch.Generator().manual_seed(seed)
        out = {}
        for name, layer in lora_layers(model).items():
            a = layer.lora_A["default"].weight
            bound = 1.0 / a.shape[1] ** 0.5  # peft's default kaiming-uniform(a=sqrt(5)) range
            out[f"{name}.lora_A"] = (torch.rand(a.shape, generator=gen) * 2 - 1) * bound
            out[f"{name}.lora_B"] = torch.zeros_like(layer.lora_B["default"].weight)
        return out

    def start(self, model, state: State, round_id: int, client_id: int) -> None:
        load_state(model, {**state, **self._fresh_adapters(model, round_id, client_id)})

    def update(self, model, state: State) -> State:
        return merged_delta(adapter_state(model), self.scaling)
