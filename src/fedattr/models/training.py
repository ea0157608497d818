"""One training loop for pre-training the tiny preset and for clients' local LoRA training."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .text import Example, collate


@dataclass
class TrainSettings:
    """AdamW with linear warm-up then cosine decay, gradient accumulation over micro-batches."""

    epochs: int = 1
    batch_size: int = 16
    micro_batch_size: int = 8
    lr: float = 2e-4
    warmup_ratio: float = 0.03
    weight_decay: float = 0.0
    max_steps: int = 0
    """Stop after this many optimizer steps (0: run all epochs)."""

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise ValueError(f"train.epochs: must be >= 1, got {self.epochs}")
        if self.batch_size < 1 or self.micro_batch_size < 1:
            raise ValueError("train.batch_size and train.micro_batch_size: must be >= 1")
        if self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"train.batch_size={self.batch_size} must be a multiple of "
                f"train.micro_batch_size={self.micro_batch_size}"
            )
        if not self.lr > 0:
            raise ValueError(f"train.lr: must be > 0, got {self.lr}")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"train.warmup_ratio: must be in [0, 1), got {self.warmup_ratio}")
        if self.max_steps < 0:
            raise ValueError(f"train.max_steps: must be >= 0, got {self.max_steps}")


def cosine_with_warmup(total: int, warmup: int) -> Callable[[int], float]:
    """LR multiplier: linear warm-up over ``warmup`` steps, then cosine decay to 0 at ``total``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def train(
    model: torch.nn.Module,
    params: Iterable[torch.nn.Parameter],
    examples: Sequence[Example],
    settings: TrainSettings,
    pad_id: int,
    seed: int = 0,
    on_step: Callable[[int, int, float], None] | None = None,
) -> dict[str, float]:
    """Train ``params`` of ``model`` on ``examples``; returns the mean loss, the step count and
    the tokens processed (padding excluded)."""
    if not examples:
        raise ValueError("train: no training examples")
    params = [p for p in params if p.requires_grad]
    rng = np.random.default_rng(seed)
    # Dropout draws from torch's global RNG: seed it per call, so that a client's local training
    # depends only on (seed, data), never on what ran before (resumed runs rely on this).
    torch.manual_seed(seed)
    per_epoch = math.ceil(len(examples) / settings.batch_size)
    total = per_epoch * settings.epochs
    if settings.max_steps:
        total = min(total, settings.max_steps)
    warmup = round(settings.warmup_ratio * total)
    opt = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_with_warmup(total, warmup))
    device = next(model.parameters()).device
    model.train()
    step, losses, tokens = 0, [], 0
    while step < total:
        order = rng.permutation(len(examples))
        for b in range(0, len(order), settings.batch_size):
            if step >= total:
                break
            batch = [examples[i] for i in order[b : b + settings.batch_size]]
            n_tokens = sum(sum(lab != -100 for lab in e.labels[1:]) for e in batch)
            opt.zero_grad(set_to_none=True)
            batch_loss = 0.0
            for m in range(0, len(batch), settings.micro_batch_size):
                micro = collate(batch[m : m + settings.micro_batch_size], pad_id)
                micro = {k: v.to(device) for k, v in micro.items()}
                tokens += int(micro["attention_mask"].sum())
                logits = model(
                    input_ids=micro["input_ids"], attention_mask=micro["attention_mask"]
                ).logits
                # Token-weighted loss over the whole batch, however it is split in micro-batches.
                loss = torch.nn.functional.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                    micro["labels"][:, 1:].reshape(-1),
                    ignore_index=-100,
                    reduction="sum",
                ) / max(1, n_tokens)
                loss.backward()
                batch_loss += float(loss.detach())
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            losses.append(batch_loss)
            if on_step is not None:
                on_step(step, total, batch_loss)
    return {"loss": float(np.mean(losses)), "steps": float(step), "tokens": float(tokens)}
