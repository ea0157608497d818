"""Model-level KGW detection, a z per owner key.

Two detectors: :class:`KGWModelScorer` (the paper's: greedy generations from held-out
prompts, z-test on green counts; FedAttr subtracts the reference's z) and
:class:`KGWReadingScorer` (fedattr's paired teacher-forced test of the change itself, see its
docstring; much more sensitive on small models).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import NamedTuple

import numpy as np
import torch

from ..models.lora import dual_adapters, folded_adapters
from ..models.reading import forward_ad_attention, length_batches, logits_at, output_layer
from ..models.text import Example, generate, padded
from .kgw import KGWDetector, KGWScheme
from .nullkeys import RandomGreenLists
from .tail.laws import RowSubsets


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
        return {name: det.score(seqs).z for name, det in self.detectors.items()}


def _first_occurrences(ids: Sequence[int], positions: Sequence[int]) -> list[int]:
    """The positions whose token (the previous token of what they predict) is at no earlier
    position of ``positions``."""
    seen: set[int] = set()
    kept = []
    for t in positions:
        if ids[t] not in seen:
            seen.add(ids[t])
            kept.append(t)
    return kept


class _ReadBatch(NamedTuple):
    """One probe batch of :class:`ContextReads`: padded ids and mask, the scored
    positions as flat indices into them, and each scored position's context group."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    rows: torch.Tensor
    groups: torch.Tensor


class ReadPlan(NamedTuple):
    """What a read reads: each text (up to its last read position), the positions read in it
    (position ``t`` predicts token ``t + 1``), each read position's context row, and the
    number of context rows."""

    texts: list[list[int]]
    reads: list[list[int]]
    groups: list[torch.Tensor]
    contexts: int

    @staticmethod
    def joined(plans: Sequence[ReadPlan]) -> tuple[ReadPlan, list[int]]:
        """One plan reading every plan's texts, each plan's context rows after the previous
        plans' (one pass over several owners' documents instead of one per owner), and the
        first of each plan's rows in it."""
        texts: list[list[int]] = []
        reads: list[list[int]] = []
        groups: list[torch.Tensor] = []
        starts: list[int] = []
        offset = 0
        for plan in plans:
            starts.append(offset)
            texts += plan.texts
            reads += plan.reads
            groups += [g + offset for g in plan.groups]
            offset += plan.contexts
        return ReadPlan(texts, reads, groups, offset), starts


CPU_READ_TOKENS = 1024
"""Padded tokens per forward pass of a read on a CPU (:func:`length_batches`' cap): the
embedded default's reads of its owners' documents took 0.13 s per model at 16 texts a batch,
about 0.10 s at 1,024 tokens (2 cores). An accelerator reads in full batches."""


class ContextReads:
    """A model's next-token distributions at a :class:`ReadPlan`'s positions, summed per
    context row: ``[contexts, vocab]`` float32 per model read.

    ``stack(model, states)``: a context in which one forward pass over candidate-major rows
    runs each state's parameters (:func:`fedattr.models.lora.stacked_candidates`); with it
    :meth:`observe_many` reads several candidates per pass, as many as keep one pass's float32
    probabilities within ``pass_bytes``."""

    def __init__(
        self,
        model,
        load: Callable[[object, dict], None],
        plan: ReadPlan,
        vocab: int,
        *,
        pad_id: int = 0,
        batch_size: int = 16,
        stack: Callable[[object, Sequence[dict]], AbstractContextManager] | None = None,
        pass_bytes: int = 1 << 30,
    ) -> None:
        self.model, self.load, self.stack, self.pass_bytes = model, load, stack, pass_bytes
        self.vocab, self.contexts = vocab, plan.contexts
        on_cpu = next(model.parameters()).device.type == "cpu"
        self.batches: list[_ReadBatch] = []
        lengths = [len(t) for t in plan.texts]
        for idx in length_batches(lengths, batch_size, CPU_READ_TOKENS if on_cpu else None):
            ids, mask = padded([plan.texts[i] for i in idx], pad_id)
            width = ids.shape[1]
            at = [torch.tensor(plan.reads[i], dtype=torch.long) for i in idx]
            rows = torch.cat([a + k * width for k, a in enumerate(at)])
            groups = torch.cat([plan.groups[i] for i in idx])
            self.batches.append(_ReadBatch(ids, mask, rows, groups))

    @torch.no_grad()
    def observe(self, params: dict) -> torch.Tensor:
        """The distributions summed per context row under ``params``."""
        self.load(self.model, params)
        return self._read(1)[0]

    @torch.no_grad()
    def observe_many(self, many: Sequence[dict]) -> list[torch.Tensor]:
        """:meth:`observe` of every parameter set, several per forward pass with ``stack``."""
        many = list(many)
        if self.stack is None or len(many) < 2:
            return [self.observe(p) for p in many]
        # Probabilities of the read positions only where the output layer can be hooked,
        # else of every position of the widest batch.
        hooked = output_layer(self.model) is not None
        per_candidate = (
            self.vocab
            * 4
            * max(len(b.rows) if hooked else b.input_ids.numel() for b in self.batches)
        )
        group = max(1, min(len(many), self.pass_bytes // max(1, per_candidate)))
        out: list[torch.Tensor] = []
        for start in range(0, len(many), group):
            with self.stack(self.model, many[start : start + group]) as count:
                out.extend(self._read(count))
        return out

    @torch.no_grad()
    def first_order(self, params: dict, tangents: Sequence[dict]) -> list[torch.Tensor]:
        """For each tangent ``u`` (LoRA factors named as ``params``' keys): the directional
        derivative of :meth:`observe` at ``params`` along ``u``, ``d/ds observe(params + s u)``
        at ``s = 0`` (``[contexts, vocab]``, float32), by forward-mode AD. Linear in ``u``:
        the first-order change ``u`` makes, whatever its size (additive shares of an update
        read one by one add up to the update's own; see :mod:`fedattr.attribution.sealed`)."""
        import torch.autograd.forward_ad as fwAD

        self.load(self.model, params)
        out = []
        with fwAD.dual_level(), forward_ad_attention():
            for tangent in tangents:
                with dual_adapters(self.model, tangent):
                    out.append(self._read(1, tangent=True)[0])
        return out

    def _read(self, count: int, tangent: bool = False) -> list[torch.Tensor]:
        """The plan read by the model as it stands, each batch repeated ``count`` times
        candidate-major (inside a stacked context: one row block per candidate). ``tangent``:
        the distributions' forward-mode tangents instead (inside :meth:`first_order`)."""
        was_training = self.model.training
        self.model.eval()
        device = next(self.model.parameters()).device
        out = [
            torch.zeros((self.contexts, self.vocab), dtype=torch.float32, device=device)
            for _ in range(count)
        ]
        # LoRA factors folded into the weights for the read (not inside a stacked pass, whose
        # layers are patched already: folded_adapters declines those itself). Not for tangents:
        # folding skips an adapter whose B is zero (FLoRA's reset, FedIT's first round), whose
        # factors' tangents still move the model.
        with contextlib.nullcontext() if tangent else folded_adapters(self.model):
            for b in self.batches:
                ids, mask = b.input_ids.to(device), b.attention_mask.to(device)
                rows = b.rows.to(device)
                if count > 1:
                    ids, mask = ids.repeat(count, 1), mask.repeat(count, 1)
                    rows = torch.cat([rows + c * b.input_ids.numel() for c in range(count)])
                logits = logits_at(self.model, ids, mask, rows)
                # Renormalised over the tokenizer's vocabulary (heads may be padded beyond
                # it), so that every row of a change sums to zero.
                probs = torch.softmax(logits[:, : self.vocab].float(), dim=-1)
                if tangent:
                    import torch.autograd.forward_ad as fwAD

                    probs = fwAD.unpack_dual(probs).tangent
                    if probs is None:  # the tangent reaches nothing read: no change
                        probs = torch.zeros_like(logits[:, : self.vocab], dtype=torch.float32)
                groups = b.groups.to(device)
                for c, block in enumerate(probs.split(len(b.rows))):
                    out[c].index_add_(0, groups, block)
        if was_training:
            self.model.train()
        return out


class KGWReadingScorer:
    """Paired teacher-forced KGW test ("reading mode"): ``observe`` / ``contrast``.

    The model reads fixed held-out clean examples (their loss positions, i.e. the response); at
    each response position it predicts a distribution ``p`` over the next token, whose green
    list is set by the previous (true) token ``x``. ``observe`` sums the distributions per
    previous token, ``A[x] = sum of p over the positions that follow x``. For a change
    ``D = A(candidate) - A(reference)`` the statistic is the green mass it moved,

        S = sum_x <D[x], green(x)>,   z = S / sqrt(v * sum_x ||D[x]||^2),

    with ``v = m (V - m) / (V (V - 1))`` for green lists of ``m`` of ``V`` tokens. Under the
    null that the change is independent of the owner's key (green lists uniformly random per
    context), ``E[S] = 0`` (rows of ``D`` sum to zero) and ``Var[S] = v sum_x ||D[x]||^2``
    exactly; grouping by ``x`` accounts for positions that share a green list (the soft
    analogue of de-duplicating repeated pairs). The test is scale-free: it asks whether the
    change points towards the green lists, not how big it is, which is what makes it far more
    sensitive than the difference of two greedy-generation z-scores on small models.
    """

    exchangeable_rounds: int | None = 1
    """A random key's green lists are exchangeable with the owner's while no model has learned
    text the owner marked: in round 1, whose reference is the base model. From round 2 the
    reference has learned the watermarked clients' documents and the green bias they carry
    (see ``attribution.calibrated.late_rounds``)."""

    def __init__(
        self,
        model,
        examples: Sequence[Example],
        schemes: Mapping[str, KGWScheme],
        load: Callable[[object, dict], None],
        *,
        pad_id: int = 0,
        batch_size: int = 16,
        stack: Callable[[object, Sequence[dict]], AbstractContextManager] | None = None,
        pass_bytes: int = 1 << 30,
        first_only: bool = False,
    ) -> None:
        """``stack(model, states)``: a context in which one forward pass over candidate-major
        rows runs each state's parameters (:func:`fedattr.models.lora.stacked_candidates`);
        with it :meth:`observe_many` reads several candidates per pass, as many as keep one
        pass's float32 probabilities within ``pass_bytes``.

        ``first_only``: read a position only if its previous token ``x`` precedes no earlier
        read position of the same text. For texts written under a key (an owner's documents),
        the tokens after an earlier ``x`` are green under ``x``'s list, and a model can copy
        them in context: at a first occurrence the text before it was written without that
        list, so what any key-free model predicts there is independent of it."""
        if not schemes:
            raise ValueError("KGWReadingScorer: no owner keys to test (watermark.r = 0?)")
        vocabs = {s.vocab_size for s in schemes.values()}
        if len(vocabs) != 1:
            raise ValueError("KGWReadingScorer: all owner keys must share one vocabulary size")
        self.vocab = vocabs.pop()
        # Read each example's loss positions: position t predicts token t + 1 after ids[t].
        self.examples: list[Example] = []
        reads: list[list[int]] = []  # each text's read positions
        for ex in examples:
            scored = [t for t in range(len(ex.input_ids) - 1) if ex.labels[t + 1] != -100]
            if scored:
                at = list(range(scored[0], len(ex.input_ids) - 1))
                if first_only:
                    at = _first_occurrences(ex.input_ids, at)
                self.examples.append(ex)
                reads.append(at)
        if not self.examples:
            raise ValueError("KGWReadingScorer: no texts to read (watermark.detect.prompts)")
        pairs = zip(self.examples, reads, strict=True)
        prevs = [ex.input_ids[t] for ex, at in pairs for t in at]
        contexts, inverse = torch.unique(torch.tensor(prevs), return_inverse=True)
        self.contexts = contexts
        self.positions = len(prevs)
        groups = torch.split(inverse, [len(at) for at in reads])
        # What every read reads. A probe's last token is not fed: no read position follows it
        # (position t predicts token t + 1), and a causal model reads the earlier positions the
        # same without it.
        texts = [ex.input_ids[: at[-1] + 1] for ex, at in zip(self.examples, reads, strict=True)]
        self.plan = ReadPlan(texts, reads, list(groups), len(contexts))
        # Its batches are built on the first read: a scorer whose plan another reads (one of
        # KGWDocumentScorer's owners) never builds them.
        self._reads = functools.partial(
            ContextReads,
            model,
            load,
            self.plan,
            self.vocab,
            pad_id=pad_id,
            batch_size=batch_size,
            stack=stack,
            pass_bytes=pass_bytes,
        )
        self.green = {name: s.green_masks(contexts.tolist()) for name, s in schemes.items()}
        m = self._green_size = next(iter(schemes.values())).green_size
        self._null_var = m * (self.vocab - m) / (self.vocab * (self.vocab - 1))
        self._green_share = m / self.vocab
        self._green_device = torch.device("cpu")
        self._null: RandomGreenLists | None = None  # the random keys, kept between rounds

    @functools.cached_property
    def reads(self) -> ContextReads:
        """The plan's reads (built on first use)."""
        return self._reads()

    def observe(self, params: dict) -> torch.Tensor:
        """``A[x]``: the model's next-token distributions summed per previous token (a
        ``[contexts, vocab]`` float32 tensor on the model's device)."""
        return self.reads.observe(params)

    @property
    def batched(self) -> bool:
        """Whether :meth:`observe_many` reads several candidates per pass (with ``stack``)."""
        return self.reads.stack is not None

    def observe_many(self, many: Sequence[dict]) -> list[torch.Tensor]:
        """:meth:`observe` of every parameter set, several candidates per forward pass when the
        scorer can stack them (same values up to float rounding), else one at a time."""
        return self.reads.observe_many(many)

    def contrast(self, reference: torch.Tensor, candidate: torch.Tensor) -> dict[str, float]:
        """The z of the green mass moved from ``reference`` to ``candidate``, per owner key."""
        change = (candidate - reference).double()
        spread = float((change * change).sum()) * self._null_var
        if spread <= 0.0:
            return dict.fromkeys(self.green, 0.0)
        scale = math.sqrt(spread)
        # <D, green - m/V>: exactly mean-free under the null even where float32 softmax rows
        # do not sum to exactly one.
        drift = self._green_share * float(change.sum())
        green = self._green_on(change.device)
        return {name: (float(change[g].sum()) - drift) / scale for name, g in green.items()}

    def change(self, reference: torch.Tensor, candidate: torch.Tensor) -> dict[str, torch.Tensor]:
        """``D = A(candidate) - A(reference)`` (``[contexts, vocab]``): every owner's green mass
        moved is ``<D, green>``, linear in the key."""
        return {"probes": (candidate - reference).float()}

    def first_order(self, params: dict, tangents: Sequence[dict]) -> list[dict[str, torch.Tensor]]:
        """Per tangent: the first-order change it makes at ``params`` (:meth:`change` of
        ``params + s u`` against ``params``, divided by ``s``, as ``s -> 0``), per part;
        linear in the tangent (:meth:`ContextReads.first_order`)."""
        return [{"probes": d} for d in self.reads.first_order(params, tangents)]

    def reference_probabilities(self, reference: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each cell's mean next-token probability under the reference: ``A[x] / |A[x]|``
        (``A[x]`` sums the distributions of the positions that follow ``x``)."""
        total = reference.double().sum(dim=1, keepdim=True).clamp_min(1e-30)
        return {"probes": (reference.double() / total).float()}

    def key_laws(self) -> dict[str, RowSubsets]:
        """A random key: every context's green list a uniform ``m``-subset of the vocabulary."""
        return {"probes": RowSubsets(self._green_size, self.vocab)}

    def owner_keys(self, part: str) -> dict[str, torch.Tensor]:
        """Every owner's green mask ``[contexts, vocab]``: ``owner_values`` is ``<W, mask>``."""
        return dict(self.green)

    def owner_values(self, part: str, W: torch.Tensor) -> dict[str, float]:
        """``<W, green>`` under every owner's key (``W`` row-centred: exactly the green mass
        above its null share)."""
        green = self._green_on(W.device)
        W = W.reshape(len(self.contexts), self.vocab)
        return {name: float(W[g].double().sum()) for name, g in green.items()}

    def owner_values_rows(self, part: str, rows: torch.Tensor, lo: int) -> dict[str, float]:
        """:meth:`owner_values` of rows ``lo : lo + len(rows)`` of ``W`` (a change read by row
        blocks, ``attribution.calibrated.spill``): summed over the blocks, the same values."""
        green = self._green_on(rows.device)
        rows = rows.reshape(-1, self.vocab)
        hi = lo + len(rows)
        return {name: float(rows[g[lo:hi]].double().sum()) for name, g in green.items()}

    def key_statistics(
        self, reference: torch.Tensor, candidate: torch.Tensor, n: int, seed: int
    ) -> dict[str, tuple[float, np.ndarray]]:
        """The green mass the change moved, ``<D, green - m/V>`` (the numerator of
        :meth:`contrast`, linear in small changes), under every owner's key and under ``n``
        fresh random keys (the same for every owner): the key-randomisation null."""
        return self.key_statistics_many(reference, [candidate], n, seed)[0]

    def key_statistics_many(
        self, reference: torch.Tensor, candidates: Sequence[torch.Tensor], n: int, seed: int
    ) -> list[dict[str, tuple[float, np.ndarray]]]:
        """:meth:`key_statistics` of several candidates in one pass over the null keys."""
        changes = torch.stack([(c - reference).float().reshape(-1) for c in candidates])
        drift = self._green_share * changes.sum(1, dtype=torch.float64)
        green = self._green_on(changes.device)
        owners = {
            name: (changes[:, g.reshape(-1)].sum(1, dtype=torch.float64) - drift).tolist()
            for name, g in green.items()
        }
        null = (self._null_keys(n, seed, changes.device).sums(changes) - drift[:, None]).cpu()
        return [
            {name: (values[i], null[i].numpy()) for name, values in owners.items()}
            for i in range(len(candidates))
        ]

    def _null_keys(self, n: int, seed: int, device: torch.device) -> RandomGreenLists:
        """The ``n`` random keys of ``seed`` over this scorer's contexts (kept between rounds)."""
        keys = self._null
        if keys is None or (keys.n, keys.seed, keys.device) != (n, seed, device):
            cells = len(self.contexts) * self.vocab
            keys = self._null = RandomGreenLists(n, seed, cells, self._green_share, device)
        return keys

    def effective_contexts(self, reference: torch.Tensor, candidate: torch.Tensor) -> float:
        """How many contexts the change is spread over, ``(sum ||D[x]||^2)^2 / sum ||D[x]||^4``:
        the reading z's normal tail is trustworthy only when this is large."""
        per = ((candidate - reference).double() ** 2).sum(1)
        total = float(per.sum())
        return total * total / float((per * per).sum()) if total > 0 else 0.0

    def probe_values(self, observation: torch.Tensor) -> np.ndarray:
        """Per probe (owner key, previous-token context): the green mass above its null share
        (``<A[x], green(x)> - (m/V) sum A[x]``), flat over owners then contexts."""
        green = self._green_on(observation.device)
        excess = [
            (observation * g).sum(1) - self._green_share * observation.sum(1)
            for g in (green[name] for name in sorted(green))
        ]
        return torch.cat(excess).double().cpu().numpy()

    def _green_on(self, device: torch.device) -> dict[str, torch.Tensor]:
        if self._green_device != device:
            self.green = {name: g.to(device) for name, g in self.green.items()}
            self._green_device = device
        return self.green
