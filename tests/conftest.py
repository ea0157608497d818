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


@pytest.fixture(scope="module")
def micro(tiny_cache):
    """The session's micro tiny model: its folder, model and tokenizer, loaded afresh for each
    test module (a module's tests may attach adapters to it)."""
    from fedattr.models.config import ModelConfig, TinyModelConfig
    from fedattr.models.loading import load_model
    from fedattr.models.tiny import ensure_tiny

    path = ensure_tiny(TinyModelConfig(**MICRO_TINY), tiny_cache)
    model, tokenizer = load_model(ModelConfig(preset="hf", name_or_path=str(path), device="cpu"))
    return path, model, tokenizer


def fixed_key(n: int, **params):
    """A KGW key with a fixed secret: statistical assertions must not depend on a fresh draw
    (``generate_key`` takes 256 bits from the OS every run)."""
    from fedattr.watermarks.keys import OwnerKey

    return OwnerKey("kgw", f"{n:064x}", **params)


@pytest.fixture(scope="session")
def markllm_target(tmp_path_factory):
    """A folder holding MarkLLM 0.1.5 (no dependencies), installed once per session; the tests
    that need it are skipped, with the reason, where it cannot be installed."""
    import subprocess
    import sys

    target = tmp_path_factory.mktemp("markllm")
    try:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--target",
                str(target),
                "markllm==0.1.5",
            ],
            check=True,
            capture_output=True,
            timeout=180,
        )
    except (subprocess.SubprocessError, OSError) as exc:
        pytest.skip(f"markllm could not be installed here: {exc}")
    return target


def import_markllm(target, module: str, *names: str) -> list:
    """``names`` from MarkLLM's ``module`` installed in ``target`` (skip where it does not
    import)."""
    import importlib
    import sys

    sys.path.insert(0, str(target))
    try:
        mod = importlib.import_module(module)
        return [getattr(mod, n) for n in names] if names else [mod]
    except ImportError as exc:
        pytest.skip(f"markllm's {module} does not import: {exc}")
    finally:
        sys.path.remove(str(target))


def sealed_overrides(tiny_cache, *extra):
    """A micro run in the sealed mode, read on the owners' documents, 31 random keys."""
    return small_overrides(
        tiny_cache,
        "attribution.protocol.mode=sealed",
        "attribution.sealed.random_keys=31",
        "watermark.kgw.probes=documents",
        "variants=[]",
        *extra,
    )


def small_overrides(tiny_cache, *extra):
    """`--set` overrides for a micro run (K=4, T=2) on the session's micro tiny model."""
    tiny = [f"model.tiny.{k}={v}" for k, v in MICRO_TINY.items()]
    return [
        f"model.cache_dir={tiny_cache}",
        *tiny,
        "lora.r=4",
        "lora.alpha=8",
        "fl.K=4",
        "fl.rounds=2",
        "fl.train.batch_size=8",
        "fl.train.micro_batch_size=4",
        "attribution.protocol.N=2",
        "attribution.protocol.M=2",
        "secagg.min_members=2",
        "data.records=64",
        "data.max_len=64",
        "watermark.r=1",
        "watermark.owners=2",
        "watermark.detect.prompts=4",
        "watermark.detect.max_new_tokens=8",
        "watermark.teacher.max_new_tokens=16",
        "watermark.teacher.min_tokens=2",
        *extra,
    ]
