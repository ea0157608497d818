"""FedAvg on plain parameter tensors: the synthetic federation's strategy (no language model)."""

from __future__ import annotations

from typing import Any

from .strategy import ServerStrategy


class FedAvgServer(ServerStrategy):
    """``w <- w + sum p_i Delta_i`` on whatever parameters the federation starts from."""

    name = "fedavg"

    def initial_state(self, model: Any) -> Any:
        """The parameters themselves are the state."""
        return model
