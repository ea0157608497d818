"""Prompts, tokenised training examples, batched greedy/sampled generation."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..data.records import Record, plain_prompt
from .lora import folded_adapters


def format_prompt(tokenizer, record: Record) -> str:
    """The chat template's generation prompt when the tokenizer has one, else Alpaca style."""
    if getattr(tokenizer, "chat_template", None):
        content = record.instruction + (f"\n\n{record.input}" if record.input else "")
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
    return plain_prompt(record)


@dataclass
class Example:
    """Token ids and labels (-100 where no loss is taken)."""

    input_ids: list[int]
    labels: list[int]


def encode_examples(
    tokenizer, records: Sequence[Record], max_len: int, *, loss_on_prompt: bool = False
) -> list[Example]:
    """Prompt + response + EOS, truncated to ``max_len``; loss on the response by default."""
    out = []
    eos = tokenizer.eos_token_id
    for rec in records:
        prompt = tokenizer(format_prompt(tokenizer, rec), add_special_tokens=False)["input_ids"]
        reply = tokenizer(rec.output, add_special_tokens=False)["input_ids"] + [eos]
        ids = (prompt + reply)[:max_len]
        labels = (list(prompt) if loss_on_prompt else [-100] * len(prompt)) + reply
        labels = labels[:max_len]
        if any(lab != -100 for lab in labels[1:]):
            out.append(Example(ids, labels))
    return out


def fits(tokenizer, record: Record, max_len: int) -> bool:
    """Whether :func:`encode_examples` keeps all of ``record`` (prompt, response, EOS)."""
    prompt = tokenizer(format_prompt(tokenizer, record), add_special_tokens=False)["input_ids"]
    reply = tokenizer(record.output, add_special_tokens=False)["input_ids"]
    return len(prompt) + len(reply) + 1 <= max_len


def padded(rows: Sequence[Sequence[int]], fill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` right-padded with ``fill`` to the longest, and the mask of real entries (both
    ``[len(rows), width]`` long tensors)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), fill, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


def collate(examples: Sequence[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch tensors."""
    ids, mask = padded([e.input_ids for e in examples], pad_id)
    labels, _ = padded([e.labels for e in examples], -100)
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompts: Sequence[str],
    max_new_tokens: int,
    *,
    batch_size: int = 32,
    sample: bool = False,
    temperature: float = 0.8,
    top_p: float = 0.95,
    logits_processor: Callable | None = None,
    seed: int = 0,
) -> list[list[int]]:
    """Continuations (new token ids, EOS and padding removed) of each prompt.

    Every returned sequence starts with the prompt's last token, so a detector with context
    width 1 can score the first generated token too.
    """
    from transformers import LogitsProcessorList

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    tokenizer.padding_side = "left"
    out: list[list[int]] = []
    gen = torch.Generator(device="cpu").manual_seed(seed)
    # A LoRA model decodes with its factors folded into the weights (one matmul per adapted
    # module and token instead of three; folded_adapters declines where that is not exact).
    with folded_adapters(model):
        for start in range(0, len(prompts), batch_size):
            chunk = list(prompts[start : start + batch_size])
            enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False).to(
                device
            )
            kwargs = dict(
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            if logits_processor is not None:
                kwargs["logits_processor"] = LogitsProcessorList([logits_processor])
            if sample:
                torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
                kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
            else:
                kwargs.update(do_sample=False)
            seqs = model.generate(**enc, **kwargs)
            width = enc["input_ids"].shape[1]
            for row, seq in enumerate(seqs.tolist()):
                new = seq[width:]
                if tokenizer.eos_token_id in new:
                    new = new[: new.index(tokenizer.eos_token_id)]
                new = [t for t in new if t != tokenizer.pad_token_id]
                out.append([int(enc["input_ids"][row, -1]), *new])
    if was_training:
        model.train()
    return out
