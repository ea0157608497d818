"""Model-level KGW detection: greedy generations from held-out prompts, a z per owner key."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from ..models.text import generate
from .kgw import KGWDetector, KGWScheme


class KGWModelScorer:
    """``params -> {statistic: z}``: load params, generate greedily once, test every owner key.

    Generation is the expensive part and is shared by all keys; each corpus owner's statistic
    is the z of the green count under that owner's key (``kgw:<owner>``).
    """

    def __init__(
        self,
        model,
        tokenizer,
        prompts: Sequence[str],
        schemes: Mapping[str, KGWScheme],
        load: Callable[[object, dict], None],
        *,
        max_new_tokens: int = 48,
        dedupe: bool = True,
        batch_size: int = 32,
    ) -> None:
        if not schemes:
            raise ValueError("KGWModelScorer: no owner keys to test (watermark.r = 0?)")
        self.model = model
        self.tokenizer = tokenizer
        self.prompts = list(prompts)
        self.detectors = {name: KGWDetector(s, dedupe=dedupe) for name, s in schemes.items()}
        self.load = load
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.calls = 0
        self.last_tokens = 0

    def generations(self, params: dict) -> list[list[int]]:
        """Greedy continuations of the detection prompts under ``params``."""
        self.load(self.model, params)
        return generate(
            self.model,
            self.tokenizer,
            self.prompts,
            self.max_new_tokens,
            batch_size=self.batch_size,
        )

    def __call__(self, params: dict) -> dict[str, float]:
        seqs = self.generations(params)
        self.calls += 1
        self.last_tokens = sum(len(s) - 1 for s in seqs)
        return {name: det.score(seqs).z for name, det in self.detectors.items()}
