"""Teacher-forced reading of fixed texts: batches of similar length, and logits only where a
detector reads them.

A detector that reads a model (the KGW reading test, the fictitious-knowledge probes) needs the
next-token distribution at a few positions of each text: the response, the answer. Two things
make a read cheaper without changing a value beyond float rounding: batching texts of similar
length (less padding to push through the model) and running the output layer, the largest
matmul of a small model and a large-vocabulary one alike, only at the positions read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def length_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices of ``lengths`` sorted longest first (ties in input order) and cut into batches
    of ``batch_size``: the first batch is the widest, so a read's peak memory shows at once."""
    if batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[b : b + batch_size] for b in range(0, len(order), batch_size)]


def output_layer(model) -> torch.nn.Module | None:
    """The module :func:`logits_at` hooks (``get_output_embeddings()``), or ``None``: then a
    read computes every position's logits."""
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def logits_at(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """The model's logits at the flat positions ``rows`` (row-major indices into the
    ``[batch, width]`` input), as a ``[len(rows), vocab]`` tensor.

    The output layer (:func:`output_layer`) sees only those positions' hidden states, by a
    forward pre-hook that gathers them (as ``[len(rows), 1, hidden]``: rows stay the leading
    dimension, as a stacked LoRA head needs); a model without one, or whose output layer does
    not receive one hidden state per input position, computes every position's logits and the
    rows are taken from them (the same values). Logits of any other shape are an error, never
    rows picked from the wrong positions.
    """
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
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
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
