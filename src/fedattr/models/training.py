"""One training loop for pre-training the tiny preset and for clients' local LoRA training."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .reading import logits_at
from .text import Example, collate


@dataclass
class TrainSettings:
    """AdamW with linear warm-up then cosine decay, gradient accumulation over micro-batches."""

    epochs: int = 1
    """Passes over the client's records, >= 1."""
    batch_size: int = 16
    """Examples per optimizer step (a multiple of ``micro_batch_size``)."""
    micro_batch_size: int = 8
    """Examples per forward pass; ``batch_size / micro_batch_size`` passes are
    accumulated into one step."""
    lr: float = 2e-4
    """Peak learning rate (AdamW), > 0."""
    warmup_ratio: float = 0.03
    """Share of the steps spent warming the learning rate up linearly, in [0, 1)."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay."""
    max_steps: int = 0
    """Stop after this many optimizer steps (0: run all epochs)."""
    group_by_length: bool = False
    """Batches of similar lengths (each epoch: shuffled, cut into windows of 50 batches, each
    window sorted by length; batch order shuffled): far less padding on an accelerator. Off
    by default because it changes which examples share a batch, so results too."""

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
    stop_after: float = 1.0,
) -> dict[str, float]:
    """Train ``params`` of ``model`` on ``examples``; returns the mean loss, the step count and
    the tokens processed (padding excluded). ``stop_after``: the share of the planned steps
    taken before training stops (a straggler's; the schedule is still the planned one, and at
    least one step is taken)."""
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
    stop = total if stop_after >= 1.0 else max(1, math.floor(stop_after * total))
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(
        params,
        lr=settings.lr,
        weight_decay=settings.weight_decay,
        **optimizer_options(device, params),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_with_warmup(total, warmup))
    # Loss tokens per example, counted once (not per step in Python).
    counts = [sum(lab != -100 for lab in e.labels[1:]) for e in examples]
    lengths = [len(e.input_ids) for e in examples]
    model.train()
    step, losses, tokens = 0, [], 0
    while step < stop:
        for order in epoch_batches(lengths, settings.batch_size, rng, settings.group_by_length):
            if step >= stop:
                break
            batch = [examples[i] for i in order]
            n_tokens = sum(counts[i] for i in order)
            opt.zero_grad(set_to_none=True)
            batch_loss = torch.zeros((), device=device)
            for m in range(0, len(batch), settings.micro_batch_size):
                micro = collate(batch[m : m + settings.micro_batch_size], pad_id)
                tokens += int(micro["attention_mask"].sum())  # counted on the host: no sync
                # Position t predicts token t + 1: the output layer runs only where a loss is
                # taken (the response), not on prompts and padding (logits_at).
                shifted = micro["labels"][:, 1:]
                scored = (shifted != -100).nonzero()
                rows = scored[:, 0] * micro["labels"].shape[1] + scored[:, 1]
                targets = shifted[scored[:, 0], scored[:, 1]]
                logits = logits_at(
                    model,
                    micro["input_ids"].to(device, non_blocking=True),
                    micro["attention_mask"].to(device, non_blocking=True),
                    rows.to(device, non_blocking=True),
                )
                # Token-weighted loss over the whole batch, however it is split in micro-batches
                # (in float32 at least: a bfloat16 model's logits are upcast).
                loss = torch.nn.functional.cross_entropy(
                    loss_precision(logits), targets.to(device, non_blocking=True), reduction="sum"
                ) / max(1, n_tokens)
                loss.backward()
                batch_loss += loss.detach()  # read once per step: one device sync, not one each
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            losses.append(float(batch_loss))
            if on_step is not None:
                on_step(step, total, losses[-1])
    return {"loss": float(np.mean(losses)), "steps": float(step), "tokens": float(tokens)}


def loss_precision(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` in float32, or float64 where they are (a float64 model, as the batched
    training's equivalence test runs, keeps its precision to the loss)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def optimizer_options(device: torch.device, params: Sequence[torch.Tensor]) -> dict:
    """AdamW's fused kernel on CUDA (one launch for all parameters instead of several per
    tensor; same update up to float rounding); torch's default elsewhere."""
    if device.type == "cuda" and all(p.is_floating_point() for p in params):
        return {"fused": True}
    return {}


def epoch_batches(
    lengths: Sequence[int], batch_size: int, rng: np.random.Generator, by_length: bool
) -> list[list[int]]:
    """One epoch's batches of example indices: a random permutation cut in order, or with
    ``by_length`` the permutation cut into windows of 50 batches, each window sorted by
    length (longest first) and cut into batches, then the batches shuffled."""
    order = rng.permutation(len(lengths))
    if not by_length:
        return [order[b : b + batch_size].tolist() for b in range(0, len(order), batch_size)]
    window = 50 * batch_size
    batches = []
    for w in range(0, len(order), window):
        part = sorted(order[w : w + window].tolist(), key=lambda i: -lengths[i])
        batches += [part[b : b + batch_size] for b in range(0, len(part), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]
