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


MICRO_TINY = {
    "vocab_size": 320,
    "hidden_size": 32,
    "layers": 1,
    "heads": 2,
    "intermediate_size": 64,
    "max_positions": 128,
    "pretrain_records": 400,
    "pretrain_steps": 8,
    "pretrain_batch": 8,
}


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    """A cache folder holding a micro tiny-preset model (built once per test session)."""
    from fedattr.models.config import TinyModelConfig
    from fedattr.models.tiny import ensure_tiny

    root = tmp_path_factory.mktemp("fedattr-cache")
    ensure_tiny(TinyModelConfig(**MICRO_TINY), root, progress=lambda _m: None)
    return root
