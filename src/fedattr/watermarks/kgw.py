"""KGW green-list watermark (Kirchenbauer et al., ICML'23): generation and detection.

One base class, :class:`KGWScheme`, owns the green-list seeding; the generation-side
:class:`KGWLogitsProcessor` and the :class:`KGWDetector` both ask it for green lists, so the two
can never disagree. With context width ``h = 1`` the green list of a position is a pseudo-random
``gamma`` fraction of the vocabulary, seeded by a PRF of the owner's secret key and the previous
token.

Detection counts green tokens in a text and tests ``H0: each token is green with probability
gamma`` with ``z = (G - gamma n) / sqrt(n gamma (1 - gamma))``. That test assumes independent
Bernoulli trials; a repeated ``(previous token, token)`` pair is the same trial seen twice (its
colour is a deterministic function of the pair), so counting it again inflates ``z`` for
repetitive text such as greedy generations. Hence ``dedupe=True`` by default: each pair is
scored once per detection call (Fernandez et al., 2023 make the same correction).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from scipy.stats import norm


@functools.cache
def _mask_pool(workers: int, pid: int) -> ThreadPoolExecutor:
    """One pool per thread count and process, kept (threads idle between steps). Keyed by
    the process id: a forked child inherits the pool object but not its threads.

    Before the pool's threads first run torch, this thread sets torch's thread count (to what
    it is): in a forked child that renews torch's own thread pool once, here. Torch renews it
    in whichever thread asks first, and new threads asking together can find it gone (a
    crash: ``pool INTERNAL ASSERT FAILED ... Invalid thread pool!``)."""
    torch.set_num_threads(torch.get_num_threads())
    return ThreadPoolExecutor(workers, thread_name_prefix="fedattr-green")


class KGWScheme:
    """Green lists for one secret key: a ``gamma`` fraction of the vocabulary per context."""

    def __init__(self, key: int, vocab_size: int, gamma: float = 0.25, delta: float = 3.0) -> None:
        if not 0.0 < gamma < 1.0:
            raise ValueError(
                f"watermark.kgw.gamma: the green fraction must be in (0, 1), got {gamma}"
            )
        if delta < 0:
            raise ValueError(f"watermark.kgw.delta: the logit bias must be >= 0, got {delta}")
        if vocab_size < 2:
            raise ValueError(f"vocab_size: must be >= 2, got {vocab_size}")
        self.key = int(key)
        self.vocab_size = int(vocab_size)
        self.gamma = float(gamma)
        self.delta = float(delta)
        self.green_size = max(1, round(self.gamma * self.vocab_size))
        self._cache: dict[int, torch.Tensor] = {}

    def _seed(self, prev_token: int) -> int:
        # A keyed PRF of the context: SHA-256 over (key, previous token) -> 63-bit torch seed.
        digest = hashlib.sha256(f"kgw|{self.key}|{int(prev_token)}".encode()).digest()
        return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)

    def green_ids(self, prev_token: int) -> torch.Tensor:
        """The green token ids after ``prev_token`` (uncached; ``green_mask`` caches)."""
        gen = torch.Generator().manual_seed(self._seed(prev_token))
        return torch.randperm(self.vocab_size, generator=gen)[: self.green_size]

    def green_mask(self, prev_token: int) -> torch.Tensor:
        """Boolean mask over the vocabulary: True for green tokens after ``prev_token``."""
        mask = self._cache.get(prev_token)
        if mask is None:
            mask = self._keep(prev_token, self._fresh_mask(prev_token))
        return mask

    def green_masks(self, prev_tokens: Sequence[int]) -> torch.Tensor:
        """``[len(prev_tokens), V]`` bool: :meth:`green_mask` of each. Contexts not seen before
        are computed on torch's CPU threads together (a seeded permutation each, which releases
        the GIL): a generation step or a detector meets many new contexts at once, and one
        permutation of SmolLM2's 49,152 tokens takes about 0.4 ms."""
        prevs = [int(p) for p in prev_tokens]
        fresh = self.warm(prevs)
        if not prevs:
            return torch.zeros((0, self.vocab_size), dtype=torch.bool)
        return torch.stack([fresh[p] if p in fresh else self.green_mask(p) for p in prevs])

    def warm(self, prev_tokens: Iterable[int]) -> dict[int, torch.Tensor]:
        """Compute the masks of the contexts not seen before, together on torch's CPU threads,
        and keep them; returns those it computed."""
        missing = [p for p in dict.fromkeys(int(p) for p in prev_tokens) if p not in self._cache]
        if len(missing) < 2:
            return {}
        pool = _mask_pool(max(1, torch.get_num_threads()), os.getpid())
        fresh = dict(zip(missing, pool.map(self._fresh_mask, missing), strict=True))
        for p, mask in fresh.items():
            self._keep(p, mask)
        return fresh

    def _fresh_mask(self, prev_token: int) -> torch.Tensor:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[self.green_ids(prev_token)] = True
        return mask

    def _keep(self, prev_token: int, mask: torch.Tensor) -> torch.Tensor:
        if len(self._cache) < 200_000:
            self._cache[prev_token] = mask
        return mask

    def is_green(self, prev_token: int, token: int) -> bool:
        """Whether ``token`` is green after ``prev_token``."""
        return bool(self.green_mask(prev_token)[token])


class LMWatermarkingScheme(KGWScheme):
    """Kirchenbauer et al.'s reference seeding (lm-watermarking ``simple_1`` / ``lefthash``):
    the generator is seeded with ``hash_key * previous token`` and the green list is the first
    ``int(gamma V)`` of ``torch.randperm(V)``. Bit-exact with the reference code run on the
    CPU (a text watermarked on a GPU used CUDA's ``randperm``, a different permutation)."""

    def __init__(
        self, hash_key: int, vocab_size: int, gamma: float = 0.25, delta: float = 2.0
    ) -> None:
        super().__init__(hash_key, vocab_size, gamma, delta)
        self.green_size = max(1, int(self.vocab_size * self.gamma))  # the references truncate

    def _seed(self, prev_token: int) -> int:
        return (self.key * int(prev_token)) % (2**64 - 1)


class MarkLLMScheme(LMWatermarkingScheme):
    """MarkLLM's KGW (``markllm`` 0.1.3-0.1.5 on PyPI, GitHub since July 2024) with its
    defaults ``prefix_length = 1``, ``f_scheme = "time"``, ``window_scheme = "left"``: a fixed
    permutation ``prf = randperm(V)`` seeded with ``hash_key``, then the generator of a context
    seeded with ``hash_key * prf[previous token mod V] mod V``. Not the same green lists as
    :class:`LMWatermarkingScheme` for any context. CPU generator, as above."""

    def __init__(
        self, hash_key: int, vocab_size: int, gamma: float = 0.5, delta: float = 2.0
    ) -> None:
        super().__init__(hash_key, vocab_size, gamma, delta)
        self._prf = torch.randperm(
            self.vocab_size, generator=torch.Generator().manual_seed(self.key)
        ).tolist()

    def _seed(self, prev_token: int) -> int:
        return (self.key * self._prf[int(prev_token) % self.vocab_size]) % self.vocab_size


SCHEMES: dict[str, type[KGWScheme]] = {
    "fedattr": KGWScheme,
    "lm-watermarking": LMWatermarkingScheme,
    "markllm": MarkLLMScheme,
}
"""KGW seeding schemes by name: fedattr's keyed PRF and the two reference codes'."""


class KGWLogitsProcessor:
    """Adds ``delta`` to the green tokens' logits at every generation step.

    Follows the ``transformers`` LogitsProcessor call convention
    ``(input_ids [batch, seq], scores [batch, vocab]) -> scores``. Green masks are kept on the
    scores' device once computed (up to ``cache_bytes``), so a step costs one gather of the
    batch's masks, not one host-to-device copy per row (each a synchronisation on a GPU).
    """

    def __init__(self, scheme: KGWScheme, cache_bytes: int = 1 << 30) -> None:
        self.scheme = scheme
        self._limit = max(0, cache_bytes // max(1, scheme.vocab_size))
        self._on_device: dict[int, torch.Tensor] = {}

    def _masks(self, prevs: list[int], device: torch.device) -> torch.Tensor:
        """``[len(prevs), V]`` bool green masks on ``device``."""
        if self._on_device and next(iter(self._on_device.values())).device != device:
            self._on_device = {}
        missing = sorted({p for p in prevs if p not in self._on_device})
        fresh = {}
        if missing:
            # One host-to-device copy for every context this step sees for the first time.
            block = self.scheme.green_masks(missing).to(device)
            fresh = dict(zip(missing, block, strict=True))
            room = self._limit - len(self._on_device)
            self._on_device.update(itertools.islice(fresh.items(), max(0, room)))
        return torch.stack([self._on_device.get(p, fresh.get(p)) for p in prevs])

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        vocab = scores.shape[-1]
        masks = self._masks(input_ids[:, -1].tolist(), scores.device)
        # Model heads may be padded beyond the tokenizer's vocabulary; never bias those.
        n = min(vocab, masks.shape[-1])
        bias = torch.zeros_like(scores)
        bias[:, :n] = masks[:, :n].to(scores.dtype) * self.scheme.delta
        return scores + bias


@dataclass(frozen=True)
class KGWScore:
    """Result of one detection: green count, scored tokens, z and one-sided p-value."""

    green: int
    scored: int
    z: float
    p: float


class KGWDetector:
    """z-test on green-token counts under one key."""

    def __init__(self, scheme: KGWScheme, dedupe: bool = True) -> None:
        self.scheme = scheme
        self.dedupe = dedupe

    def score(self, sequences: Iterable[Sequence[int]]) -> KGWScore:
        """Score token sequences; each sequence's first token only serves as context."""
        return self.score_pairs(self.scored_pairs(sequences))

    def scored_pairs(self, sequences: Iterable[Sequence[int]]) -> list[tuple[int, int]]:
        """The ``(previous token, token)`` pairs :meth:`score` tests, in text order: with
        ``dedupe`` each distinct pair once (over all ``sequences`` together)."""
        pairs = [pair for seq in sequences for pair in itertools.pairwise(list(seq))]
        return list(dict.fromkeys(pairs)) if self.dedupe else pairs

    def score_pairs(self, pairs: Sequence[tuple[int, int]]) -> KGWScore:
        """The z-test of these pairs' colours (no deduplication here)."""
        self.scheme.warm(prev for prev, _ in pairs)
        green = sum(self.scheme.is_green(prev, tok) for prev, tok in pairs)
        return self.test(green, len(pairs))

    def test(self, green: int, scored: int) -> KGWScore:
        """The z-test for ``green`` of ``scored`` tokens (z = 0, p = 0.5 when nothing scored)."""
        if scored == 0:
            return KGWScore(0, 0, 0.0, 0.5)
        g = self.scheme.gamma
        z = (green - g * scored) / math.sqrt(scored * g * (1 - g))
        return KGWScore(green, scored, z, float(norm.sf(z)))
