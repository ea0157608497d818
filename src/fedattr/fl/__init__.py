"""Federated LoRA fine-tuning: strategies (FedIT, FLoRA), shared arithmetic, local training."""

from .aggregate import sa_scales, subtract_states, weighted_mean
from .fedit import FedIT
from .flora import FLoRA
from .strategy import State, Strategy

__all__ = [
    "FLoRA",
    "FedIT",
    "State",
    "Strategy",
    "sa_scales",
    "subtract_states",
    "weighted_mean",
]
