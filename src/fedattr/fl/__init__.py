"""Federated LoRA fine-tuning: the round engine, client pools, strategies (FedIT, FLoRA)."""

from .aggregate import sa_scales, subtract_states, weighted_mean
from .fedavg import FedAvgServer
from .fedit import FedITClient, FedITServer
from .flora import FLoRAClient, FLoRAServer
from .pool import ClientPool, PlaintextTap
from .progress import Progress
from .registry import STRATEGIES, make_strategy
from .server import Checkpointer, Observer, RoundContext, RoundEngine, RunEnd, Stopwatch
from .strategy import ClientStrategy, ServerStrategy, State
from .synthetic import SyntheticConfig, SyntheticPool

__all__ = [
    "STRATEGIES",
    "Checkpointer",
    "ClientPool",
    "ClientStrategy",
    "FLoRAClient",
    "FLoRAServer",
    "FedAvgServer",
    "FedITClient",
    "FedITServer",
    "Observer",
    "PlaintextTap",
    "Progress",
    "RoundContext",
    "RoundEngine",
    "RunEnd",
    "ServerStrategy",
    "State",
    "Stopwatch",
    "SyntheticConfig",
    "SyntheticPool",
    "make_strategy",
    "sa_scales",
    "subtract_states",
    "weighted_mean",
]
