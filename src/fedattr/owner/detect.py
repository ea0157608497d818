"""Testing a released model for the owner's KGW key (the paper's global-model test, alone).

Two detectors, both needing only the key, the model and some text in the model's domain:

- **reading** (fedattr's teacher-forced test): the green mass the model's next-token
  distributions moved from a *reference* model's on the same texts, read with the owner's key;
  ``p`` is the exact tail of that statistic under a random key (the method in ``tail``; see
  :mod:`fedattr.watermarks.tail`), as in the calibrated verdicts of a run, and ``p_rank`` its
  rank among ``null_keys`` random keys (a check, resolution ``1/(n+1)``). The reference is the
  model without its LoRA adapter (``--lora``) or another model (``--reference``, same tokenizer).
- **greedy** (the paper's radioactivity test): greedy continuations of the texts' prompts, the
  share of green tokens (each (previous, next) pair once) against ``gamma``: ``z``, ``p``. It
  needs no reference, and has little power on small models (README, *Finding 4*).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..data.records import Record
from ..errors import UserError
from ..models.reading import output_layer
from ..watermarks.keys import OwnerKey


class _Pair(torch.nn.Module):
    """The candidate and its reference behind one module the reading scorer switches between
    (``load(pair, "reference" | "candidate")``); a LoRA model is its own reference with its
    adapter disabled."""

    def __init__(self, candidate: Any, reference: Any | None) -> None:
        super().__init__()
        self.candidate, self.reference = candidate, reference
        self.current = "candidate"

    def get_output_embeddings(self) -> Any:
        """The output layer of the model read now (so the reader can run it on the scored
        positions only; the reference's, or the candidate's whose adapter is disabled)."""
        reading_reference = self.current != "candidate" and self.reference is not None
        return output_layer(self.reference if reading_reference else self.candidate)

    def forward(self, **inputs: Any) -> Any:
        if self.current == "candidate":
            return self.candidate(**inputs)
        if self.reference is not None:
            return self.reference(**inputs)
        with self.candidate.disable_adapter():
            return self.candidate(**inputs)


def _select(pair: _Pair, which: str) -> None:
    pair.current = which


def detect_kgw(
    key: OwnerKey,
    model: Any,
    tokenizer: Any,
    records: Sequence[Record],
    *,
    reference: Any | None = None,
    lora: bool = False,
    detectors: Sequence[str] = ("reading", "greedy"),
    null_keys: int = 1000,
    seed: int = 0,
    max_len: int = 256,
    max_new_tokens: int = 48,
) -> dict:
    """Run the chosen detectors; a JSON-ready dict per detector."""
    from ..models.text import encode_examples, format_prompt, generate
    from ..watermarks.kgw import KGWDetector
    from ..watermarks.radioactivity import KGWReadingScorer

    key.require("kgw")
    unknown = sorted(set(detectors) - {"reading", "greedy"})
    if unknown or not detectors:
        raise UserError(f"--detector: allowed reading, greedy (or both), got {list(detectors)}")
    if null_keys < 20:
        raise UserError(f"--null-keys: must be >= 20, got {null_keys}")
    if not records:  # a test of no text would read as p = 0.5
        raise UserError("--count/--texts: no texts to read; give at least one")
    scheme = key.kgw_scheme(len(tokenizer))
    out: dict[str, Any] = {"key": key.fingerprint, "texts": len(records)}
    if "reading" in detectors:
        if reference is None and not lora:
            raise UserError(
                "--reference: the reading test needs the model the candidate was fine-tuned "
                "from (--lora ADAPTER, or --reference MODEL); or use --detector greedy"
            )
        pair = _Pair(model, reference)
        examples = encode_examples(tokenizer, records, max_len)
        scorer = KGWReadingScorer(
            pair, examples, {"owner": scheme}, _select, pad_id=tokenizer.pad_token_id
        )
        ref, cand = scorer.observe("reference"), scorer.observe("candidate")
        law = scorer.key_laws()["probes"]
        W = law.centre(scorer.change(ref, cand)["probes"])
        stat = scorer.owner_values("probes", W)["owner"]
        tail = law.tail(W, stat)
        null = law.random_values([W], null_keys, seed)[0]
        out["reading"] = {
            "statistic": stat,
            "null_sd": math.sqrt(law.variance(W)),
            "null_keys": null_keys,
            "z": scorer.contrast(ref, cand)["owner"],
            "p": tail.p,
            "log10_p": tail.log10_p,
            "tail": tail.method,
            "p_rank": (1 + int(np.sum(null >= stat))) / (null_keys + 1),
            "effective_contexts": scorer.effective_contexts(ref, cand),
        }
    if "greedy" in detectors:
        prompts = [format_prompt(tokenizer, r) for r in records]
        seqs = generate(model, tokenizer, prompts, max_new_tokens)
        score = KGWDetector(scheme).score(seqs)
        out["greedy"] = {"green": score.green, "scored": score.scored, "z": score.z, "p": score.p}
    return out
