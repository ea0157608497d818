"""The teacher (the corpus owner's step): rewrites responses with a KGW-watermarked decoder,
or writes Fictitious-Knowledge documents from templated facts."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

from ..data.records import Record
from ..models.text import format_prompt, generate
from .fictitious import FictitiousEntity, teacher_prompt
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


def write_fk_documents(
    model,
    tokenizer,
    entity: FictitiousEntity,
    n: int,
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.8,
    top_p: float = 0.95,
    seed: int = 0,
    batch_size: int = 32,
) -> list[Record]:
    """``n`` Fictitious-Knowledge documents written by the model from templated facts.

    Every document is kept (check :func:`~.fictitious.target_share` for how many targets they
    really state: a small model drops or garbles names, and the detector can only find what the
    documents carry).
    """
    r = random.Random(f"fedattr-fk-teacher-{seed}-{entity.name}")
    requests = [teacher_prompt(entity, r) for _ in range(n)]
    outs = generate(
        model,
        tokenizer,
        [format_prompt(tokenizer, q) for q in requests],
        max_new_tokens,
        sample=True,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        batch_size=batch_size,
    )
    docs = []
    for q, ids in zip(requests, outs, strict=True):
        text = tokenizer.decode(ids[1:], skip_special_tokens=True).strip()
        docs.append(Record(q.instruction.split(".")[0] + ".", text, category="fictitious"))
    return docs
