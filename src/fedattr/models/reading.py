"""Teacher-forced reading of fixed texts: batches of similar length, and logits only where a
detector reads them.

A detector that reads a model (the KGW reading test, the fictitious-knowledge probes) needs the
next-token distribution at a few positions of each text: the response, the answer. Two things
make a read cheaper without changing a value beyond float rounding: batching texts of similar
length (less padding to push through the model) and running the output layer, the largest
matmul of a small model and a large-vocabulary one alike, only at the positions read.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import torch

from .text import padded


@contextmanager
def forward_ad_attention() -> Iterator[None]:
    """Scaled-dot-product attention in PyTorch's math kernel, which forward-mode AD goes
    through (the fused CPU flash kernel has no forward derivative); the same values up to
    float rounding."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield


def length_batches(
    lengths: Sequence[int], batch_size: int, max_tokens: int | None = None
) -> list[list[int]]:
    """Indices of ``lengths`` sorted longest first (ties in input order) and cut into batches
    of ``batch_size``: the first batch is the widest, so a read's peak memory shows at once.

    ``max_tokens``: also cut a batch before its padded size (members x its first, widest
    member's length) would pass it (a batch holds at least one text). On a CPU a forward pass
    costs about its padded tokens, so a cap keeps long texts in small batches and short ones in
    large, with little padding either way (the embedded default's reads: 6,300 padded tokens
    for 5,800 real at 1,024, 8,300 at 16 texts a batch)."""
    if batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    cap = math.inf if max_tokens is None else max_tokens
    out: list[list[int]] = []
    for i in order:
        last = out[-1] if out else None
        if last and len(last) < batch_size and (len(last) + 1) * lengths[last[0]] <= cap:
            last.append(i)
        else:
            out.append([i])
    return out


def output_layer(model) -> torch.nn.Module | None:
    """The module :func:`logits_at` hooks (``get_output_embeddings()``), or ``None``: then a
    read computes every position's logits."""
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def logits_at(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    rows: torch.Tensor,
    **model_inputs,
) -> torch.Tensor:
    """The model's logits at the flat positions ``rows`` (row-major indices into the
    ``[batch, width]`` input), as a ``[len(rows), vocab]`` tensor.

    The output layer (:func:`output_layer`) sees only those positions' hidden states, by a
    forward pre-hook that gathers them (as ``[len(rows), 1, hidden]``: rows stay the leading
    dimension, as a stacked LoRA head needs); a model without one, or whose output layer does
    not receive one hidden state per input position, computes every position's logits and the
    rows are taken from them (the same values). Logits of any other shape are an error, never
    rows picked from the wrong positions. ``model_inputs`` go to the model as they are (a
    cache under :func:`cache_keyword`, ``position_ids``); without a cache among them, a model
    configured to build one (a Hugging Face config's ``use_cache``) is told not to: a read or a
    training step never uses it again, and filling it cost 8% of a read of the embedded
    default's model.
    """
    if (
        "use_cache" not in model_inputs
        and not {"cache", "past_key_values"} & model_inputs.keys()
        and getattr(getattr(model, "config", None), "use_cache", False)
    ):
        model_inputs["use_cache"] = False
    head = output_layer(model)
    gathered: list[bool] = []

    def gather(_module, args):
        hidden = args[0] if args else None
        if not isinstance(hidden, torch.Tensor) or hidden.shape[:-1] != input_ids.shape:
            return None
        gathered.append(True)
        flat = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
        return (flat.unsqueeze(1), *args[1:])

    handle = head.register_forward_pre_hook(gather) if head is not None else None
    try:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, **model_inputs).logits
    finally:
        if handle is not None:
            handle.remove()
    expected = (len(rows),) if gathered else tuple(input_ids.shape)
    got = (logits.shape[:-1].numel(),) if gathered else tuple(logits.shape[:-1])
    if got != expected:
        raise ValueError(
            f"logits_at: the model returned logits of shape {tuple(logits.shape)} for input "
            f"{tuple(input_ids.shape)}; expected one row per "
            f"{'gathered position' if gathered else 'input position'}"
        )
    if gathered:
        return logits.reshape(len(rows), logits.shape[-1])
    return logits.reshape(-1, logits.shape[-1]).index_select(0, rows)


def sequence_logprobs(
    model,
    seqs: Sequence[tuple[list[int], int]],
    pad_id: int,
    batch_size: int,
    group: int = 1,
) -> torch.Tensor:
    """For every ``(ids, first)``: ``sum_{t >= first} log p(ids[t] | ids[:t])`` (float64, on
    the CPU; ``first`` below 1 counts from 1: the first token has no prediction). One read of
    a :class:`SequenceReader` (which a detector reading the same sequences often keeps)."""
    return SequenceReader(seqs, pad_id, batch_size, group)(model)


class _Part(NamedTuple):
    """One forward pass of a :class:`SequenceReader`: right-padded inputs (each member's
    tokens after its ``skip`` already in a prefix cache, up to its last input), the flat
    positions read with their target tokens and the member each belongs to, and the output
    slot of each member. With a prefix: each member's row in the prefix cache and its
    positions (after the prefix)."""

    ids: torch.Tensor
    mask: torch.Tensor
    rows: torch.Tensor
    targets: torch.Tensor
    owner: torch.Tensor
    index: torch.Tensor
    cache_rows: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None


def _part(
    members: Sequence[tuple[list[int], int, int]],
    index: Sequence[int],
    pad_id: int,
    cache_rows: Sequence[int] | None = None,
) -> _Part:
    """The :class:`_Part` of ``members = (ids, first, skip)``."""
    # A sequence's last token is not fed: no read position follows it.
    ids_t, mask = padded(
        [ids[skip : max(len(ids) - 1, skip + 1)] for ids, _, skip in members], pad_id
    )
    width = ids_t.shape[1]
    rows, targets, owner = [], [], []
    for r, (ids, first, skip) in enumerate(members):
        first = max(first, 1)
        # Position t predicts token t + 1: the scored tokens first .. len - 1.
        rows.extend(range(r * width + first - 1 - skip, r * width + len(ids) - 1 - skip))
        targets.extend(ids[first:])
        owner.extend([r] * (len(ids) - first))
    as_index = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    positions = None
    if cache_rows is not None:
        positions = as_index([skip for _, _, skip in members])[:, None] + torch.arange(width)
    return _Part(
        ids_t,
        mask,
        as_index(rows),
        as_index(targets),
        as_index(owner),
        as_index(list(index)),
        None if cache_rows is None else as_index(cache_rows),
        positions,
    )


def cache_keyword(model) -> str:
    """The keyword under which ``model``'s forward takes a cache: ``cache`` in the
    transformers versions that renamed it, ``past_key_values`` before (later versions warn
    about the old name and will drop it). Read from the forward's signature, a peft wrapper's
    base model's where there is one (a plain callable's own signature otherwise)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = inspect.signature(getattr(base, "forward", base)).parameters
    return "cache" if "cache" in params else "past_key_values"


class SequenceReader:
    """:func:`sequence_logprobs` of fixed sequences, planned once and read under any model.

    ``group``: consecutive blocks of that many sequences share a prompt (one question, its
    candidate answers). Each block's common prefix, up to its earliest scored position, then
    runs through the model once and its keys and values serve every continuation of the
    block (its cache, with explicit positions), instead of once per sequence: the
    same values up to float rounding. Blocks with no such prefix are read whole. The plan
    (prefixes, batches, padded inputs, read positions) is built here, not at every read.
    """

    def __init__(
        self, seqs: Sequence[tuple[list[int], int]], pad_id: int, batch_size: int, group: int = 1
    ) -> None:
        if group < 1:
            raise ValueError(f"group: must be >= 1, got {group}")
        self.size = len(seqs)
        blocks = [list(range(s, min(s + group, len(seqs)))) for s in range(0, len(seqs), group)]
        prefix = [_common_prefix([seqs[i] for i in b]) if group > 1 else 0 for b in blocks]
        whole = [i for b, p in zip(blocks, prefix, strict=True) if p == 0 for i in b]
        self._whole = [
            _part([(*seqs[whole[j]], 0) for j in chunk], [whole[j] for j in chunk], pad_id)
            for chunk in length_batches([len(seqs[i][0]) for i in whole], batch_size)
        ]
        self._shared: list[tuple[torch.Tensor, torch.Tensor, list[_Part]]] = []
        shared = [k for k, p in enumerate(prefix) if p > 0]
        for chunk in length_batches([prefix[k] for k in shared], max(1, batch_size // group)):
            ks = [shared[j] for j in chunk]
            ids, mask = padded([seqs[blocks[k][0]][0][: prefix[k]] for k in ks], pad_id)
            # (row of the prefix in the cache, sequence) of every continuation of these
            # blocks, continued in batches of similar continuation length (answers of 4 to
            # 11 tokens padded to the longest of 256 wasted 40% of the positions), each from
            # its own copy of the prefixes' cache expanded to its members.
            members = [(g, i) for g, k in enumerate(ks) for i in blocks[k]]
            rest = [len(seqs[i][0]) - prefix[ks[g]] for g, i in members]
            parts = [
                _part(
                    [(*seqs[members[j][1]], prefix[ks[members[j][0]]]) for j in part],
                    [members[j][1] for j in part],
                    pad_id,
                    cache_rows=[members[j][0] for j in part],
                )
                for part in length_batches(rest, max(1, batch_size // _CONTINUATION_SPLIT))
            ]
            self._shared.append((ids, mask, parts))

    def __call__(self, model) -> torch.Tensor:
        """The log-probability sums under ``model`` (float64, on the CPU)."""
        from transformers import DynamicCache

        device = next(model.parameters()).device
        keyword = cache_keyword(model)
        out = torch.zeros(self.size, dtype=torch.float64)
        for part in self._whole:
            _score(model, part, device, out)
        for ids, mask, parts in self._shared:
            cache = DynamicCache()
            mask = mask.to(device)
            # Only the keys and values are wanted: the output layer runs at one position.
            logits_at(
                model,
                ids.to(device),
                mask,
                torch.zeros(1, dtype=torch.long, device=device),
                use_cache=True,
                **{keyword: cache},
            )
            for n, part in enumerate(parts):
                past = cache if n == len(parts) - 1 else _fork(cache)
                rows = part.cache_rows.to(device)
                past.batch_select_indices(rows)
                _score(model, part, device, out, past=(past, mask[rows], keyword))
        return out


_CONTINUATION_SPLIT = 4  # continuation batches per prefix batch: a quarter of its sequences


def _fork(cache):
    """A copy of ``cache`` to select rows from and continue, sharing its key and value tensors
    instead of copying them (a deep copy cost 4% of a fictitious-knowledge read): a dynamic
    cache layer (transformers' ``DynamicLayer``) replaces its tensors when it selects rows,
    appends or crops, which is all a read does with it. (Its ``reset`` zeroes them in place
    in some transformers versions: a fork must never be reset.) Layers of any other kind are
    copied whole."""
    from transformers.cache_utils import DynamicLayer

    shared = {
        id(t): t
        for layer in getattr(cache, "layers", ())
        if type(layer) is DynamicLayer  # not a subclass (a sliding window) that may differ
        for t in vars(layer).values()
        if isinstance(t, torch.Tensor)
    }
    return copy.deepcopy(cache, shared)


def _common_prefix(block: Sequence[tuple[list[int], int]]) -> int:
    """How many leading tokens every sequence of ``block`` shares, before its earliest scored
    position's prediction (position ``first - 1`` must be computed with the continuation)."""
    first = min(max(f, 1) for _, f in block)
    n, ids = 0, [s for s, _ in block]
    while n < first - 1 and all(len(s) > n and s[n] == ids[0][n] for s in ids):
        n += 1
    return n


def _score(
    model, part: _Part, device: torch.device, out: torch.Tensor, past: tuple | None = None
) -> None:
    """``out[part.index]``: each member's scored log-probability sum; its first tokens are
    already in ``past = (cache, prefix mask, the forward's cache keyword)`` when given."""
    mask = part.mask.to(device)
    inputs = {}
    if past is not None:
        cache, prefix_mask, keyword = past
        inputs = {keyword: cache, "position_ids": part.position_ids.to(device)}
        mask = torch.cat([prefix_mask, mask], dim=1)
    logits = logits_at(model, part.ids.to(device), mask, part.rows.to(device), **inputs)
    logp = torch.log_softmax(logits.float(), dim=-1)
    tok = logp.gather(1, part.targets.to(device).unsqueeze(1)).squeeze(1)
    sums = torch.zeros(len(part.index), dtype=torch.float64, device=device)
    sums.index_add_(0, part.owner.to(device), tok.double())
    out[part.index] = sums.cpu()
