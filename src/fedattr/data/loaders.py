"""Loading instruction data: local JSON/JSONL (Alpaca or chat form) or a Hugging Face dataset."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..errors import BUGS, UserError, first_line, read_text
from .records import Record


class DataError(UserError):
    """A data source that cannot be read or has the wrong shape."""


def record_from_mapping(row: Mapping[str, Any], where: str = "row") -> Record:
    """One record from an Alpaca row (instruction/input/output) or a chat row (messages).

    A chat row becomes one record per conversation: the first user turn is the instruction and
    the first assistant turn after it is the output (as UltraChat-style SFT uses its first turn).
    """
    if "instruction" in row and "output" in row:
        return Record(
            instruction=str(row["instruction"]),
            input=str(row.get("input") or ""),
            output=str(row["output"]),
            category=str(row.get("category", "general")),
        )
    messages = row.get("messages")
    if isinstance(messages, list):
        user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
        if user is not None:
            reply = next((m for m in messages[user + 1 :] if m.get("role") == "assistant"), None)
            if reply is not None:
                return Record(
                    str(messages[user]["content"]),
                    str(reply["content"]),
                    category=str(row.get("category", "general")),
                )
        raise DataError(f"{where}: 'messages' has no user turn followed by an assistant turn")
    raise DataError(
        f"{where}: expected Alpaca keys (instruction, input, output) or chat 'messages'; "
        f"got keys {sorted(row)[:6]}"
    )


def json_lines(text: str) -> list[str]:
    """The lines of a JSON Lines text, split at ``\n`` only.

    ``str.splitlines`` also splits at U+2028, U+2029 and U+0085, which ``json.dumps(...,
    ensure_ascii=False)`` leaves unescaped inside strings: a generated response holding one
    would be cut in two."""
    return [line.rstrip("\r") for line in text.split("\n")]


def json_lines_values(text: str) -> list[Any]:
    """The values of a JSON Lines text (split as :func:`json_lines`), blank lines skipped. A
    line that is not JSON raises :class:`json.JSONDecodeError` located in the whole text, so
    its ``lineno`` is the line's own number (a line parsed alone is always "line 1")."""
    out, start = [], 0
    for raw in text.split("\n"):
        line = raw.rstrip("\r")
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise json.JSONDecodeError(exc.msg, text, start + exc.pos) from None
        start += len(raw) + 1
    return out


def _rows_from_file(path: Path, option: str) -> Iterable[tuple[str, Mapping[str, Any]]]:
    text = read_text(path, option, DataError)
    if path.suffix == ".jsonl":
        for i, line in enumerate(json_lines(text), start=1):
            if line.strip():
                try:
                    yield f"{path}:{i}", json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}:{i}: not valid JSON ({exc.msg})") from exc
        return
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of records")
    for i, row in enumerate(data):
        yield f"{path}[{i}]", row


def load_records(
    source: str, split: str = "train", limit: int | None = None, option: str = "data.path"
) -> list[Record]:
    """Records from a local ``.json``/``.jsonl`` file, or else a Hugging Face dataset id
    (``option``: the setting that named it, for messages).

    Records with an empty instruction or output are dropped.
    """
    path = Path(source)
    if path.suffix in (".json", ".jsonl") or path.exists():
        if path.is_dir():
            raise DataError(f"{option}: {source!r} is a directory; a .json/.jsonl file is expected")
        if not path.is_file():
            raise DataError(f"{option}: file {source!r} does not exist")
        rows: Iterable[tuple[str, Mapping[str, Any]]] = _rows_from_file(path, option)
    else:
        rows = _rows_from_hub(source, split, option)
    out = []
    try:
        for where, row in rows:
            if not isinstance(row, Mapping):
                raise DataError(f"{where}: expected an object, got {type(row).__name__}")
            rec = record_from_mapping(row, where)
            if rec.instruction.strip() and rec.output.strip():
                out.append(rec)
            if limit is not None and len(out) >= limit:
                break
    except DataError as exc:  # a row's or line's message names the setting too
        if str(exc).startswith(f"{option}:"):
            raise
        raise DataError(f"{option}: {exc}") from None
    if not out:
        raise DataError(f"{option}: {source!r} holds no usable records")
    return out


def _rows_from_hub(
    name: str, split: str, option: str = "data.path"
) -> Iterable[tuple[str, Mapping[str, Any]]]:
    try:
        import datasets  # imported lazily: an optional dependency
    except ImportError as exc:
        raise DataError(
            f"{option}: {name!r} is not a local file, and loading a Hugging Face dataset needs "
            "the 'datasets' package (pip install datasets)"
        ) from exc
    try:
        ds = datasets.load_dataset(name, split=split)
    except BUGS:
        raise
    except Exception as exc:  # network, auth, missing split: all one clear message
        raise DataError(
            f"{option}: could not load Hugging Face dataset {name!r} (split {split!r}): "
            f"{first_line(exc, with_class=True)}. "
            "Offline? Pass a local .json/.jsonl file instead."
        ) from exc
    for i, row in enumerate(ds):
        yield f"{name}[{i}]", row
