"""The paired teacher-forced KGW test (reading mode) and the paired-scorer protocol."""

import numpy as np
import pytest
import torch

from conftest import MICRO_TINY
from fedattr.attribution.scoring import DifferentialScorer, observes_in_batches
from fedattr.data.corpus import generate_corpus
from fedattr.models.config import ModelConfig, TinyModelConfig
from fedattr.models.loading import load_model
from fedattr.models.text import encode_examples
from fedattr.watermarks.kgw import KGWLogitsProcessor, KGWScheme
from fedattr.watermarks.radioactivity import KGWReadingScorer


class _Tilted(torch.nn.Module):
    """A causal LM whose logits can be tilted towards one key's green lists (a stand-in for a
    model that learned the watermark) or perturbed at random (a change unrelated to any key)."""

    def __init__(self, inner, scheme: KGWScheme) -> None:
        super().__init__()
        self.inner, self.processor = inner, KGWLogitsProcessor(scheme)
        self.tilt, self.noise_seed, self.noise = 0.0, 0, 0.0

    def forward(self, input_ids, attention_mask=None):
        out = self.inner(input_ids=input_ids, attention_mask=attention_mask)
        logits = out.logits
        vocab = self.processor.scheme.vocab_size
        if self.tilt:
            flat = input_ids.reshape(-1, 1)
            green = (
                self.processor(flat, torch.zeros(flat.shape[0], vocab))
                / self.processor.scheme.delta
            )
            logits = logits.clone()
            logits[..., :vocab] += self.tilt * green.reshape(*input_ids.shape, vocab)
        if self.noise:
            gen = torch.Generator().manual_seed(self.noise_seed)
            logits = logits + self.noise * torch.randn(logits.shape, generator=gen)
        out.logits = logits
        return out


def _load(model, params):
    model.tilt, model.noise, model.noise_seed = params


@pytest.fixture(scope="module")
def reading_setup(tiny_cache):
    model, tok = load_model(
        ModelConfig(cache_dir=str(tiny_cache), tiny=TinyModelConfig(**MICRO_TINY)), lambda m: None
    )
    texts = encode_examples(tok, generate_corpus(24, seed=3), 128)
    return model, tok, texts


def test_reading_contrast_is_standard_normal_under_unrelated_keys(reading_setup):
    model, tok, texts = reading_setup
    V = len(tok)
    keys = {f"k{i}": KGWScheme(1000 + i, V) for i in range(200)}
    wrapped = _Tilted(model, keys["k0"])
    scorer = KGWReadingScorer(wrapped, texts, keys, _load)
    ref = scorer.observe((0.0, 0.0, 0))
    cand = scorer.observe((0.0, 0.5, 7))  # a random change: no key is involved
    z = np.array(list(scorer.contrast(ref, cand).values()))
    assert abs(z.mean()) < 0.3 and 0.75 < z.std() < 1.3
    # Rows of a change sum to zero: the statistic ignores how much mass moves in total.
    assert torch.allclose((cand - ref).sum(1), torch.zeros(len(scorer.contexts)), atol=1e-5)
    assert scorer.contrast(ref, ref) == dict.fromkeys(keys, 0.0)


def test_reading_contrast_detects_a_change_towards_one_key(reading_setup):
    model, tok, texts = reading_setup
    V = len(tok)
    keys = {"owner": KGWScheme(5, V), "other": KGWScheme(6, V)}
    wrapped = _Tilted(model, keys["owner"])
    scorer = KGWReadingScorer(wrapped, texts, keys, _load)
    ref = scorer.observe((0.0, 0.0, 0))
    # A small tilt buried in a larger random change is still found, under its key only.
    z = scorer.contrast(ref, scorer.observe((0.05, 0.3, 3)))
    assert z["owner"] > 6 and abs(z["other"]) < 3.5
    assert scorer.contrast(ref, scorer.observe((-0.05, 0.3, 3)))["owner"] < -6


def test_reading_scorer_rejects_empty_inputs(reading_setup):
    model, tok, texts = reading_setup
    keys = {"a": KGWScheme(1, len(tok))}
    with pytest.raises(ValueError, match="no owner keys"):
        KGWReadingScorer(model, texts, {}, _load)
    with pytest.raises(ValueError, match=r"watermark\.detect\.prompts"):
        KGWReadingScorer(model, [], keys, _load)


class _Counting:
    """A paired scorer on tensors: observe = the parameters, contrast = the summed change."""

    def __init__(self) -> None:
        self.observed = 0

    def observe(self, params):
        self.observed += 1
        return params.clone()

    def contrast(self, reference, candidate):
        return {"s": float((candidate - reference).sum())}


def test_differential_scorer_uses_observe_once_and_contrast_per_estimate():
    scorer = _Counting()
    diff = DifferentialScorer(scorer, torch.ones(3))
    assert diff.paired and diff.reference_score == {} and scorer.observed == 1
    assert diff(torch.tensor([1.0, 2.0, 3.0])) == {"s": 6.0}
    assert diff(torch.tensor([0.0, 0.0, -1.0])) == {"s": -1.0}
    assert scorer.observed == 3


def test_key_statistics_are_the_contrast_numerator_and_a_key_randomised_null(reading_setup):
    model, tok, texts = reading_setup
    V = len(tok)
    keys = {"owner": KGWScheme(5, V), "other": KGWScheme(6, V)}
    scorer = KGWReadingScorer(_Tilted(model, keys["owner"]), texts, keys, _load)
    ref = scorer.observe((0.0, 0.0, 0))
    cand = scorer.observe((0.05, 0.3, 3))
    stats = scorer.key_statistics(ref, cand, 100, seed=1)
    z = scorer.contrast(ref, cand)
    change = (cand - ref).double()
    scale = float(np.sqrt(float((change * change).sum()) * scorer._null_var))
    for name in keys:
        assert stats[name][0] / scale == pytest.approx(z[name], rel=1e-4, abs=1e-4)
    null = stats["owner"][1]
    assert null.shape == (100,) and np.array_equal(null, stats["other"][1])
    # Fresh random keys see the random part of the change only: centred, unit scale in z.
    assert abs(null.mean() / scale) < 0.4 and 0.7 < (null / scale).std() < 1.3
    assert stats["owner"][0] > null.max()  # the tilt towards the owner's key stands out
    # The same (n, seed) reuses the keys; another seed draws other ones.
    assert np.array_equal(scorer.key_statistics(ref, cand, 100, seed=1)["owner"][1], null)
    assert not np.array_equal(scorer.key_statistics(ref, cand, 100, seed=2)["owner"][1], null)
    assert 1 <= scorer.effective_contexts(ref, cand) <= len(scorer.contexts)


def test_null_keys_batched_cached_and_streamed_agree(reading_setup):
    from fedattr.watermarks.nullkeys import RandomGreenLists

    model, tok, texts = reading_setup
    keys = {"owner": KGWScheme(5, len(tok))}
    scorer = KGWReadingScorer(_Tilted(model, keys["owner"]), texts, keys, _load)
    ref = scorer.observe((0.0, 0.0, 0))
    cands = [scorer.observe((0.05, 0.3, 3)), scorer.observe((0.02, -0.2, 1))]
    many = scorer.key_statistics_many(ref, cands, 40, seed=3)
    for cand, stats in zip(cands, many, strict=True):
        one = scorer.key_statistics(ref, cand, 40, seed=3)
        assert stats["owner"][0] == pytest.approx(one["owner"][0])
        assert np.allclose(stats["owner"][1], one["owner"][1], rtol=1e-5, atol=1e-6)
    # Keys do not depend on whether the masks are kept: a cache-less copy redraws the same.
    changes = torch.stack([(c - ref).float().reshape(-1) for c in cands])
    cells = changes.shape[1]
    kept = RandomGreenLists(40, 3, cells, 0.25)
    assert kept.sums(changes).shape == (2, 40) and kept._masks[0].dtype == torch.float32
    as_bools = RandomGreenLists(40, 3, cells, 0.25, cache_bytes=40 * cells)  # too big as floats
    assert torch.equal(as_bools.sums(changes), kept.sums(changes))
    assert as_bools._masks[0].dtype == torch.bool
    redrawn = RandomGreenLists(40, 3, cells, 0.25, cache_bytes=0)
    # The first round draws the kept keys several chunks at a time: the same as a serial draw.
    assert len(kept._masks) == 3
    assert all(torch.equal(m, redrawn._chunk(i).float()) for i, m in enumerate(kept._masks))
    kept = kept.sums(changes)
    assert torch.allclose(kept, redrawn.sums(changes))
    assert torch.allclose(kept, redrawn.sums(changes))  # and again: the same keys every round
    # Redrawn a few keys at a time (a large vocabulary): the same keys, in bounded memory.
    budget = 9 * cells * 3 * torch.get_num_threads()  # 3 keys per draw on each CPU thread
    blocked = RandomGreenLists(40, 3, cells, 0.25, cache_bytes=0, draw_bytes=budget)
    assert blocked._rows == 3 and [len(b) for b in blocked._blocks(0)] == [3] * 5 + [1]
    assert all(
        torch.equal(torch.cat(list(blocked._blocks(i))), redrawn._chunk(i)) for i in range(3)
    )
    # (float32 products of other shapes: the same sums up to rounding)
    assert torch.allclose(blocked.sums(changes), kept, rtol=1e-4, atol=1e-6)
    # A mask is a Bernoulli(gamma) draw: about a quarter of the cells of every key are green.
    share = redrawn._chunk(0).float().mean(1)
    assert torch.all((share - 0.25).abs() < 0.05)
    with pytest.raises(ValueError, match="changes"):
        redrawn.sums(changes[:, :-1])


@pytest.mark.parametrize("space", ["fedit", "flora"])
def test_stacked_candidates_read_as_loading_each_one(tiny_cache, space):
    """observe_many through stacked candidates (several per forward pass) gives what observe
    gives after loading each candidate, for candidates in LoRA-factor space (FedIT) and in
    merged base-weight space (FLoRA), and leaves the model as it was."""
    from fedattr.models.config import LoRAConfig
    from fedattr.models.lora import (
        adapter_state,
        attach_lora,
        base_state,
        can_stack,
        candidate_stacker,
        load_state,
        lora_layers,
        stacked_candidates,
    )

    model, tok = load_model(
        ModelConfig(cache_dir=str(tiny_cache), tiny=TinyModelConfig(**MICRO_TINY)), lambda m: None
    )
    model = attach_lora(model, LoRAConfig(r=4, alpha=8), seed=1)
    assert can_stack(model)
    assert candidate_stacker(model) is None  # on the CPU candidates are read one at a time
    gen = torch.Generator().manual_seed(7)
    if space == "fedit":
        state = adapter_state(model)
        state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
    else:
        zero_b = {
            f"{n}.lora_B": torch.zeros_like(m.lora_B["default"].weight)
            for n, m in lora_layers(model).items()
        }
        state = {**base_state(model), **zero_b}
    candidates = [state] + [
        {
            k: v + 0.02 * torch.randn(v.shape, generator=gen)
            if "lora_B" not in k or space == "fedit"
            else v
            for k, v in state.items()
        }
        for _ in range(4)
    ]
    texts = encode_examples(tok, generate_corpus(20, seed=3), 64)
    schemes = {"kgw:a": KGWScheme(5, len(tok))}
    one = KGWReadingScorer(model, texts, schemes, load_state, pad_id=tok.pad_token_id, batch_size=6)
    want = [one.observe(c) for c in candidates]
    # Without a stacker the round is fed lazily, one candidate at a time.
    assert not observes_in_batches(one)
    before = {**adapter_state(model), **base_state(model)}
    # A small pass budget splits the five candidates over several stacked passes.
    for budget in (1 << 30, 3 * 6 * 64 * len(tok) * 4):
        many = KGWReadingScorer(
            model,
            texts,
            schemes,
            load_state,
            pad_id=tok.pad_token_id,
            batch_size=6,
            stack=stacked_candidates,
            pass_bytes=budget,
        )
        assert observes_in_batches(many)
        got = many.observe_many(candidates)
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    after = {**adapter_state(model), **base_state(model)}
    assert all(torch.equal(before[k], after[k]) for k in before)
    # Differences between candidates survive (the stacked pass did not read one candidate).
    assert not torch.allclose(got[1], got[2])
    bad = stacked_candidates(model, [{"nowhere.lora_A": torch.zeros(1)}])
    with pytest.raises(KeyError, match="no adapted module"), bad:
        pass
