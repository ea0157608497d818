"""LoRA adapters through peft, and their state as plain dicts of tensors.

Federated code never touches modules directly: it reads and writes named tensors.
``adapter_state``/``load_state`` move the LoRA factors (FedIT's update space);
``base_state``/``load_state`` move the adapted modules' base weights (FLoRA's merged space).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from .config import LoRAConfig


def attach_lora(model, cfg: LoRAConfig, seed: int = 0):
    """Wrap ``model`` with fresh LoRA adapters (B = 0, A seeded), base weights frozen."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_cfg = LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        with warnings.catch_warnings():
            # peft reads transformers' deprecated alias while wrapping; nothing for users to do.
            warnings.filterwarnings(
                "ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning
            )
            return get_peft_model(model, peft_cfg)
    except ValueError as exc:
        raise ValueError(f"lora.target_modules: {exc}") from exc


def lora_layers(peft_model) -> dict[str, torch.nn.Module]:
    """Adapted layers by module name (each has ``lora_A``, ``lora_B``, ``base_layer``)."""
    return {
        name: mod
        for name, mod in peft_model.named_modules()
        if hasattr(mod, "lora_A") and hasattr(mod, "base_layer") and "default" in mod.lora_A
    }


def adapter_state(peft_model) -> dict[str, torch.Tensor]:
    """Copies of every LoRA factor: ``{module}.lora_A`` and ``{module}.lora_B``."""
    out = {}
    for name, mod in lora_layers(peft_model).items():
        out[f"{name}.lora_A"] = mod.lora_A["default"].weight.detach().clone()
        out[f"{name}.lora_B"] = mod.lora_B["default"].weight.detach().clone()
    return out


def base_state(peft_model) -> dict[str, torch.Tensor]:
    """Copies of the adapted modules' base weights: ``{module}.weight``."""
    return {
        f"{name}.weight": mod.base_layer.weight.detach().clone()
        for name, mod in lora_layers(peft_model).items()
    }


def load_state(peft_model, state: dict[str, torch.Tensor]) -> None:
    """Write tensors named as in :func:`adapter_state` / :func:`base_state` into the model."""
    layers = lora_layers(peft_model)
    with torch.no_grad():
        for key, value in state.items():
            module, _, kind = key.rpartition(".")
            layer = layers.get(module)
            if layer is None:
                raise KeyError(f"no adapted module named {module!r}")
            if kind == "lora_A":
                target = layer.lora_A["default"].weight
            elif kind == "lora_B":
                target = layer.lora_B["default"].weight
            elif kind == "weight":
                target = layer.base_layer.weight
            else:
                raise KeyError(f"unknown tensor kind {kind!r} in {key!r}")
            target.copy_(value.to(target.dtype))


@contextmanager
def dual_adapters(peft_model, tangent: dict[str, torch.Tensor]) -> Iterator[None]:
    """Inside an open ``torch.autograd.forward_ad.dual_level``: every LoRA factor named in
    ``tangent`` (keys as in :func:`adapter_state`) carries that tangent, so a forward pass
    also computes its directional derivative along ``tangent`` at the model's factors
    (forward-mode AD: one pass, no graph kept). The model's own parameters are put back on
    exit. Attention must run in a kernel with forward AD (PyTorch's math kernel: see
    :func:`fedattr.models.reading.forward_ad_attention`)."""
    import torch.autograd.forward_ad as fwAD

    layers = lora_layers(peft_model)
    swapped: list[tuple[torch.nn.Module, torch.Tensor]] = []
    try:
        for key, value in tangent.items():
            module, _, kind = key.rpartition(".")
            layer = layers.get(module)
            if layer is None or kind not in ("lora_A", "lora_B"):
                raise KeyError(f"tangent: no LoRA factor named {key!r}")
            linear = getattr(layer, kind)["default"]
            weight = linear._parameters["weight"]
            dual = fwAD.make_dual(weight.detach(), value.to(weight.device, weight.dtype))
            swapped.append((linear, weight))
            # A plain tensor in the parameter's slot: nn.Linear reads self.weight from there.
            linear._parameters["weight"] = dual
        yield
    finally:
        for linear, weight in swapped:
            linear._parameters["weight"] = weight


def merged_delta(adapters: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """``scaling * B @ A`` per module, named ``{module}.weight`` (the FLoRA update space)."""
    out = {}
    for key, a in adapters.items():
        if key.endswith(".lora_A"):
            module = key[: -len(".lora_A")]
            b = adapters[f"{module}.lora_B"]
            out[f"{module}.weight"] = scaling * (b.float() @ a.float())
    return out


def trainable_lora_parameters(peft_model) -> list[torch.nn.Parameter]:
    """The LoRA factors (what local training updates)."""
    return [p for n, p in peft_model.named_parameters() if "lora_" in n and p.requires_grad]


def can_stack(peft_model) -> bool:
    """Whether :func:`stacked_candidates` can run this model: every adapted module a plain
    linear LoRA layer (no DoRA or other variant, no LoRA bias, nothing merged, one active
    adapter)."""
    layers = lora_layers(peft_model)
    return bool(layers) and all(
        isinstance(layer.base_layer, torch.nn.Linear)
        and not layer.fan_in_fan_out
        and not getattr(layer, "lora_bias", {}).get("default", False)
        and not layer.merged
        and not layer.disable_adapters
        and list(layer.active_adapters) == ["default"]
        and "default" not in getattr(layer, "lora_variant", {})
        for layer in layers.values()
    )


def candidate_stacker(peft_model):
    """:func:`stacked_candidates` where it pays, else ``None`` (read candidates one at a time).

    It pays on an accelerator, where one candidate's probe batch leaves most of the device
    idle. On the CPU the forward pass is compute-bound already at one candidate per batch
    (measured 0.64-0.82x on the embedded default's model while every position's probabilities
    were computed, 0.93-1.01x once only the read positions' were, 0.75x against one-at-a-time
    reads with :func:`folded_adapters`, which a stacked pass cannot use).
    """
    device = next(peft_model.parameters()).device
    return stacked_candidates if device.type != "cpu" and can_stack(peft_model) else None


@contextmanager
def folded_adapters(model) -> Iterator[bool]:
    """Evaluation only: inside the block every adapted module runs as one linear layer with
    ``W + scaling * B @ A`` (a new tensor; the model's own are not touched). Yields whether
    it folded.

    An unfolded LoRA module costs ``1 + 2r/d`` times its base matmul per token (twice at the
    embedded default's r = 64, d = 128); folded, one matmul. A module whose adapter is
    disabled or merged while inside (``with peft_model.disable_adapter()``, as ``owner
    detect`` reads a LoRA model's own reference) runs its base layer, as peft would. Folds
    only where that is exact enough and safe: float32 weights (a precaution: in bf16,
    ``W + B @ A`` could round away a change far below W's resolution, the differential
    signal itself; on the embedded default it moved the contrasts no more than bf16 reads
    do, see the README), plain linear LoRA layers (:func:`can_stack`), evaluation mode and
    no autograd (training needs the factors' gradients and dropout), and no layer already
    patched or a base layer hooked (a stacked pass, accelerate's offloading hooks, forward
    hooks a folded read would bypass).
    """
    layers = lora_layers(model)
    if (
        torch.is_grad_enabled()
        or not can_stack(model)
        or any(
            layer.training
            or layer.base_layer.weight.dtype != torch.float32
            or "forward" in vars(layer)
            or hasattr(layer.base_layer, "_hf_hook")
            or layer.base_layer._forward_hooks
            or layer.base_layer._forward_pre_hooks
            for layer in layers.values()
        )
    ):
        yield False
        return
    patched = []
    try:
        for layer in layers.values():
            weight = layer.base_layer.weight
            b = layer.lora_B["default"].weight
            if b.any():  # FLoRA's reset adapters (B = 0) add nothing
                a, scaling = layer.lora_A["default"].weight, layer.scaling["default"]
                weight = torch.addmm(weight, b, a, alpha=scaling)
            layer.forward = _folded_forward(layer, weight)
            patched.append(layer)
        yield True
    finally:
        for layer in patched:
            del layer.forward  # back to the class's forward


def _folded_forward(layer, weight: torch.Tensor):
    base = layer.base_layer

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if layer.disable_adapters or layer.merged:
            return base(x, *args, **kwargs)
        return torch.nn.functional.linear(x, weight, base.bias)

    return forward


def _candidate_tensor(
    states: Sequence[dict[str, torch.Tensor]], key: str, current: torch.Tensor
) -> torch.Tensor | None:
    """``[C, ...]`` of each candidate's ``key`` (the model's own where a candidate has none),
    or ``None`` when every candidate uses the same tensor (computed once for the batch)."""
    values = [state.get(key) for state in states]
    if all(v is None for v in values):
        return None
    # Converted as load_state converts, so a stacked pass reads exactly what a load would.
    values = [current if v is None else v.to(current.device, current.dtype) for v in values]
    if all(torch.equal(values[0], v) for v in values[1:]):
        return None if torch.equal(values[0], current) else values[0].unsqueeze(0)
    return torch.stack(values)


@contextmanager
def stacked_candidates(peft_model, states: Sequence[dict[str, torch.Tensor]]) -> Iterator[int]:
    """Run several candidate parameter sets in one forward pass (evaluation only).

    Inside the block, a batch whose rows are candidate-major (rows ``c * b`` to
    ``(c + 1) * b - 1`` belong to candidate ``c`` of ``len(states)``) passes every adapted
    module with that candidate's tensors: each state is read as :func:`load_state` would load
    it on top of the model's current tensors, without writing anything into the model.
    Candidates that differ in LoRA factors (FedIT) share the base layer's product and run
    their factors as batched matmuls; candidates that differ in base weights (FLoRA) run one
    batched matmul of the stacked weights. Yields the number of candidates.
    """
    if not can_stack(peft_model):
        raise ValueError("stacked_candidates: the model has LoRA layers this cannot stack")
    count = len(states)
    if count < 1:
        raise ValueError("stacked_candidates: no candidates")
    layers = lora_layers(peft_model)
    known = {f"{name}.{kind}" for name in layers for kind in ("lora_A", "lora_B", "weight")}
    unknown = sorted({k for state in states for k in state} - known)
    if unknown:
        raise KeyError(f"no adapted module for {unknown[:3]}")
    patched = []
    try:
        for name, layer in layers.items():
            a_now = layer.lora_A["default"].weight.detach()
            b_now = layer.lora_B["default"].weight.detach()
            weight = _candidate_tensor(states, f"{name}.weight", layer.base_layer.weight.detach())
            a = _candidate_tensor(states, f"{name}.lora_A", a_now)
            b = _candidate_tensor(states, f"{name}.lora_B", b_now)
            # A factor every candidate shares is the model's own, one copy for all rows.
            a = a_now.unsqueeze(0) if a is None else a
            b = b_now.unsqueeze(0) if b is None else b
            if not b.any():
                a = b = None  # B = 0 (FLoRA's reset adapters): the adapter adds nothing
            layer.forward = _stacked_forward(layer, count, weight, a, b)
            patched.append(layer)
        yield count
    finally:
        for layer in patched:
            del layer.forward  # back to the class's forward


def _stacked_forward(layer, count: int, weight, a, b):
    base = layer.base_layer
    scaling = layer.scaling["default"]

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if x.shape[0] % count:
            raise ValueError(f"stacked forward: batch of {x.shape[0]} rows for {count} candidates")
        grouped = x.reshape(count, -1, x.shape[-1])
        if weight is None:
            result = base(x, *args, **kwargs)
        else:
            result = torch.matmul(grouped.to(weight.dtype), weight.transpose(1, 2))
            if base.bias is not None:
                result = result + base.bias
            result = result.reshape(*x.shape[:-1], -1)
        if a is not None:
            low = torch.matmul(grouped.to(a.dtype), a.transpose(1, 2))
            lora = torch.matmul(low, b.transpose(1, 2)) * scaling
            result = result + lora.reshape(result.shape).to(result.dtype)
        return result

    return forward
