"""Strategies by name: ``fl.strategy`` picks a (server, client) pair, each built from config."""

from __future__ import annotations

from .fedit import FedITClient, FedITServer
from .flora import FLoRAClient, FLoRAServer
from .strategy import ClientStrategy, ServerStrategy

STRATEGIES: dict[str, tuple[type[ServerStrategy], type[ClientStrategy]]] = {
    "fedit": (FedITServer, FedITClient),
    "flora": (FLoRAServer, FLoRAClient),
}
"""LoRA strategies for ``fl.strategy``: name -> (server part, client part)."""


def make_strategy(fl, lora) -> tuple[ServerStrategy, ClientStrategy]:
    """The configured strategy's server and client parts (``fl``: FLConfig, ``lora``:
    LoRAConfig)."""
    server, client = STRATEGIES[fl.strategy]
    return server.from_config(fl, lora), client.from_config(fl, lora)
