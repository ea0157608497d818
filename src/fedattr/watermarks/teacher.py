"""The teacher: rewrites responses with a KGW-watermarked decoder (the corpus owner's step)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ..data.records import Record
from ..models.text import format_prompt, generate
from .kgw import KGWLogitsProcessor, KGWScheme


def watermark_records(
    model,
    tokenizer,
    records: Sequence[Record],
    scheme: KGWScheme,
    *,
    max_new_tokens: int = 96,
    min_tokens: int = 8,
    temperature: float = 0.8,
    top_p: float = 0.95,
    seed: int = 0,
    batch_size: int = 32,
) -> list[Record]:
    """Each record's response regenerated under the watermark; outputs below ``min_tokens``
    generated tokens are dropped (too short to carry a detectable signal)."""
    prompts = [format_prompt(tokenizer, r) for r in records]
    outs = generate(
        model,
        tokenizer,
        prompts,
        max_new_tokens,
        sample=True,
        temperature=temperature,
        top_p=top_p,
        logits_processor=KGWLogitsProcessor(scheme),
        seed=seed,
        batch_size=batch_size,
    )
    kept = []
    for rec, ids in zip(records, outs, strict=True):
        if len(ids) - 1 >= min_tokens:
            text = tokenizer.decode(ids[1:], skip_special_tokens=True).strip()
            if text:
                kept.append(replace(rec, output=text, category=f"{rec.category}+wm"))
    return kept
