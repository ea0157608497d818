"""Reading fixed texts cheaply: length-sorted batches and logits only at the positions read
must give what a plain full-logits read of each text gives."""

import pytest
import torch

from conftest import MICRO_TINY
from fedattr.data.corpus import generate_corpus
from fedattr.models.config import ModelConfig, TinyModelConfig
from fedattr.models.loading import load_model
from fedattr.models.reading import length_batches, logits_at
from fedattr.models.text import encode_examples
from fedattr.watermarks.kgw import KGWScheme
from fedattr.watermarks.radioactivity import KGWReadingScorer


@pytest.fixture(scope="module")
def micro(tiny_cache):
    return load_model(
        ModelConfig(cache_dir=str(tiny_cache), tiny=TinyModelConfig(**MICRO_TINY)), lambda m: None
    )


class _NoHead(torch.nn.Module):
    """The same model behind a wrapper that does not expose its output layer."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, **inputs):
        return self.inner(**inputs)


def test_length_batches_sort_longest_first_and_cover_every_index():
    lengths = [3, 9, 1, 9, 5, 7, 2]
    batches = length_batches(lengths, 3)
    assert batches == [[1, 3, 5], [4, 0, 6], [2]]  # ties keep input order
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert length_batches([], 4) == []
    with pytest.raises(ValueError, match="batch_size"):
        length_batches(lengths, 0)


def test_length_batches_under_a_token_cap_hold_at_most_that_many_padded_tokens():
    lengths = [3, 9, 1, 9, 5, 7, 2, 4, 4]
    batches = length_batches(lengths, 4, max_tokens=18)
    # Widest first: two 9s fill 18; 7 and 5 (14; a third at width 7 would be 21); ...
    assert batches == [[1, 3], [5, 4], [7, 8, 0, 6], [2]]
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) <= 4
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 18
    assert length_batches([30, 2], 8, max_tokens=10) == [[0], [1]]  # a long text alone
    assert length_batches(lengths, 3, max_tokens=10**6) == length_batches(lengths, 3)
    with pytest.raises(ValueError, match="max_tokens"):
        length_batches(lengths, 3, max_tokens=0)


def test_logits_at_gives_the_full_pass_rows_with_or_without_a_visible_head(micro):
    model, tok = micro
    model.eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, len(tok), (3, 11), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # right padding
    rows = torch.tensor([0, 5, 12, 17, 30, 32])
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask).logits.reshape(-1, model.config.vocab_size)
        got = logits_at(model, ids, mask, rows)
        hidden = logits_at(_NoHead(model), ids, mask, rows)
    assert got.shape == (len(rows), full.shape[1])
    assert torch.allclose(got, full[rows], atol=1e-5)
    assert torch.equal(hidden, full[rows])  # no head to hook: the full pass's rows
    head = model.get_output_embeddings()
    assert not head._forward_pre_hooks  # the hook is removed after the pass
    calls = []
    head.register_forward_hook(lambda m, a, out: calls.append(a[0].shape))
    with torch.no_grad():
        logits_at(model, ids, mask, rows)
    head._forward_hooks.clear()
    assert calls == [torch.Size([len(rows), 1, model.config.hidden_size])]  # only those rows


class _Prefixed(torch.nn.Module):
    """Logits with one extra (virtual-token) position in front: rows of the input no longer
    index them. ``visible``: whether the output layer shows (the hooked path)."""

    def __init__(self, inner, visible: bool) -> None:
        super().__init__()
        self.inner, self.visible = inner, visible

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings() if self.visible else None

    def forward(self, **inputs):
        out = self.inner(**inputs)
        out.logits = torch.cat([out.logits[..., :1, :], out.logits], dim=-2)
        return out


@pytest.mark.parametrize("visible", [False, True])
def test_logits_of_another_shape_are_an_error_not_the_wrong_rows(micro, visible):
    model, tok = micro
    ids = torch.randint(3, len(tok), (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), pytest.raises(ValueError, match="logits_at: the model returned"):
        logits_at(_Prefixed(model, visible), ids, torch.ones_like(ids), torch.tensor([0, 7]))


def _plain_read(
    model, scorer: KGWReadingScorer, first_only: bool = False
) -> tuple[torch.Tensor, int]:
    """A[x] by the definition: each text alone through the model, full softmax, positions
    after each response token summed per previous token (``first_only``: a token's later
    positions in the same text skipped); and how many positions were read."""
    out = torch.zeros(len(scorer.contexts), scorer.vocab, dtype=torch.float64)
    index = {int(x): i for i, x in enumerate(scorer.contexts)}
    read = 0
    with torch.no_grad():
        for ex in scorer.examples:
            ids = torch.tensor([ex.input_ids])
            probs = torch.softmax(model(input_ids=ids).logits[0, :, : scorer.vocab].double(), -1)
            seen: set[int] = set()
            for t in range(len(ex.input_ids) - 1):
                if ex.labels[t + 1] != -100 and not (first_only and ex.input_ids[t] in seen):
                    seen.add(ex.input_ids[t])
                    out[index[ex.input_ids[t]]] += probs[t]
                    read += 1
    return out, read


def test_reading_scorer_reads_what_each_text_alone_gives(micro):
    model, tok = micro
    texts = encode_examples(tok, generate_corpus(30, seed=5), 96)
    assert len({len(e.input_ids) for e in texts}) > 5  # lengths differ: batches are sorted
    scorer = KGWReadingScorer(
        model,
        texts,
        {"kgw:a": KGWScheme(3, len(tok))},
        lambda m, p: None,
        pad_id=tok.pad_token_id,
        batch_size=7,
    )
    want, read = _plain_read(model, scorer)
    assert read == scorer.positions
    got = scorer.observe(None)
    assert torch.allclose(got.double(), want, atol=1e-4)
    assert float(got.sum()) == pytest.approx(scorer.positions, rel=1e-5)
    # A wrapper without a visible output layer reads the same.
    wrapped = KGWReadingScorer(
        _NoHead(model),
        texts,
        {"kgw:a": KGWScheme(3, len(tok))},
        lambda m, p: None,
        pad_id=tok.pad_token_id,
    )
    assert torch.allclose(wrapped.observe(None), got, atol=1e-5)


def test_fk_likelihood_reads_what_each_probe_alone_gives(micro):
    from fedattr.watermarks.fictitious import make_entities
    from fedattr.watermarks.knowledge import FKLikelihoodScorer

    model, tok = micro
    ents = {f"fk:owner{k}": e for k, e in enumerate(make_entities(2, seed=4, decoys=3))}
    lik = FKLikelihoodScorer(model, tok, ents, lambda m, p: None, questions=2, batch_size=5)
    got = lik.observe(None).reshape(-1)
    want = []
    with torch.no_grad():
        for seq, first in lik._seqs:
            logp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0].double(), -1)
            want.append(sum(float(logp[t - 1, seq[t]]) for t in range(max(first, 1), len(seq))))
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), atol=1e-4)


def test_training_loss_on_the_response_only_equals_the_full_logits_loss(tiny_cache):
    import copy

    from fedattr.models.training import TrainSettings, train

    model, tok = load_model(
        ModelConfig(cache_dir=str(tiny_cache), tiny=TinyModelConfig(**MICRO_TINY)), lambda m: None
    )
    model = copy.deepcopy(model)
    texts = encode_examples(tok, generate_corpus(8, seed=9), 64)
    model.eval()  # no dropout: the manual loss below sees the same model
    with torch.no_grad():
        total, count = 0.0, 0
        for ex in texts:
            logits = model(input_ids=torch.tensor([ex.input_ids])).logits[0, :-1].double()
            labels = torch.tensor(ex.labels[1:])
            keep = labels != -100
            total += float(
                torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="sum")
            )
            count += int(keep.sum())
    before = [p.detach().clone() for p in model.parameters()]
    settings = TrainSettings(batch_size=8, micro_batch_size=4, max_steps=1, lr=1e-3)
    out = train(model, model.parameters(), texts, settings, tok.pad_token_id)
    # The one step's loss is the loss before it (no dropout in the micro model's config).
    assert out["loss"] == pytest.approx(total / count, rel=1e-4)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_stacked_read_with_a_lora_output_layer_reads_each_candidate(micro):
    """A LoRA on the output layer too: the gathered rows reach the stacked head candidate-major
    and each candidate's read is what loading it alone gives."""
    import copy

    from fedattr.models.config import LoRAConfig
    from fedattr.models.lora import (
        adapter_state,
        attach_lora,
        can_stack,
        load_state,
        stacked_candidates,
    )

    model, tok = micro
    model = attach_lora(
        copy.deepcopy(model),
        LoRAConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "lm_head"]),
        seed=2,
    )
    assert can_stack(model)
    gen = torch.Generator().manual_seed(3)
    state = adapter_state(model)
    assert any(k.endswith("lm_head.lora_A") for k in state)
    cands = [
        {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
        for _ in range(3)
    ]
    texts = encode_examples(tok, generate_corpus(12, seed=2), 64)
    schemes = {"kgw:a": KGWScheme(3, len(tok))}
    one = KGWReadingScorer(model, texts, schemes, load_state, pad_id=tok.pad_token_id, batch_size=5)
    want = [one.observe(c) for c in cands]
    many = KGWReadingScorer(
        model,
        texts,
        schemes,
        load_state,
        pad_id=tok.pad_token_id,
        batch_size=5,
        stack=stacked_candidates,
    )
    for a, b in zip(many.observe_many(cands), want, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_shared_prompts_are_read_once_with_the_same_log_probabilities(micro):
    """Blocks of continuations of one prompt: the prompt's keys and values are computed once
    and reused; every sum equals reading each sequence whole (a LoRA model, prompts of
    different lengths, a block whose scoring starts at token 1 so nothing is shared, a
    last block shorter than the others, continuations batched by length across prompts)."""
    import copy

    from fedattr.models.config import LoRAConfig
    from fedattr.models.lora import adapter_state, attach_lora, load_state
    from fedattr.models.reading import sequence_logprobs

    model, tok = micro
    model = attach_lora(copy.deepcopy(model), LoRAConfig(r=4, alpha=8), seed=4)
    gen = torch.Generator().manual_seed(5)
    load_state(
        model,
        {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in adapter_state(model).items()},
    )
    model.eval()

    def words(n: int) -> list[int]:
        return torch.randint(3, len(tok), (n,), generator=gen).tolist()

    seqs = []
    for prompt_len in (9, 4, 1, 13):
        prompt = words(prompt_len)
        for answer_len in (1, 3, 2):
            seqs.append((prompt + words(answer_len), prompt_len))
    seqs += [(words(7), 5), (words(6), 0)]  # a last block of two, unrelated
    with torch.no_grad():
        shared = sequence_logprobs(model, seqs, tok.pad_token_id, batch_size=4, group=3)
        # two prompts per prefix pass, their continuations regrouped by length across them
        mixed = sequence_logprobs(model, seqs, tok.pad_token_id, batch_size=8, group=3)
        whole = sequence_logprobs(model, seqs, tok.pad_token_id, batch_size=4, group=1)
        want = []
        for ids, first in seqs:
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
            want.append(sum(float(logp[t - 1, ids[t]]) for t in range(max(first, 1), len(ids))))
    want = torch.tensor(want, dtype=torch.float64)
    assert torch.allclose(whole, want, atol=1e-4)
    assert torch.allclose(shared, want, atol=1e-4)
    assert torch.allclose(mixed, want, atol=1e-4)


def test_a_shared_prompt_passes_its_cache_under_the_keyword_the_model_takes(micro):
    """The prompt's cache goes to the forward under the keyword the installed transformers
    names in its signature (``cache`` since it renamed ``past_key_values``, which it warns
    about and will drop), bare or behind a peft wrapper, and nothing warns of the old name."""
    import copy
    import inspect
    import warnings

    from fedattr.models.config import LoRAConfig
    from fedattr.models.lora import attach_lora
    from fedattr.models.reading import cache_keyword, sequence_logprobs

    model, tok = micro
    params = inspect.signature(type(model).forward).parameters
    want = "cache" if "cache" in params else "past_key_values"
    assert want in params
    wrapped = attach_lora(copy.deepcopy(model), LoRAConfig(r=4, alpha=8), seed=4)
    assert cache_keyword(model) == cache_keyword(wrapped) == want
    seqs = [([5, 6, 7, 8, 9 + k], 4) for k in range(3)]
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for m in (model, wrapped):
            sequence_logprobs(m, seqs, tok.pad_token_id, batch_size=4, group=3)
    assert not [w for w in caught if "past_key_values" in str(w.message)]


def test_a_forked_prefix_cache_shares_its_tensors_and_leaves_them_intact():
    """Each continuation batch of a shared prompt reads from a fork of the prompt's cache: the
    fork holds the same key/value tensors (no copy), and selecting rows of it and appending
    to it never changes the prompt's cache that later batches read."""
    from transformers import DynamicCache

    from fedattr.models.reading import _fork

    cache = DynamicCache()
    keys, values = torch.randn(3, 2, 5, 4), torch.randn(3, 2, 5, 4)
    cache.update(keys.clone(), values.clone(), 0)
    fork = _fork(cache)
    assert fork.layers[0].keys is cache.layers[0].keys
    assert fork.layers[0].values is cache.layers[0].values
    fork.batch_select_indices(torch.tensor([2, 0]))
    fork.update(torch.ones(2, 2, 1, 4), torch.ones(2, 2, 1, 4), 0)
    assert torch.equal(cache.layers[0].keys, keys) and torch.equal(cache.layers[0].values, values)
    assert torch.equal(fork.layers[0].keys[:, :, :5], keys[[2, 0]])
    assert fork.layers[0].keys.shape == (2, 2, 6, 4)


def test_folded_adapters_read_what_the_adapters_give_and_touch_nothing(micro):
    """Inside ``folded_adapters`` each adapted module is one linear with W + s·B·A: the same
    logits up to float rounding, the model's tensors untouched (micro ties lm_head to the
    embeddings), a disabled adapter reads the base model, and afterwards the model is as
    before."""
    import copy

    from fedattr.models.config import LoRAConfig
    from fedattr.models.lora import (
        adapter_state,
        attach_lora,
        folded_adapters,
        load_state,
        lora_layers,
        stacked_candidates,
    )

    model, tok = micro
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"]
    model = attach_lora(
        copy.deepcopy(model), LoRAConfig(r=8, alpha=16, target_modules=targets), seed=1
    )
    gen = torch.Generator().manual_seed(6)
    state = {
        k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in adapter_state(model).items()
    }
    load_state(model, state)
    model.eval()
    layers = lora_layers(model)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ids = torch.randint(3, len(tok), (2, 9), generator=gen)
    with torch.no_grad():
        want = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
        with folded_adapters(model) as folded:
            assert folded
            got = model(input_ids=ids).logits
            with model.disable_adapter():  # owner detect's reference read of a LoRA model
                got_base = model(input_ids=ids).logits
            assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        after = model(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4) and not torch.equal(got, want)
    assert torch.equal(got_base, base) and not torch.allclose(base, want, atol=1e-3)
    assert torch.equal(after, want)
    assert not any("forward" in vars(layer) for layer in layers.values())
    # Not folded: with autograd on (training), in training mode, in bf16 (could round the
    # change away), or inside a stacked pass (its layers are patched already).
    with folded_adapters(model) as folded:
        assert not folded
    model.train()
    with torch.no_grad(), folded_adapters(model) as folded:
        assert not folded
    model.eval()
    with torch.no_grad(), folded_adapters(copy.deepcopy(model).to(torch.bfloat16)) as folded:
        assert not folded
    with (
        torch.no_grad(),
        stacked_candidates(model, [state, state]),
        folded_adapters(model) as folded,
    ):
        assert not folded
    hook = next(iter(layers.values())).base_layer.register_forward_hook(lambda *a: None)
    with torch.no_grad(), folded_adapters(model) as folded:
        assert not folded  # a folded read would bypass the base layer's hook
    hook.remove()
    # An error inside still restores the model.
    with pytest.raises(RuntimeError, match="stop"), torch.no_grad(), folded_adapters(model):
        raise RuntimeError("stop")
    assert not any("forward" in vars(layer) for layer in layers.values())
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, want)


def test_generation_decodes_a_lora_model_folded_with_the_adapters_tokens(micro, monkeypatch):
    """``generate`` folds a LoRA model's factors for decoding: the same greedy continuations
    as decoding through the unfolded adapters, the fold really taken, the model restored."""
    import contextlib
    import copy

    from fedattr.models import text
    from fedattr.models.config import LoRAConfig
    from fedattr.models.lora import adapter_state, attach_lora, load_state, lora_layers

    model, tok = micro
    model = attach_lora(copy.deepcopy(model), LoRAConfig(r=8, alpha=16), seed=2)
    gen = torch.Generator().manual_seed(3)
    load_state(
        model,
        {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in adapter_state(model).items()},
    )
    prompts = [r.instruction for r in generate_corpus(6, seed=4)]
    folds = []
    real = text.folded_adapters

    @contextlib.contextmanager
    def spy(m):
        with real(m) as folded:
            folds.append(folded)
            yield folded

    monkeypatch.setattr(text, "folded_adapters", spy)
    model.train()
    got = text.generate(model, tok, prompts, 10, batch_size=4)
    assert folds == [True] and model.training
    assert not any("forward" in vars(layer) for layer in lora_layers(model).values())

    @contextlib.contextmanager
    def unfolded(m):
        yield False

    monkeypatch.setattr(text, "folded_adapters", unfolded)
    assert got == text.generate(model, tok, prompts, 10, batch_size=4)
    # and the adapters matter: the base model continues otherwise
    with model.disable_adapter():
        assert text.generate(model, tok, prompts, 10, batch_size=4) != got
