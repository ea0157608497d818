"""LoRA adapters through peft, and their state as plain dicts of tensors.

Federated code never touches modules directly: it reads and writes named tensors.
``adapter_state``/``load_state`` move the LoRA factors (FedIT's update space);
``base_state``/``load_state`` move the adapted modules' base weights (FLoRA's merged space).
"""

from __future__ import annotations

import warnings

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
