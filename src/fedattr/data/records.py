"""Instruction records and how they become prompts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Record:
    """One instruction-following example (Alpaca form); ``category`` drives non-IID splits."""

    instruction: str
    output: str
    input: str = ""
    category: str = "general"


def plain_prompt(record: Record) -> str:
    """The Alpaca-style prompt used when a tokenizer has no chat template."""
    if record.input:
        return (
            f"### Instruction:\n{record.instruction}\n\n### Input:\n{record.input}\n\n"
            "### Response:\n"
        )
    return f"### Instruction:\n{record.instruction}\n\n### Response:\n"
