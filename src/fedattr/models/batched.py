"""A round's clients trained together: one pass over the shared frozen base for all of them.

:func:`train_clients` runs what :func:`~fedattr.models.training.train` runs for each client
(AdamW, linear warm-up then cosine decay, token-weighted loss over the batch, gradient-norm
clipping at 1, ``stop_after``), for every client at once:

- **Factors stacked.** Every adapted module's LoRA factors become ``A: [n, r, in]`` and
  ``B: [n, out, r]`` (one slot per client); the model's own adapters are not used inside. A
  patched forward runs the base layer once over every row of a pass and each client's rows
  through its own factors as two batched matmuls (prior art: Punica's and S-LoRA's
  many-adapter batches, mLoRA/ASPEN's several LoRA jobs over one base).
- **Each client its own optimizer.** The stacked factors live in one ``[n, P]`` buffer (and
  their gradients in another), so AdamW is a few element-wise operations for all clients,
  with each client's own learning rate (its scale, its schedule's step) and its own
  gradient-norm clip: the same arithmetic as torch's single-tensor AdamW and
  ``clip_grad_norm_``.
- **Each client its own data and steps.** A step takes each client's next batch (drawn by the
  client's own seed, as ``train`` draws it); a client that has taken all its steps leaves the
  batch, so uneven shards, epochs and ``stop_after`` need nothing else.
- **Passes of rows of about the same length.** Each client's batch is sorted by length
  (longest first); a pass takes the same run of places in that order from every client (rows
  of about the same length), as long a run as keeps it within ``max_tokens`` padded tokens.
  The base layers run on the pass's rows; the factors on a ``[clients x rows]`` grid, where a
  client short of rows has zero rows (no output, no gradient). The embedded default computes
  1.27 padded tokens a real one this way, ``train``'s micro-batches 1.59.
- **Only where it pays** (:func:`worth_training_together`): a pass must hold two clients'
  largest micro-batches, and two clients' optimizer states must fit
  (:func:`clients_at_once`); a pool otherwise trains one client after another.

Equivalence, and how it is checked. A client's step has the same token-weighted loss and the
same gradient, a sum over its rows; only the order of float additions differs (other matmul
shapes, passes instead of micro-batches), and AdamW, clipping and the schedule are the same
arithmetic. ``tests/test_batched.py`` trains one round of an in-process pool both ways from
the same state (FedIT and FLoRA; shards of 3 to 17 records, hence 1 to 5 steps an epoch and
short last batches; other epochs, learning-rate scales, ``stop_after`` and ``update_scale``)
and compares each client's mean loss and the update it submits: in float64 to 1e-9 (relative
norm of the difference, each client's whole update), where only reassociation separates the
two; in float32 to 2e-3 (updates) and 1e-5 (losses), as Adam's normalised steps carry the
rounding from step to step. LoRA dropout is off there.

LoRA dropout is not drawn as ``train`` draws it. ``train`` seeds torch's global generator per
client and draws masks over every position of each micro-batch, padding included: on the
embedded default about 13 million elements a step of ten clients, at about 25 ns an element on
a CPU (torch's Mersenne Twister) 0.3 s, more than half of what the whole batched step costs on
one core.
Drawing them as ``train`` does would keep that cost and tie a pass to the micro-batches'
widths. Here each client draws its own masks from its own stream, seeded by its training seed
(on the CPU NumPy's PCG64, a 32-bit uniform an element, so the rate is ``p`` to 2^-32, at
about 1 ns; on CUDA a torch generator of the device), once per step and module over its real
tokens in its batch's length order: they do not depend on which clients share a pass or how a
step is cut. The same rate, independent across elements, modules, steps and clients,
deterministic for a seed (a resumed round draws them again): the batched path is the
sequential one with other masks. ``tests/test_batched.py`` checks that statistically: the
rate and independence of the masks, and, with dropout on, each client's update within three
times the distance between the sequential path and itself with its masks redrawn.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from .lora import can_stack, lora_layers
from .reading import logits_at
from .text import Example
from .training import TrainSettings, cosine_with_warmup, epoch_batches, loss_precision

BETAS = (0.9, 0.999)
"""torch's AdamW defaults, which ``train`` uses."""
EPS = 1e-8
MAX_NORM = 1.0
"""``train``'s gradient-norm clip."""


@dataclass
class ClientJob:
    """One client's local training: the LoRA factors it starts from (named as
    :func:`~fedattr.models.lora.adapter_state` names them), its examples, settings, seed and
    share of its planned steps (as :func:`~fedattr.models.training.train` takes them)."""

    adapters: dict[str, torch.Tensor]
    examples: Sequence[Example]
    settings: TrainSettings
    seed: int
    stop_after: float = 1.0


@dataclass
class ClientResult:
    """A client's trained factors and what ``train`` would have returned."""

    adapters: dict[str, torch.Tensor]
    loss: float
    steps: int
    tokens: int

    def stats(self) -> dict[str, float]:
        """``{"loss", "steps", "tokens"}``, as :func:`~fedattr.models.training.train`."""
        return {"loss": self.loss, "steps": float(self.steps), "tokens": float(self.tokens)}


class _Schedule:
    """A client's plan, as ``train`` makes it: steps, learning rates and batches."""

    def __init__(self, job: ClientJob) -> None:
        s = job.settings
        if not job.examples:
            raise ValueError("train: no training examples")
        per_epoch = math.ceil(len(job.examples) / s.batch_size)
        total = per_epoch * s.epochs
        if s.max_steps:
            total = min(total, s.max_steps)
        self.stop = total if job.stop_after >= 1.0 else max(1, math.floor(job.stop_after * total))
        self.factor = cosine_with_warmup(total, round(s.warmup_ratio * total))
        self.lr, self.weight_decay = s.lr, s.weight_decay
        self.lengths = [len(e.input_ids) for e in job.examples]
        # Where each example is scored: position t predicts token t + 1 (train's shift).
        self.scored = [
            (
                [t for t, lab in enumerate(e.labels[1:]) if lab != -100],
                [lab for lab in e.labels[1:] if lab != -100],
            )
            for e in job.examples
        ]
        self.counts = [len(at) for at, _ in self.scored]
        self._batches = self._draw(np.random.default_rng(job.seed), s)

    def _draw(self, rng: np.random.Generator, s: TrainSettings) -> Iterator[list[int]]:
        while True:  # the next epoch's order only once this one is used up, as train draws
            yield from epoch_batches(self.lengths, s.batch_size, rng, s.group_by_length)

    def next_batch(self) -> list[int]:
        """The next step's example indices, longest first (ties in batch order)."""
        order = next(self._batches)
        return sorted(order, key=lambda i: -self.lengths[i])


class _Masks:
    """Each client's LoRA-dropout masks, from its own stream (see the module docstring)."""

    def __init__(self, seeds: Sequence[int], p: float, device: torch.device) -> None:
        self.p, self.device = p, device
        self.keep = 1.0 - p
        if device.type == "cpu":
            self._np = [np.random.PCG64([0x10AD, s]) for s in seeds]
            self._threshold = np.uint64(round(self.keep * 2**32))
        else:
            self._torch = [
                torch.Generator(device=device).manual_seed(
                    int(np.random.SeedSequence([0x10AD, s]).generate_state(1, np.uint64)[0] >> 1)
                )
                for s in seeds
            ]

    def draw(self, client: int, count: int) -> torch.Tensor:
        """``count`` keep-flags (bool) of ``client``'s stream, on the device."""
        if self.device.type == "cpu":
            raw = self._np[client].random_raw((count + 1) // 2).view(np.uint32)[:count]
            return torch.from_numpy(raw < self._threshold)
        gen = self._torch[client]
        return torch.rand(count, generator=gen, device=self.device) < self.keep


@dataclass
class _Pass:
    """One forward and backward pass: rows of several clients, grouped by client."""

    clients: list[int]
    """Stack slots, in row order."""
    members: list[list[int]]
    """Each client's example indices here, a run of its batch's length order."""
    first: list[int]
    """Each client's first row here: its place in its batch's length order."""
    width: int
    rows: int
    """The most rows a client has here."""
    index: torch.Tensor | None = None
    """``clients`` on the device; ``None``: every slot, in order."""
    slot: torch.Tensor | None = None
    """Each row's place in the ``[clients x rows]`` grid the factors run on; ``None``: every
    client has ``rows`` rows (the rows are the grid)."""


class _Stack:
    """Every client's factors as ``[n, ...]`` leaf tensors carved from one ``[n, P]`` buffer,
    their gradients from another: one clip and one AdamW for all clients."""

    def __init__(self, names: Sequence[str], jobs: Sequence[ClientJob], device, dtype) -> None:
        n = len(jobs)
        shapes = [tuple(jobs[0].adapters[k].shape) for k in names]
        sizes = [math.prod(s) for s in shapes]
        self.flat = torch.empty(n, sum(sizes), device=device, dtype=dtype)
        self.grad = torch.zeros_like(self.flat)
        self.exp_avg = torch.zeros_like(self.flat)
        self.exp_avg_sq = torch.zeros_like(self.flat)
        self.params: dict[str, torch.Tensor] = {}
        offset = 0
        for name, shape, size in zip(names, shapes, sizes, strict=True):
            block = slice(offset, offset + size)
            for c, job in enumerate(jobs):
                start = job.adapters[name]
                if tuple(start.shape) != shape:
                    raise ValueError(f"train_clients: {name} differs in shape between clients")
                self.flat[c, block].copy_(start.reshape(-1))
            param = self.flat[:, block].view(n, *shape).detach().requires_grad_(True)
            # Backward adds into this view of the one gradient buffer.
            param.grad = self.grad[:, block].view(n, *shape)
            self.params[name] = param
            offset += size

    def adapters(self, c: int) -> dict[str, torch.Tensor]:
        """Client ``c``'s factors, copied off the stack."""
        return {k: p[c].detach().clone() for k, p in self.params.items()}

    def step(self, lr: Sequence[float], weight_decay: Sequence[float], t: int) -> None:
        """Clip each client's gradient to norm 1, then one AdamW step at ``lr`` (0: the slot
        is left as it is)."""
        g = self.grad
        # clip_grad_norm_: the norm over every factor of the client, coefficient at most 1.
        norms = torch.linalg.vector_norm(g, 2, dim=1)
        g.mul_(torch.clamp(MAX_NORM / (norms + 1e-6), max=1.0)[:, None])
        # torch's single-tensor AdamW, its scalars per client (computed in float64 on the
        # host, as torch computes a Python float's).
        decay = [1 - r * w for r, w in zip(lr, weight_decay, strict=True)]
        if any(d != 1 for d in decay):
            self.flat.mul_(torch.tensor(decay, dtype=torch.float64).to(g)[:, None])
        step_size = torch.tensor([r / (1 - BETAS[0] ** t) for r in lr], dtype=torch.float64)
        step_size = step_size.to(g)
        self.exp_avg.lerp_(g, 1 - BETAS[0])
        self.exp_avg_sq.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
        denom = (self.exp_avg_sq.sqrt() / math.sqrt(1 - BETAS[1] ** t)).add_(EPS)
        self.flat.sub_(step_size[:, None] * self.exp_avg / denom)


_CPU_STATE_BYTES = 256 * 2**20
"""Stacked factors, gradients and AdamW moments held at once on a CPU (a quarter of SmolLM2's
training peak at r = 64; about two clients there, every client of the embedded default)."""
_CPU_PASS_BYTES = 512 * 2**20
"""Activations a pass may hold on a CPU (estimated, :func:`_bytes_per_token`)."""
_CPU_PASS_TOKENS = 2048
"""Padded tokens a pass holds at most on a CPU: on the embedded default's model passes of
2,048 trained faster than of 1,536 or 3,072 (1.35x against 1.27x one client after another,
one thread): smaller ones pay more per operation, larger ones more padding."""


def _factor_numel(model) -> int:
    """LoRA coordinates of one client."""
    return sum(
        layer.lora_A["default"].weight.numel() + layer.lora_B["default"].weight.numel()
        for layer in lora_layers(model).values()
    )


def _free_device_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def clients_at_once(model) -> int:
    """How many clients :func:`train_clients` should be given at once: their stacked factors,
    gradients and AdamW moments (four copies of a client's factors) within 256 MB on a CPU,
    an eighth of the device's free memory on CUDA."""
    first = next(iter(lora_layers(model).values()))
    weight = first.lora_A["default"].weight
    per_client = 4 * _factor_numel(model) * weight.element_size()
    free = _free_device_bytes(weight.device)
    budget = _CPU_STATE_BYTES if free is None else free // 8
    return max(1, budget // max(1, per_client))


def _bytes_per_token(model) -> int:
    """A rough upper bound on what one token of a training pass keeps for the backward pass:
    each layer's activations (attention, MLP, the adapters' inputs and masks) and the output
    layer's logits where a loss is taken."""
    cfg = getattr(model, "config", None)
    hidden = getattr(cfg, "hidden_size", 1024)
    layers = getattr(cfg, "num_hidden_layers", 24)
    inner = getattr(cfg, "intermediate_size", 4 * hidden)
    vocab = getattr(cfg, "vocab_size", 50_000)
    rank = next(iter(lora_layers(model).values())).lora_A["default"].weight.shape[0]
    return 4 * (layers * (14 * hidden + 4 * inner + 8 * rank) + 3 * vocab)


def _pass_tokens(model) -> int:
    """Padded tokens a pass may hold by memory and speed: within 512 MB of activations
    (estimated) and 2,048 tokens on a CPU, a quarter of the free memory on CUDA."""
    device = next(model.parameters()).device
    free = _free_device_bytes(device)
    per_token = _bytes_per_token(model)
    if free is None:
        return min(_CPU_PASS_TOKENS, _CPU_PASS_BYTES // per_token)
    return free // 4 // per_token


def _micro_tokens(micro_batch_size: int, examples: Iterable[Sequence[Example]]) -> int:
    """The largest micro-batch ``train`` holds: ``micro_batch_size`` of the longest example."""
    return micro_batch_size * max(len(e.input_ids) for shard in examples for e in shard)


def default_max_tokens(model, jobs: Sequence[ClientJob]) -> int:
    """Padded tokens a pass may hold (:func:`_pass_tokens`), never fewer than the largest
    micro-batch ``train`` would hold for these jobs."""
    floor = max(_micro_tokens(j.settings.micro_batch_size, [j.examples]) for j in jobs)
    return max(floor, _pass_tokens(model))


def worth_training_together(
    model, micro_batch_size: int, examples: Sequence[Sequence[Example]]
) -> bool:
    """Whether :func:`train_clients` can do better than one ``train`` per client here: its
    passes can hold two clients' largest micro-batches and it can take two clients at once.
    Where they cannot (SmolLM2 on a CPU: passes of 256 tokens, two clients' optimizer states
    in 256 MB), its passes would be ``train``'s micro-batches, one client at a time, and it
    only adds its bookkeeping (measured there: 173 s against 165 s for a round's training,
    2.79 GB against 2.68 GB at the peak)."""
    if len(examples) < 2 or clients_at_once(model) < 2:
        return False
    return _pass_tokens(model) >= 2 * _micro_tokens(micro_batch_size, examples)


def train_clients(
    model,
    jobs: Sequence[ClientJob],
    pad_id: int,
    *,
    max_tokens: int | None = None,
    on_done: Callable[[int, ClientResult], None] | None = None,
) -> list[ClientResult]:
    """Train every job's LoRA factors on its examples, all at once (see the module
    docstring); returns each job's result, in job order.

    ``model`` (a peft model whose adapted modules :func:`~fedattr.models.lora.can_stack`
    runs) lends its frozen base; its own adapters are neither used nor changed. Each job's
    ``adapters`` are copied into the stack and the job's dict emptied (not held twice).
    ``on_done(i, result)`` is called as job ``i`` takes its last step, with its trained
    factors in ``result.adapters`` (the callback may empty them to free them at once).
    ``max_tokens``: padded tokens a pass may hold (default :func:`default_max_tokens`)."""
    if not jobs:
        return []
    if not can_stack(model):
        raise ValueError("train_clients: the model has LoRA layers that cannot be stacked")
    layers = lora_layers(model)
    names = [f"{m}.{kind}" for m in layers for kind in ("lora_A", "lora_B")]
    missing = [k for k in names if any(k not in j.adapters for j in jobs)]
    if missing:
        raise KeyError(f"train_clients: a job has no {missing[0]}")
    device = next(model.parameters()).device
    first = next(iter(layers.values()))
    cap = max_tokens or default_max_tokens(model, jobs)
    stack = _Stack(names, jobs, device, first.lora_A["default"].weight.dtype)
    for job in jobs:
        job.adapters = {}  # in the stack now
    dropout = first.lora_dropout["default"]
    p = float(dropout.p) if isinstance(dropout, torch.nn.Dropout) else 0.0
    masks = _Masks([j.seed for j in jobs], p, device) if p > 0 else None
    plans = [_Schedule(j) for j in jobs]
    n = len(jobs)
    loss_dtype = torch.promote_types(first.base_layer.weight.dtype, torch.float32)
    losses: list[torch.Tensor] = []
    tokens = [0] * n
    results: list[ClientResult | None] = [None] * n
    ctx = _Context(stack, masks, device)
    model.train()
    longest = max(plan.stop for plan in plans)
    with _patched(model, ctx):
        for step in range(longest):
            active = [c for c in range(n) if plans[c].stop > step]
            batches = {c: plans[c].next_batch() for c in active}
            n_tokens = torch.zeros(n, dtype=torch.float64)
            for c, batch in batches.items():
                n_tokens[c] = max(1, sum(plans[c].counts[i] for i in batch))
                tokens[c] += sum(plans[c].lengths[i] for i in batch)
            weight = (1.0 / n_tokens).to(device=device, dtype=loss_dtype)
            step_loss = torch.zeros(n, device=device, dtype=loss_dtype)
            stack.grad.zero_()
            ctx.new_step(batches, plans)
            for chunk in _passes(batches, plans, cap, device):
                _run_pass(model, ctx, chunk, plans, jobs, pad_id, weight, step_loss)
            lr = [plans[c].lr * plans[c].factor(step) if c in batches else 0.0 for c in range(n)]
            stack.step(lr, [plan.weight_decay for plan in plans], step + 1)
            losses.append(step_loss)
            for c in active:
                if plans[c].stop == step + 1:
                    mine = torch.stack([row[c] for row in losses[-plans[c].stop :]])
                    result = ClientResult(
                        stack.adapters(c), float(mine.double().mean()), plans[c].stop, tokens[c]
                    )
                    results[c] = result
                    if on_done is not None:
                        on_done(c, result)
    return [r for r in results if r is not None]


def _passes(
    batches: dict[int, list[int]], plans: Sequence[_Schedule], cap: int, device
) -> list[_Pass]:
    """A step's passes. Each client's batch is in length order (longest first); a pass takes
    the same run of places in that order from every client (rows of about the same length),
    as long a run as keeps ``clients x rows x width`` within ``cap`` (where even one row a
    client does not fit, the clients are split between passes)."""
    clients = sorted(batches)
    most = max(len(b) for b in batches.values())
    out = []
    start = 0
    while start < most:
        here = [c for c in clients if len(batches[c]) > start]
        width = max(plans[c].lengths[batches[c][start]] for c in here)
        rows = max(1, min(most - start, cap // (len(here) * width)))
        per_pass = max(1, cap // (rows * width))
        for s in range(0, len(here), per_pass):
            part = here[s : s + per_pass]
            members = [batches[c][start : start + rows] for c in part]
            wide = max(plans[c].lengths[m[0]] for c, m in zip(part, members, strict=True))
            chunk = _Pass(part, members, [start] * len(part), wide, rows)
            if part != list(range(len(plans))):
                chunk.index = torch.tensor(part, dtype=torch.long, device=device)
            if any(len(m) != rows for m in members):
                slots = [k * rows + i for k, m in enumerate(members) for i in range(len(m))]
                chunk.slot = torch.tensor(slots, dtype=torch.long, device=device)
            out.append(chunk)
        start += rows
    return out


class _Context:
    """What the patched layers read during a pass: the stack, the pass, its masks."""

    def __init__(self, stack: _Stack, masks: _Masks | None, device) -> None:
        self.stack, self.masks, self.device = stack, masks, device
        self.chunk: _Pass | None = None
        self.real: torch.Tensor | None = None
        self._drawn: dict[tuple[int, int], torch.Tensor] = {}
        self._offsets: dict[int, list[int]] = {}
        self._layer = 0

    def new_step(self, batches: dict[int, list[int]], plans: Sequence[_Schedule]) -> None:
        """Forget the last step's masks; each client's tokens before each of its rows."""
        self._drawn.clear()
        self._offsets = {
            c: np.cumsum([0] + [plans[c].lengths[i] for i in b]).tolist()
            for c, b in batches.items()
        }
        self._batch_rows = {c: len(b) for c, b in batches.items()}

    def start(self, chunk: _Pass, real: torch.Tensor) -> None:
        """A pass begins: ``real`` is the flat index of its real (not padding) positions."""
        self.chunk, self.real, self._layer = chunk, real, 0

    def mask(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """The keep-mask (scaled by ``1/(1-p)``) of this pass's rows for adapted module
        ``layer`` (in forward order), shaped like ``x``."""
        assert self.masks is not None and self.chunk is not None and self.real is not None
        chunk, features = self.chunk, x.shape[-1]
        parts = []
        for c, members, first in zip(chunk.clients, chunk.members, chunk.first, strict=True):
            key = (c, layer)
            if key not in self._drawn:  # the client's whole batch, in its stream's order
                self._drawn[key] = self.masks.draw(c, self._offsets[c][-1] * features).to(
                    self.device, non_blocking=True
                )
            offsets = self._offsets[c]
            lo, hi = offsets[first], offsets[first + len(members)]
            parts.append(self._drawn[key][lo * features : hi * features])
        keep = torch.zeros(x.shape[0] * x.shape[1], features, dtype=torch.bool, device=x.device)
        keep[self.real] = torch.cat(parts).view(-1, features)
        return keep.view(x.shape).to(x.dtype).mul_(1.0 / (1.0 - self.masks.p))

    def next_layer(self) -> int:
        """The forward-order number of the adapted module being run."""
        layer = self._layer
        self._layer += 1
        return layer


@contextmanager
def _patched(model, ctx: _Context) -> Iterator[None]:
    """Inside, every adapted module runs each client's rows through that client's factors."""
    patched = []
    try:
        for name, layer in lora_layers(model).items():
            a = ctx.stack.params[f"{name}.lora_A"]
            b = ctx.stack.params[f"{name}.lora_B"]
            layer.forward = _stacked_forward(layer, a, b, ctx)
            patched.append(layer)
        yield
    finally:
        for layer in patched:
            del layer.forward  # back to the class's forward


def _stacked_forward(layer, a: torch.Tensor, b: torch.Tensor, ctx: _Context):
    base = layer.base_layer
    scaling = layer.scaling["default"]

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        chunk = ctx.chunk
        assert chunk is not None
        number = ctx.next_layer()
        result = base(x, *args, **kwargs)
        xa = x.to(a.dtype)  # as peft casts the adapter's input
        if ctx.masks is not None:
            xa = xa * ctx.mask(xa, number)
        a_c = a if chunk.index is None else a.index_select(0, chunk.index)
        b_c = b if chunk.index is None else b.index_select(0, chunk.index)
        n_c = len(chunk.clients)
        if chunk.slot is not None:  # clients with fewer rows: zero rows fill their grid
            grid = xa.new_zeros(n_c * chunk.rows, *xa.shape[1:])
            xa = grid.index_copy(0, chunk.slot, xa)
        low = torch.bmm(xa.reshape(n_c, -1, xa.shape[-1]), a_c.transpose(1, 2))
        lora = torch.bmm(low, b_c.transpose(1, 2)).reshape(-1, *result.shape[1:])
        if chunk.slot is not None:
            lora = lora.index_select(0, chunk.slot)
        # result + scaling * lora in one pass (peft: result + lora * scaling).
        return torch.add(result, lora, alpha=scaling).to(result.dtype)

    return forward


def _run_pass(
    model,
    ctx: _Context,
    chunk: _Pass,
    plans: Sequence[_Schedule],
    jobs: Sequence[ClientJob],
    pad_id: int,
    weight: torch.Tensor,
    step_loss: torch.Tensor,
) -> None:
    """Forward and backward of one pass; adds each client's loss into ``step_loss``."""
    examples = [
        (c, jobs[c].examples[i], plans[c].scored[i])
        for c, members in zip(chunk.clients, chunk.members, strict=True)
        for i in members
    ]
    width = chunk.width
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    positions: list[int] = []
    targets: list[int] = []
    owners: list[int] = []
    for row, (c, e, (at, target)) in enumerate(examples):
        ids[row, : len(e.input_ids)] = torch.tensor(e.input_ids)
        attention[row, : len(e.input_ids)] = 1
        positions += [row * width + t for t in at]
        targets += target
        owners += [c] * len(at)
    device = ctx.device
    ctx.start(chunk, attention.view(-1).nonzero().squeeze(1).to(device))
    rows = torch.tensor(positions, dtype=torch.long, device=device)
    logits = logits_at(model, ids.to(device), attention.to(device), rows)
    ce = torch.nn.functional.cross_entropy(
        loss_precision(logits), torch.tensor(targets, device=device), reduction="none"
    )
    owner = torch.tensor(owners, dtype=torch.long, device=device)
    weighted = ce * weight[owner]
    with warnings.catch_warnings():
        # The gradient views are strided slices of one buffer: accumulated in place, as meant.
        warnings.filterwarnings("ignore", message=".*gradient layout contract.*")
        weighted.sum().backward()
    step_loss.index_add_(0, owner, weighted.detach())
    ctx.chunk = None
