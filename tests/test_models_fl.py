import os
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import MICRO_TINY
from fedattr.fl import (
    FedITClient,
    FedITServer,
    FLoRAClient,
    FLoRAServer,
    sa_scales,
    weighted_mean,
)
from fedattr.models.config import LoRAConfig, ModelConfig, TinyModelConfig
from fedattr.models.loading import ModelLoadError, load_model
from fedattr.models.lora import adapter_state, attach_lora, base_state, load_state
from fedattr.models.tiny import cache_key, ensure_tiny
from fedattr.secagg import SecAggConfig, make_aggregator


def _model(tiny_cache):
    cfg = ModelConfig(preset="tiny", cache_dir=str(tiny_cache), tiny=TinyModelConfig(**MICRO_TINY))
    return load_model(cfg)


def test_tiny_preset_is_cached_and_loads_by_path(tiny_cache):
    cfg = TinyModelConfig(**MICRO_TINY)
    path = ensure_tiny(cfg, tiny_cache)
    assert path.name == f"tiny-{cache_key(cfg)}" and (path / "config.json").is_file()
    mtime = (path / "config.json").stat().st_mtime
    assert ensure_tiny(cfg, tiny_cache) == path and (path / "config.json").stat().st_mtime == mtime
    model, tok = load_model(ModelConfig(preset="hf", name_or_path=str(path)))
    assert model.config.model_type == "llama" and tok.pad_token_id is not None
    ids = tok("What is 2 plus 3?")["input_ids"]
    assert tok.decode(ids) == "What is 2 plus 3?"


def test_processes_started_together_build_the_tiny_model_once(tmp_path):
    import subprocess
    import sys

    code = (
        "import sys; from conftest import MICRO_TINY; "
        "from fedattr.models.config import TinyModelConfig; "
        "from fedattr.models.tiny import ensure_tiny; "
        "print(ensure_tiny(TinyModelConfig(**MICRO_TINY), sys.argv[1], "
        "progress=lambda m: print(m, file=sys.stderr)))"
    )
    tests = str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, *sys.path]), "FEDATTR_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    paths = {out.strip() for out, _ in outs}
    assert len(paths) == 1
    builds = sum("training a" in err for _, err in outs)
    assert builds == 1, [err for _, err in outs]
    assert sum("waiting" in err for _, err in outs) <= 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [Path(next(iter(paths))).name, f"{Path(next(iter(paths))).name}.lock"]
    )


def test_bad_model_path_is_one_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match=r"does not exist .* not a Hugging Face id"):
        load_model(ModelConfig(preset="hf", name_or_path=str(tmp_path / "none")))
    with pytest.raises(ValueError, match=r"model\.preset: unknown 'gpt5'; allowed: tiny"):
        ModelConfig(preset="gpt5")


@pytest.mark.parametrize("raised", [TypeError, AttributeError])
def test_a_bug_while_loading_keeps_its_traceback(tmp_path, monkeypatch, raised):
    """A library's failure on the user's files is one line; a bug (ours or the library's) is
    not turned into one: it keeps its class and traceback."""
    import transformers

    def broken(*args, **kwargs):
        raise raised("a bug")

    def unreadable(*args, **kwargs):
        raise OSError("no config.json here\nmore detail")

    cfg = ModelConfig(preset="hf", name_or_path=str(tmp_path))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", unreadable)
    with pytest.raises(ModelLoadError, match=r"could not load .*: no config\.json here$"):
        load_model(cfg)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", broken)
    with pytest.raises(raised, match="a bug"):
        load_model(cfg)


def _fake_training(model, seed):
    """Perturb every LoRA factor as local training would."""
    gen = torch.Generator().manual_seed(seed)
    state = adapter_state(model)
    load_state(model, {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in state.items()})


def _sa_mean(updates, sizes):
    sa = make_aggregator(SecAggConfig(min_members=2))
    sa.open_round(1, range(len(updates)))
    for c, (u, s) in enumerate(zip(updates, sa_scales(sizes), strict=True)):
        sa.submit(c, {k: v * s for k, v in u.items()})
    total = sa.subset_sum(range(len(updates)))
    return {k: v / len(updates) for k, v in total.items()}


def test_fedit_aggregation_equals_weighted_mean_of_factors(tiny_cache):
    model, _ = _model(tiny_cache)
    model = attach_lora(model, LoRAConfig(r=4, alpha=8))
    server, client = FedITServer(), FedITClient()
    state = server.initial_state(model)
    sizes, trained, updates = [10, 30, 60], [], []
    for c in range(3):
        client.start(model, state, 1, c)
        _fake_training(model, c)
        trained.append(adapter_state(model))
        updates.append(client.update(model, state))
    new = server.aggregate(state, _sa_mean(updates, sizes))
    expected = weighted_mean(trained, sizes)  # FedIT: A = sum p_i A_i, B = sum p_i B_i
    for k in expected:
        assert torch.allclose(new[k].double(), expected[k], atol=1e-6)


def test_flora_aggregation_equals_stacked_product(tiny_cache):
    model, _ = _model(tiny_cache)
    cfg = LoRAConfig(r=4, alpha=8)
    model = attach_lora(model, cfg)
    server, client = FLoRAServer(), FLoRAClient(scaling=cfg.scaling, seed=0)
    state = server.initial_state(model)
    base = base_state(model)
    sizes, adapters, updates = [20, 20, 60], [], []
    for c in range(3):
        client.start(model, state, 1, c)
        a0 = adapter_state(model)
        assert all(torch.count_nonzero(v) == 0 for k, v in a0.items() if k.endswith("lora_B"))
        _fake_training(model, 10 + c)
        adapters.append(adapter_state(model))
        updates.append(client.update(model, state))
    new = server.aggregate(state, _sa_mean(updates, sizes))
    p = np.array(sizes) / sum(sizes)
    for key in base:
        module = key[: -len(".weight")]
        # FLoRA: stack [p_1 B_1, ..., p_K B_K] and [A_1; ...; A_K], merge their product.
        B = torch.cat([p[i] * adapters[i][f"{module}.lora_B"].double() for i in range(3)], dim=1)
        A = torch.cat([adapters[i][f"{module}.lora_A"].double() for i in range(3)], dim=0)
        expected = base[key].double() + cfg.scaling * (B @ A)
        assert torch.allclose(new[key].double(), expected, atol=1e-5)
    # Scoring parameters silence the adapters (B = 0) so only the merged base counts.
    params = server.scoring_params(new)
    assert all(torch.count_nonzero(v) == 0 for k, v in params.items() if k.endswith("lora_B"))


def test_epoch_batches_plain_and_grouped_by_length():
    from fedattr.models.training import epoch_batches

    lengths = [int(x) for x in np.random.default_rng(0).integers(5, 500, size=1000)]
    plain = epoch_batches(lengths, 16, np.random.default_rng(3), by_length=False)
    # Without grouping: the permutation the loop always drew, cut in order (results unchanged).
    order = np.random.default_rng(3).permutation(1000)
    assert plain == [order[b : b + 16].tolist() for b in range(0, 1000, 16)]
    grouped = epoch_batches(lengths, 16, np.random.default_rng(3), by_length=True)
    assert sorted(i for b in grouped for i in b) == list(range(1000))  # each example once
    assert len(grouped) == len(plain) and all(len(b) <= 16 for b in grouped)

    def padding(batches):  # padded positions when each batch pads to its longest example
        return sum(
            max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches
        )

    assert padding(grouped) < 0.2 * padding(plain)
    # Seeded: the same generator state gives the same batches; the order is shuffled.
    assert grouped == epoch_batches(lengths, 16, np.random.default_rng(3), by_length=True)
    firsts = [max(lengths[i] for i in b) for b in grouped[:20]]
    assert firsts != sorted(firsts, reverse=True)


def test_auto_dtype_is_bfloat16_only_on_a_cuda_device_that_has_it(tiny_cache, monkeypatch):
    from fedattr.models.loading import resolve_dtype

    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    for native, dtype in ((True, torch.bfloat16), (False, torch.float32)):
        # torch counts emulated bf16 (pre-Ampere GPUs) as supported unless told not to
        def fake(including_emulation=True, native=native):
            return True if including_emulation else native

        monkeypatch.setattr(torch.cuda, "is_bf16_supported", fake)
        assert resolve_dtype("auto", torch.device("cuda")) == dtype
    monkeypatch.undo()
    cfg = ModelConfig(
        preset="tiny",
        dtype="auto",
        device="cpu",
        cache_dir=str(tiny_cache),
        tiny=TinyModelConfig(**MICRO_TINY),
    )
    model, _ = load_model(cfg)
    assert next(model.parameters()).dtype == torch.float32
    with pytest.raises(ValueError, match=r"model\.dtype: unknown 'fp8'; allowed: float32, .* auto"):
        ModelConfig(dtype="fp8")


def test_optimizer_options_fuse_adamw_on_cuda_only():
    from fedattr.models.training import optimizer_options

    params = [torch.zeros(3, requires_grad=True)]
    assert optimizer_options(torch.device("cuda"), params) == {"fused": True}
    assert optimizer_options(torch.device("cpu"), params) == {}


def test_training_grouped_by_length_learns(tiny_cache):
    from fedattr.data.corpus import generate_corpus
    from fedattr.models.lora import trainable_lora_parameters
    from fedattr.models.text import encode_examples
    from fedattr.models.training import TrainSettings, train

    model, tok = _model(tiny_cache)
    model = attach_lora(model, LoRAConfig(r=4, alpha=8), seed=0)
    examples = encode_examples(tok, generate_corpus(48, seed=1), 64)
    settings = TrainSettings(
        epochs=3, batch_size=8, micro_batch_size=4, lr=3e-3, group_by_length=True
    )
    first = train(
        model,
        trainable_lora_parameters(model),
        examples,
        settings,
        tok.pad_token_id,
        seed=1,
        on_step=None,
    )
    assert first["steps"] == 18 and first["tokens"] > 0
    again = train(
        model, trainable_lora_parameters(model), examples, settings, tok.pad_token_id, seed=1
    )
    assert again["loss"] < first["loss"]  # it keeps learning on the same data


def test_sa_scales_give_a_client_without_data_weight_zero():
    assert sa_scales([0, 3, 1]) == [0.0, 2.25, 0.75]
    # A round whose participants hold nothing leaves the model as it is.
    assert sa_scales([0, 0]) == [0.0, 0.0]
    with pytest.raises(ValueError, match="sa_scales: data sizes must be >= 0"):
        sa_scales([2, -1])


@pytest.mark.parametrize(
    ("message", "line", "with_class"),
    [
        ("no config.json here\nmore detail", "no config.json here", "OSError: no config.json here"),
        ("\n  \nsecond line first\n", "second line first", "OSError: second line first"),
        ("", "OSError", "OSError"),
        ("   ", "OSError", "OSError"),
    ],
)
def test_first_line_of_an_error_never_raises(message, line, with_class):
    """The one-line message of a library's failure: its first non-blank line, or the class
    name when the message is blank (``"   ".strip().splitlines()[0]`` would raise IndexError
    inside the handler and replace the one line by a traceback)."""
    from fedattr.errors import first_line

    assert first_line(OSError(message)) == line
    assert first_line(OSError(message), with_class=True) == with_class
