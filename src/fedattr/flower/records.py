"""Conversions between fedattr's values and Flower records (no fedattr logic here)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord

from ..config import from_dict, to_dict
from ..errors import UserError
from . import COMMANDS


def config_of(command: str, config_json: str) -> Any:
    """The typed configuration of ``command`` from its JSON form."""
    from ..pipeline.config import DemoConfig, RunConfig

    if command not in COMMANDS:
        raise UserError(f"command: unknown {command!r}; allowed: {', '.join(COMMANDS)}")
    cls = RunConfig if command == "run" else DemoConfig
    return from_dict(cls, json.loads(config_json), quiet=True)


def config_json(config: Any) -> str:
    """The JSON form every party rebuilds the configuration from."""
    return json.dumps(to_dict(config))


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    # numpy has no bfloat16; the receiving model casts on load, so float32 loses nothing.
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def state_record(state: Any) -> ArrayRecord:
    """A global state (a mapping of tensors, or one tensor) as an ArrayRecord."""
    if isinstance(state, torch.Tensor):
        return ArrayRecord({"": Array(_numpy(state))})
    return ArrayRecord({k: Array(_numpy(v)) for k, v in state.items()})


def record_state(record: ArrayRecord) -> Any:
    """Inverse of :func:`state_record`."""
    tensors = {k: torch.from_numpy(np.array(a.numpy())) for k, a in record.items()}
    return tensors[""] if list(tensors) == [""] else tensors


def arrays(values: Mapping[str, np.ndarray]) -> ArrayRecord:
    """Named numpy arrays as an ArrayRecord."""
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in values.items()})


def unarrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    """Inverse of :func:`arrays`."""
    return {k: np.array(a.numpy()) for k, a in record.items()}


def config(values: Mapping[str, Any]) -> ConfigRecord:
    """A ConfigRecord (values: str, bytes, bool, int, float or flat lists of one of them)."""
    return ConfigRecord(dict(values))
