"""KGW read on each owner's own watermarked documents (``watermark.kgw.probes = "documents"``)."""

import pytest
import torch

from conftest import MICRO_TINY
from conftest import small_overrides as _small
from fedattr.config import ConfigError, load
from fedattr.data.corpus import generate_corpus
from fedattr.models.config import ModelConfig, TinyModelConfig
from fedattr.models.loading import load_model
from fedattr.models.text import encode_examples
from fedattr.pipeline.config import RunConfig
from fedattr.pipeline.run import run_experiment
from fedattr.watermarks.documents import KGWDocumentScorer
from fedattr.watermarks.kgw import KGWScheme
from fedattr.watermarks.radioactivity import KGWReadingScorer, _first_occurrences
from test_reading import _Tilted
from test_reading_batches import _plain_read


@pytest.fixture(scope="module")
def micro(tiny_cache):
    return load_model(
        ModelConfig(cache_dir=str(tiny_cache), tiny=TinyModelConfig(**MICRO_TINY)), lambda m: None
    )


def test_first_occurrences_keep_each_token_once_in_order():
    ids = [5, 7, 5, 9, 7, 7, 2, 9]
    assert _first_occurrences(ids, range(8)) == [0, 1, 3, 6]
    # Only the read positions count as seen: a token before them (the prompt) does not.
    assert _first_occurrences(ids, range(2, 8)) == [2, 3, 4, 6]


def test_first_only_reading_reads_each_previous_token_at_its_first_position(micro):
    """By the definition: each text alone, full softmax, the distribution after each response
    position summed per previous token, a token's later positions in the same text skipped."""
    model, tok = micro
    texts = encode_examples(tok, generate_corpus(12, seed=8), 96)
    scorer = KGWReadingScorer(
        model,
        texts,
        {"kgw:a": KGWScheme(3, len(tok))},
        lambda m, p: None,
        pad_id=tok.pad_token_id,
        batch_size=5,
        first_only=True,
    )
    every = KGWReadingScorer(
        model, texts, {"kgw:a": KGWScheme(3, len(tok))}, lambda m, p: None, pad_id=tok.pad_token_id
    )
    want, read = _plain_read(model, scorer, first_only=True)
    assert scorer.positions == read < every.positions  # the texts repeat tokens
    assert torch.allclose(scorer.observe(None).double(), want, atol=1e-4)


def test_each_owner_is_read_on_its_own_documents_with_its_own_key(micro):
    model, tok = micro
    V = len(tok)
    schemes = {"kgw:a": KGWScheme(11, V), "kgw:b": KGWScheme(12, V)}
    docs = {"kgw:a": generate_corpus(16, seed=1), "kgw:b": generate_corpus(10, seed=2)}
    tilted = _Tilted(model, schemes["kgw:a"])

    def load_(m, params):
        m.tilt, m.noise, m.noise_seed = params

    scorer = KGWDocumentScorer(tilted, tok, docs, schemes, load_, max_len=96)
    ref = scorer.observe((0.0, 0.0, 0))
    towards_a = scorer.observe((0.3, 0.0, 0))
    change = scorer.change(ref, towards_a)
    assert sorted(change) == sorted(scorer.key_laws()) == ["kgw:a", "kgw:b"]
    for owner, reader in scorer.readers.items():
        assert change[owner].shape == (len(reader.contexts), V)
        assert scorer.owner_keys(owner).keys() == {owner}  # no other owner reads this part
        W = change[owner] - change[owner].mean(1, keepdim=True)
        values = scorer.owner_values(owner, W)
        assert values.keys() == {owner}
        green = reader.green[owner]
        assert values[owner] == pytest.approx(float(W[green].double().sum()), rel=1e-5)
        # One pass over every owner's documents reads each as that owner's reader alone does.
        assert torch.allclose(towards_a[owner], reader.observe((0.3, 0.0, 0)), atol=1e-5)
        split = {**scorer.owner_values_rows(owner, W[:3], 0)}
        rest = scorer.owner_values_rows(owner, W[3:], 3)
        assert split[owner] + rest[owner] == pytest.approx(values[owner], rel=1e-5, abs=1e-7)
        probs = scorer.reference_probabilities(ref)[owner]
        assert torch.allclose(probs.sum(1), torch.ones(len(reader.contexts)), atol=1e-4)
    z = scorer.contrast(ref, towards_a)
    assert z["kgw:a"] > 6 and abs(z["kgw:b"]) < 4  # b's key is unrelated to the tilt
    # Reading several candidates at once gives what reading each alone gives.
    many = scorer.observe_many([(0.0, 0.0, 0), (0.3, 0.0, 0)])
    for owner in docs:
        assert torch.allclose(many[1][owner], towards_a[owner], atol=1e-5)


def test_an_owner_without_documents_is_refused(micro):
    model, tok = micro
    with pytest.raises(ValueError, match=r"no documents for owners \['kgw:b'\]"):
        KGWDocumentScorer(
            model,
            tok,
            {"kgw:a": generate_corpus(2, seed=1)},
            {"kgw:a": KGWScheme(1, len(tok)), "kgw:b": KGWScheme(2, len(tok))},
            lambda m, p: None,
            max_len=64,
        )


def test_only_the_kgw_reading_detector_reads_documents():
    assert load(RunConfig, None, []).watermark.reads_documents  # the default
    assert not load(RunConfig, None, ["watermark.kgw.probes=held-out"]).watermark.reads_documents
    assert not load(RunConfig, None, ["watermark.kind=fk"]).watermark.reads_documents
    greedy = ["watermark.detector=greedy", "attribution.statistic=paper"]
    assert not load(RunConfig, None, greedy).watermark.reads_documents
    with pytest.raises(ConfigError, match=r"watermark\.kgw\.probes"):
        load(RunConfig, None, ["watermark.kgw.probes=owners"])


def test_a_run_reads_every_owner_on_its_documents_idle_owners_included(tiny_cache):
    """One watermarked client of two owners: the idle owner watermarks held-out records, which
    no client is given; both are read; the baselines still read the held-out texts."""
    cfg = load(
        RunConfig,
        None,
        _small(
            tiny_cache,
            "attribution.calibrated.null_keys=0",
            "baselines=true",
        ),
    )
    lines: list[str] = []
    result = run_experiment(cfg, progress=lines.append)
    d = result.to_dict()
    assert any("held-out (no client's) documents" in line for line in lines)
    laws = d["key_laws"]
    assert sorted(laws) == ["kgw:owner0", "kgw:owner1"]  # one part per owner
    held = d["federation"]["owner_documents"]
    assert sorted(held) == ["kgw:owner0", "kgw:owner1"] and min(held.values()) > 0
    assert {c["statistic"] for c in d["clients"]} <= {"kgw:owner0", "kgw:owner1"}
    assert d["baselines"]  # FLForensics and the rest ran on the held-out reading
