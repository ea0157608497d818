"""One client of a configured federation, alone in its process (a remote runtime's client).

A node rebuilds exactly what the in-process pool gives that client: the same data (from the
same configuration and seeds), the same model and adapters, the same local training seed, the
same scaled update. So a federation run on separate processes reaches the same SA sums, bit for
bit in fixed point, as :class:`~fedattr.fl.inprocess.InProcessPool` on the same machine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from ..data.config import DataConfig
from ..data.records import Record
from ..errors import UserError
from ..models.config import LoRAConfig, ModelConfig
from ..watermarks.config import WatermarkConfig
from .config import FLConfig
from .strategy import State
from .synthetic import SyntheticConfig, SyntheticPool

Say = Callable[[str], None]


def scaled_update(update: State, scale: float) -> State:
    """What a client submits to SA: its update on the CPU in float32, times ``n * p_i``."""
    return {k: v.detach().float().cpu() * scale for k, v in update.items()}


def untrained_stats() -> dict[str, float]:
    """What ``train`` would report for a client with no usable example: nothing learned (its
    update is zero), no loss."""
    return {"loss": float("nan"), "tokens": 0.0, "steps": 0.0}


def train_seed(run_seed: int, round_id: int, client_id: int) -> int:
    """The local-training seed of (run, round, client), wherever the client runs."""
    return run_seed * 100_003 + round_id * 101 + client_id


class LLMClientNode:
    """Client ``client_id`` of an LLM federation: its shard, the model with adapters, training.

    ``records`` is the client's shard when the node already has it (kept between messages);
    otherwise it is built from the configuration, like every client's in ``fedattr run``.
    """

    def __init__(
        self,
        model: ModelConfig,
        lora: LoRAConfig,
        data: DataConfig,
        watermark: WatermarkConfig,
        fl: FLConfig,
        client_id: int,
        records: list[Record] | None = None,
        say: Say | None = None,
    ) -> None:
        if not 0 <= client_id < fl.K:
            raise UserError(
                f"partition-id: must be in 0..{fl.K - 1} (fl.K={fl.K}), got {client_id}"
            )
        self.model_cfg, self.lora_cfg, self.data_cfg = model, lora, data
        self.watermark_cfg, self.fl_cfg, self.client_id = watermark, fl, client_id
        self.say = say or (lambda _msg: None)
        self._model: Any = None
        self._tokenizer: Any = None
        self._adapted: Any = None
        self.records = records if records is not None else self._build_shard()

    def _load(self) -> None:
        if self._model is None:
            from ..models.loading import load_model

            self._model, self._tokenizer = load_model(self.model_cfg, self.say)

    def _build_shard(self) -> list[Record]:
        from .federation import build_federation

        self._load()
        fed = build_federation(
            self.data_cfg,
            self.watermark_cfg,
            self.fl_cfg.K,
            self.fl_cfg.seed,
            self._model,
            self._tokenizer,
            self.say,
        )
        return fed.shards[self.client_id]

    def records_dicts(self) -> list[dict]:
        """The shard as JSON-ready dicts (for the node's own storage)."""
        return [asdict(r) for r in self.records]

    def _examples(self) -> list:
        from ..models.text import encode_examples

        self._load()
        return encode_examples(self._tokenizer, self.records, self.data_cfg.max_len)

    def data_size(self) -> int:
        """Usable training examples (the client's FedAvg weight; 0 for a shard with none, whose
        client takes part with a zero update)."""
        return len(self._examples())

    def train(self, round_id: int, state: State, scale: float) -> tuple[State, dict[str, float]]:
        """Local training from the global ``state``; returns the scaled update and
        ``{"loss", "train_tokens", "train_steps"}``."""
        from ..models.lora import attach_lora, trainable_lora_parameters
        from ..models.training import train
        from ..runtime import release_memory
        from .clients import resolve_profiles
        from .federation import watermarked_clients
        from .registry import make_strategy

        examples = self._examples()
        fl, wm = self.fl_cfg, self.watermark_cfg
        # The same profile the in-process pool gives this client (fl.clients).
        profile = resolve_profiles(
            fl.clients, fl.K, watermarked_clients(wm, fl.K, fl.seed), fl.seed
        )[self.client_id]
        if self._adapted is None:
            self._adapted = attach_lora(self._model, self.lora_cfg, seed=self.fl_cfg.seed)
        model = self._adapted
        _, client = make_strategy(self.fl_cfg, self.lora_cfg)
        client.start(model, state, round_id, self.client_id)
        if examples:
            stats = train(
                model,
                trainable_lora_parameters(model),
                examples,
                profile.settings(self.fl_cfg.train),
                self._tokenizer.pad_token_id,
                seed=train_seed(self.fl_cfg.seed, round_id, self.client_id),
                stop_after=profile.steps,
            )
        else:  # no usable example: nothing learned, a zero update (the in-process pool's too)
            stats = untrained_stats()
        update = client.update(model, state)
        if profile.update_scale != 1.0:  # as the in-process pool applies it: the same bits
            update = {k: v * profile.update_scale for k, v in update.items()}
        update = scaled_update(update, scale)
        release_memory()  # the training steps' freed buffers, while the node waits
        return update, {
            "loss": float(stats["loss"]),
            "train_tokens": float(stats["tokens"]),
            "train_steps": float(stats["steps"]),
        }


class SyntheticClientNode:
    """Client ``client_id`` of the synthetic federation (its update is a function of the
    configuration and the round)."""

    def __init__(self, config: SyntheticConfig, client_id: int) -> None:
        if not 0 <= client_id < config.K:
            raise UserError(
                f"partition-id: must be in 0..{config.K - 1} (synthetic.K={config.K}), "
                f"got {client_id}"
            )
        self.config, self.client_id = config, client_id

    def data_size(self) -> int:
        """Equal weights, as :class:`SyntheticPool`."""
        return SyntheticPool(self.config).data_sizes()[self.client_id]

    def train(self, round_id: int, state: Any, scale: float) -> tuple[torch.Tensor, dict]:
        """The client's round update, scaled as :class:`SyntheticPool` submits it."""
        update = SyntheticPool(self.config).updates(round_id)[self.client_id]
        return SyntheticPool.scaled(update, scale), {}
