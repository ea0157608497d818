"""``fedattr owner check``: is this text watermarked under my key? Exact p-values, every
seeding scheme, agreement with ``owner watermark``'s report and with MarkLLM's reference
detector, uniform p on unwatermarked text, and one-line refusals of bad input."""

import io
import itertools
import json
import math
from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import binom, hypergeom, kstest

from conftest import fixed_key, import_markllm
from fedattr.cli import build_parser, main
from fedattr.errors import UserError
from fedattr.owner.check import (
    Document,
    binomial_log10_sf,
    check_documents,
    fixed_lists_log10_sf,
    read_documents,
)
from fedattr.watermarks.keys import OwnerKey, generate_key, save_key

HASH = 15485863


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- the p-values -------------------------------------------------------------------------


def test_the_fixed_lists_tail_is_the_exact_convolution():
    rng = np.random.default_rng(0)
    sizes = [int(k) for k in rng.integers(1, 6, size=40)]
    V, m = 20, 5
    law = np.ones(1)
    for k in sizes:  # the brute-force law of the sum, no tilting
        law = np.convolve(law, hypergeom.pmf(np.arange(min(k, m) + 1), V, m, k))
    top = sum(min(k, m) for k in sizes)
    for g in (0, 10, 30, 50, 80, top):
        assert fixed_lists_log10_sf(g, sizes, V, m) == pytest.approx(
            math.log10(law[g:].sum()), rel=1e-9, abs=1e-12
        )
    assert fixed_lists_log10_sf(top + 1, sizes, V, m) == -math.inf
    # one token per context: the binomial exactly, far below float's range too
    for n, g in ((300, 200), (2000, 1500), (2000, 2000)):
        ours = fixed_lists_log10_sf(g, [1] * n, 320, 80)
        assert ours == pytest.approx(binomial_log10_sf(g, n, 0.25), rel=1e-9)
    assert binomial_log10_sf(1500, 2000, 0.25) == pytest.approx(-478.7563, abs=1e-3)
    assert binomial_log10_sf(70, 200, 0.25) == pytest.approx(math.log10(binom.sf(69, 200, 0.25)))
    assert binomial_log10_sf(0, 0, 0.25) == 0.0


def test_the_binomial_is_conservative_in_the_tail():
    """Pairs sharing a context are drawn without replacement from one fixed-size list: the
    exact tail is lighter than the binomial's wherever p is small."""
    rng = np.random.default_rng(1)
    for V, m in ((320, 80), (1000, 500), (49152, 12288)):
        sizes = [int(k) for k in rng.integers(1, 12, size=60)]
        n = sum(sizes)
        top = sum(min(k, m) for k in sizes)
        for g in np.unique(np.linspace(m / V * n + 1, top, 40).astype(int)):
            b = binomial_log10_sf(g, n, m / V)
            if b < -1:
                assert fixed_lists_log10_sf(g, sizes, V, m) <= b + 1e-12


# --- the command on fedattr's own corpora ---------------------------------------------------


def test_check_agrees_with_the_watermark_report(micro, tmp_path, capsys):
    from fedattr.data.corpus import generate_corpus
    from fedattr.owner.corpus import read_rows, watermark_kgw

    path, model, tokenizer = micro
    corpus = _jsonl(
        tmp_path / "corpus.jsonl",
        [
            {"instruction": r.instruction, "input": r.input, "output": r.output}
            for r in generate_corpus(10, seed=3)
        ],
    )
    key = fixed_key(1, delta=6.0)
    key_file = save_key(key, tmp_path / "owner.key")
    wm = tmp_path / "wm.jsonl"
    report = watermark_kgw(
        key,
        read_rows(corpus),
        model,
        tokenizer,
        wm,
        model_name=str(path),
        chunk=5,
        max_new_tokens=24,
        min_tokens=4,
    )
    # no --model: the tokenizer recorded in wm.jsonl.report.json
    assert main(["owner", "check", "--key", str(key_file), "--in", str(wm), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    total, z = out["total"], report["z_written"]
    assert (total["green"], total["scored"]) == (z["green"], z["scored"])
    assert total["z"] == pytest.approx(z["z"], rel=1e-12)
    assert total["p"] < 1e-6 and total["log10_p_fixed_lists"] <= total["log10_p"]
    assert len(out["documents"]) == report["kept"] and "report.json" in out["tokenizer"]
    assert out["key"] == key.fingerprint and out["vocab_size"] == len(tokenizer)
    # the input corpus is not watermarked under the key
    assert (
        main(
            [
                "owner",
                "check",
                "--key",
                str(key_file),
                "--in",
                str(corpus),
                "--model",
                str(path),
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["total"]["p"] > 1e-3
    # the readable answer: one line per document, then the total
    assert main(["owner", "check", "--key", str(key_file), "--in", str(wm)]) == 0
    text = capsys.readouterr().out
    assert "row 1 " in text and f"all {report['kept']} documents (distinct pairs" in text


@pytest.mark.parametrize("scheme", ["fedattr", "lm-watermarking", "markllm"])
def test_every_seeding_scheme_is_found_and_no_other_key(micro, scheme):
    from fedattr.data.corpus import generate_corpus
    from fedattr.watermarks.teacher import watermark_records

    _, model, tokenizer = micro
    hash_key = None if scheme == "fedattr" else HASH
    key = fixed_key(5, scheme=scheme, hash_key=hash_key, delta=4.0)
    records = watermark_records(
        model,
        tokenizer,
        generate_corpus(6, seed=9),
        key.kgw_scheme(len(tokenizer)),
        max_new_tokens=40,
        min_tokens=4,
        seed=1,
    )
    docs = [Document(f"doc {i}", (r.output,)) for i, r in enumerate(records)]
    found = check_documents(key, tokenizer, docs)
    assert found.total.log10_p < -6 and found.scheme == scheme
    other = fixed_key(6) if scheme != "fedattr" else fixed_key(6, scheme="markllm", hash_key=7)
    assert check_documents(other, tokenizer, docs).total.log10_p > -2


def test_unwatermarked_documents_give_uniform_p_values(micro):
    """Under a key independent of the text (a fresh key per document) the per-document p is
    uniform: randomised at its atom (the count is discrete), KS over 240 documents."""
    from fedattr.data.corpus import generate_corpus

    _, _, tokenizer = micro
    rng = np.random.default_rng(7)
    binomial, fixed, plain = [], [], []
    for i, r in enumerate(generate_corpus(240, seed=21)):
        report = check_documents(fixed_key(1000 + i), tokenizer, [Document("d", (r.output,))])
        d, q = report.total, report.green_size / report.vocab_size
        u = rng.random()
        binomial.append(binom.sf(d.green, d.scored, q) + u * binom.pmf(d.green, d.scored, q))
        above = 10 ** fixed_lists_log10_sf(
            d.green + 1, _contexts(tokenizer, r.output), report.vocab_size, report.green_size
        )
        fixed.append(above + u * (10**d.log10_p_fixed_lists - above))
        plain.append(d.p)
    ks_binomial, ks_fixed = kstest(binomial, "uniform").pvalue, kstest(fixed, "uniform").pvalue
    print(f"KS p-value over 240 documents: binomial {ks_binomial:.3f}, fixed lists {ks_fixed:.3f}")
    assert ks_binomial > 0.01 and ks_fixed > 0.01
    # the reported (not randomised) p is valid: no more small p-values than their level
    assert np.mean(np.array(plain) <= 0.05) <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 240)


def _contexts(tokenizer, text):
    """Distinct scored tokens per previous token (counted apart from the detector)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return list(Counter(prev for prev, _ in set(itertools.pairwise(ids))).values())


# --- interoperability: MarkLLM's own KGW generates and detects -----------------------------


@pytest.fixture(scope="module")
def markllm_kgw(markllm_target):
    """MarkLLM 0.1.5's KGW module (installed once per session, as for the reference test)."""
    (config,) = import_markllm(
        markllm_target, "markllm.utils.transformers_config", "TransformersConfig"
    )
    (kgw,) = import_markllm(markllm_target, "markllm.watermark.kgw", "kgw")
    return markllm_target, kgw, config


def test_check_equals_markllms_detector_on_markllms_watermarked_text(
    micro, markllm_kgw, tmp_path, capsys
):
    from fedattr.data.corpus import generate_corpus

    path, model, tokenizer = micro
    target, kgw, TransformersConfig = markllm_kgw
    config = json.loads((target / "markllm" / "config" / "KGW.json").read_text())
    config_file = tmp_path / "KGW.json"
    config_file.write_text(json.dumps({**config, "gamma": 0.25}))
    reference = kgw.KGW(
        str(config_file),
        TransformersConfig(
            model=model,
            tokenizer=tokenizer,
            vocab_size=len(tokenizer),
            device="cpu",
            max_new_tokens=64,
            do_sample=True,
            pad_token_id=tokenizer.pad_token_id,
        ),
    )
    torch.manual_seed(0)
    texts = [
        reference.generate_watermarked_text(r.instruction) for r in generate_corpus(6, seed=11)
    ]
    docs = _jsonl(
        tmp_path / "leaked.jsonl",
        [
            {"messages": [{"role": "user", "content": "?"}, {"role": "assistant", "content": t}]}
            for t in texts
        ],
    )
    key = OwnerKey(
        "kgw",
        "0" * 64,
        gamma=0.25,
        delta=config["delta"],
        scheme="markllm",
        hash_key=config["hash_key"],
    )
    key_file = save_key(key, tmp_path / "markllm.key")
    base = [
        "owner",
        "check",
        "--key",
        str(key_file),
        "--in",
        str(docs),
        "--model",
        str(path),
        "--json",
    ]
    # MarkLLM scores every token (no deduplication): compare with --no-dedupe
    assert main([*base, "--no-dedupe"]) == 0
    every = json.loads(capsys.readouterr().out)
    assert main(base) == 0
    distinct = json.loads(capsys.readouterr().out)
    pairs_total = 0
    for text, ours, ours_distinct in zip(
        texts, every["documents"], distinct["documents"], strict=True
    ):
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
        z, flags = reference.utils.score_sequence(ids)
        assert (ours["green"], ours["scored"]) == (flags.count(1), len(ids) - 1)
        assert ours["z"] == pytest.approx(z, rel=1e-12)
        assert ours["z"] == pytest.approx(reference.detect_watermark(text)["score"], rel=1e-12)
        # deduplicated: the reference's colour of each distinct pair, once
        seen = dict.fromkeys(zip(ids[:-1].tolist(), ids[1:].tolist(), flags[1:], strict=True))
        assert (ours_distinct["green"], ours_distinct["scored"]) == (
            sum(f == 1 for _, _, f in seen),
            len(seen),
        )
        pairs_total += len(ids) - 1
    print(
        f"MarkLLM interop: {pairs_total} tokens, z {every['total']['z']:.2f} (= MarkLLM's "
        f"formula), deduplicated log10 p {distinct['total']['log10_p']:.1f}"
    )
    assert pairs_total >= 300 and distinct["total"]["p"] < 1e-6


# --- inputs ------------------------------------------------------------------------------


def test_inputs_text_stdin_alpaca_fields_and_chat_roles(tmp_path):
    txt = tmp_path / "leaked.txt"
    txt.write_text("One document.\n\nStill the same document.")
    assert read_documents(str(txt)) == [Document("leaked.txt", (txt.read_text(),))]
    assert read_documents("-", stdin=io.StringIO("{plain text}")) == [
        Document("<stdin>", ("{plain text}",))
    ]
    rows = [
        {"instruction": "I", "input": "X", "output": "O"},
        {
            "messages": [
                {"role": "user", "content": "U1"},
                {"role": "assistant", "content": "A1"},
                {"role": "user", "content": "U2"},
                {"role": "assistant", "content": "A2"},
            ]
        },
    ]
    jsonl = _jsonl(tmp_path / "rows.jsonl", rows)
    assert [d.texts for d in read_documents(str(jsonl))] == [("O",), ("A1", "A2")]
    assert [d.texts for d in read_documents(str(jsonl), "user")] == [(), ("U1", "U2")]
    assert [d.texts for d in read_documents(str(jsonl), "input")] == [("X",), ()]
    as_json = tmp_path / "rows.json"
    as_json.write_text(json.dumps(rows))
    assert read_documents(str(as_json)) == read_documents(str(jsonl))
    assert read_documents("-", stdin=io.StringIO(jsonl.read_text())) == read_documents(str(jsonl))


def test_every_owner_option_has_help():
    parser = build_parser()
    owner = next(
        a
        for a in parser._subparsers._group_actions[0].choices["owner"]._actions
        if a.dest == "owner"
    )
    assert set(owner.choices) == {"keygen", "watermark", "check", "detect", "score"}
    for name, sub in owner.choices.items():
        for action in sub._actions:
            if action.dest != "help":
                assert action.help, f"owner {name} {action.option_strings or action.dest}"


@pytest.fixture
def owner_key(tmp_path):
    return save_key(generate_key(), tmp_path / "owner.key")


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "--in: '{in}' does not exist (a .txt file"),
        ("empty", "--in: '{in}' is empty: no text to check"),
        ("folder", "--in: '{in}' is a folder; give a file (a .txt file"),
        ("fk key", "--key: this is a fk key; this step needs a kgw key"),
        ("no rows", "--in: '{in}' holds no rows"),
        ("no field", "--field: no row has a 'title' field or 'title' turns"),
        ("field of a text", "--field: for .jsonl/.json rows only"),
        ("no tokenizer", "--model '{model}': the key's tokenizer is not available"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, owner_key, capsys, case, message):
    key, target, extra = owner_key, tmp_path / "texts.txt", []
    if case == "missing":
        target = tmp_path / "nothing.jsonl"
    elif case == "empty":
        target.write_text("  \n")
    elif case == "folder":
        target = tmp_path
    elif case == "fk key":
        key = save_key(generate_key("fk"), tmp_path / "fk.key")
        target.write_text("text")
    elif case == "no rows":
        target = tmp_path / "rows.json"
        target.write_text("[]")
    elif case == "no field":
        target = _jsonl(tmp_path / "rows.jsonl", [{"instruction": "I", "output": "O"}])
        extra = ["--field", "title"]
    elif case == "field of a text":
        target.write_text("text")
        extra = ["--field", "output"]
    else:
        target.write_text("text")
        extra = ["--model", str(tmp_path / "no-model")]
    code = main(["owner", "check", "--key", str(key), "--in", str(target), *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert message.format(**{"in": target, "model": tmp_path / "no-model"}) in err


# --- the key's vocabulary ----------------------------------------------------------------


def test_a_key_made_for_a_tokenizer_refuses_another_vocabulary(micro, tmp_path, capsys):
    """Issue 37, item 2: a markllm key checked with the wrong tokenizer answered "no
    watermark" (z = -1.81). A key made with ``keygen --model`` records the vocabulary's size
    and fingerprint; ``owner check`` (and detect, watermark) refuse another one in one line."""
    import shutil

    from fedattr.watermarks.keys import load_key, tokenizer_fingerprint

    path, _, tokenizer = micro
    made = tmp_path / "markllm.key"
    # a reference-scheme key needs the model its corpus was watermarked with
    assert main(["owner", "keygen", "--scheme", "markllm", "--out", str(made)]) == 2
    assert "--model: a markllm key needs the model" in capsys.readouterr().err
    assert not made.exists()
    argv = ["owner", "keygen", "--scheme", "markllm", "--model", str(path), "--out", str(made)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    key = load_key(made)
    assert (key.vocab_size, key.tokenizer) == (len(tokenizer), tokenizer_fingerprint(tokenizer))
    assert out.count(key.fingerprint) == 1  # printed once, as the public fingerprint
    # another tokenizer: the micro one with one token more
    other = tmp_path / "other-tokenizer"
    shutil.copytree(path, other)
    grown = type(tokenizer).from_pretrained(other)
    grown.add_tokens(["<an-extra-token>"])
    grown.save_pretrained(other)
    texts = tmp_path / "texts.txt"
    texts.write_text("Some text to check, which a key made for another tokenizer must refuse.")
    base = ["owner", "check", "--key", str(made), "--in", str(texts)]
    assert main([*base, "--model", str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert (
        f"--model '{other}': its tokenizer has {len(tokenizer) + 1} tokens, but this key's "
        f"green lists are over a vocabulary of {len(tokenizer)}"
    ) in err
    assert main([*base, "--model", str(path)]) == 0  # its own tokenizer
    capsys.readouterr()
    # same size, other tokens: the fingerprint tells them apart
    renamed = OwnerKey("kgw", "1" * 64, vocab_size=len(tokenizer), tokenizer="0000-0000-0000-0000")
    with pytest.raises(UserError, match="is not the one this key was made for"):
        renamed.check_tokenizer(tokenizer, "--model 'x'")
    # an older markllm key records no tokenizer: no --model (and no report) is refused, not
    # answered with tiny's vocabulary
    old = save_key(fixed_key(3, scheme="markllm", hash_key=HASH), tmp_path / "old.key")
    assert "vocab_size" not in old.read_text()
    assert main(["owner", "check", "--key", str(old), "--in", str(texts)]) == 2
    assert "--model: this markllm key records no tokenizer" in capsys.readouterr().err


def test_keys_written_before_the_vocabulary_field_still_load(tmp_path):
    """A key file without ``vocab_size``/``tokenizer`` (all keys before issue 37) loads as a
    key that accepts any tokenizer; one with them round-trips."""
    import os

    from fedattr.watermarks.keys import load_key

    old = tmp_path / "old.key"
    old.write_text(
        json.dumps(
            {
                "format": "fedattr-owner-key/1",
                "kind": "kgw",
                "secret": "ab" * 32,
                "gamma": 0.25,
                "delta": 3.0,
                "context": 1,
                "scheme": "fedattr",
                "hash_key": None,
                "fk": {},
            }
        )
    )
    os.chmod(old, 0o600)
    key = load_key(old)
    assert key.vocab_size is None and key.tokenizer is None
    key.check_tokenizer(SimpleTokenizer(7), "--model 'x'")  # any vocabulary
    new = save_key(
        OwnerKey("kgw", "cd" * 32, vocab_size=7, tokenizer="aaaa-bbbb-cccc-dddd"),
        tmp_path / "new.key",
    )
    assert load_key(new) == OwnerKey(
        "kgw", "cd" * 32, vocab_size=7, tokenizer="aaaa-bbbb-cccc-dddd"
    )
    with pytest.raises(UserError, match="its tokenizer has 8 tokens"):
        load_key(new).check_tokenizer(SimpleTokenizer(8), "--model 'x'")


class SimpleTokenizer:
    """A stand-in with ``len`` and ``get_vocab``: all a key's vocabulary check reads."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def get_vocab(self) -> dict[str, int]:
        return {f"t{i}": i for i in range(self.size)}
