"""The ``tiny`` preset: a small Llama model that fedattr builds itself, offline.

A byte-level BPE tokenizer is trained with ``tokenizers`` on the embedded clean corpus, a
``LlamaForCausalLM`` is built from config and pre-trained on the same clean text (never on
watermarked documents), and both are saved with ``save_pretrained`` into a cache folder keyed
by a hash of the configuration, so later runs load them in a second.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from ..data.corpus import generate_corpus
from ..data.records import plain_prompt
from .config import TinyModelConfig
from .filelock import file_lock
from .text import encode_examples
from .training import TrainSettings, train

_FORMAT_VERSION = 3  # bump when the corpus or recipe changes, so stale caches are not reused


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/fedattr`` or ``~/.cache/fedattr``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fedattr"


def cache_key(cfg: TinyModelConfig) -> str:
    """Short hash of the configuration and recipe version."""
    blob = json.dumps({"v": _FORMAT_VERSION, **dataclasses.asdict(cfg)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with ``<pad>``, ``<s>``, ``</s>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def build_tiny(
    cfg: TinyModelConfig, out_dir: Path, progress: Callable[[str], None] | None = None
) -> Path:
    """Train tokenizer and model from scratch into ``out_dir`` (see module docstring)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    say = progress or (lambda m: print(m, file=sys.stderr))
    records = generate_corpus(cfg.pretrain_records, seed=cfg.seed)
    texts = [plain_prompt(r) + r.output for r in records]
    say(f"tiny preset: training a {cfg.vocab_size}-token BPE tokenizer on {len(texts)} records")
    tokenizer = train_tokenizer(texts, cfg.vocab_size)
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.layers,
            num_attention_heads=cfg.heads,
            num_key_value_heads=cfg.heads,
            max_position_embeddings=cfg.max_positions,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=True,
        )
    )
    examples = encode_examples(tokenizer, records, cfg.max_positions, loss_on_prompt=True)
    settings = TrainSettings(
        batch_size=cfg.pretrain_batch,
        micro_batch_size=cfg.pretrain_batch,
        lr=cfg.pretrain_lr,
        warmup_ratio=0.05,
        max_steps=cfg.pretrain_steps,
        epochs=10_000,
    )
    every = max(1, cfg.pretrain_steps // 10)

    def on_step(step: int, total: int, loss: float) -> None:
        if step % every == 0 or step == total:
            say(f"tiny preset: pre-training step {step}/{total}, loss {loss:.3f}")

    stats = train(
        model,
        model.parameters(),
        examples,
        settings,
        tokenizer.pad_token_id,
        seed=cfg.seed,
        on_step=on_step,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "fedattr_tiny.json").write_text(
        json.dumps({"config": dataclasses.asdict(cfg), "pretrain": stats}, indent=2)
    )
    return out_dir


def ensure_tiny(
    cfg: TinyModelConfig,
    cache_dir: str | Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Path of the cached tiny model for ``cfg``, building it first if needed.

    Processes that start together build it once: the first takes a lock file beside the
    cache folder and builds; the others wait for the lock, then find the model and load it.
    Where no lock can be taken (no ``fcntl``, a file system that refuses locks), each builds
    its own copy and the first to finish is kept."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    final = root / f"tiny-{cache_key(cfg)}"
    if (final / "fedattr_tiny.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda m: print(m, file=sys.stderr))
    waiting = lambda: say("tiny preset: another process is building the model; waiting")  # noqa: E731
    with file_lock(root / f"{final.name}.lock", waiting):
        if (final / "fedattr_tiny.json").is_file():  # built while this process waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix="tiny-build-", dir=root))
        try:
            build_tiny(cfg, tmp, progress)
            if not (final / "fedattr_tiny.json").is_file():  # no lock: another may have won
                shutil.rmtree(final, ignore_errors=True)
                tmp.rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final
