import numpy as np
import pytest
import torch


@pytest.fixture
def lora_updates():
    """Six clients' dict-of-tensor updates shaped like LoRA factors of two modules."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    for j in range(6):
        out[j] = {
            "q.lora_A": torch.randn(4, 16, generator=gen) * 0.01,
            "q.lora_B": torch.randn(16, 4, generator=gen) * 0.01,
            "v.lora_A": torch.randn(4, 16, generator=gen) * 0.01,
            "v.lora_B": torch.randn(16, 4, generator=gen) * 0.01,
        }
    return out


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
