"""Watermarking a corpus with the owner's key, resumably.

KGW: a model rewrites every response under the key's green lists (the paper's teacher), in
chunks; each finished chunk is appended to ``<out>.progress.jsonl``, so a killed job continues
where it stopped (with the same settings: a different model, key or chunking is refused). The
corpus is written in its input form (Alpaca rows keep their other fields; a chat row gets its
first assistant turn after the first user turn replaced) once every chunk is done, with a report
of kept and dropped documents and the z of the written responses under the key.

Fictitious Knowledge: documents about the key's fabricated entity, from templates or written
by a model, with the share that states every target attribute.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..attribution.round_folder import write_atomic
from ..data.loaders import DataError, json_lines, json_lines_values, record_from_mapping
from ..data.records import Record
from ..errors import UserError, read_text, require_file, require_writable_folder
from ..watermarks.keys import OwnerKey

Say = Callable[[str], None]

ROWS_HELP = "a .jsonl file (one Alpaca or chat object a line) or a .json file (a list of them)"
"""The corpus files :func:`read_rows` takes, in its messages."""


def read_rows(path: str | Path, option: str = "--in") -> list[dict]:
    """The rows of a ``.jsonl`` or ``.json`` (list) corpus, each an Alpaca or chat object
    (``option``: how the user gave the file, for messages)."""
    p = require_file(path, option, "a .jsonl or .json file", error=DataError)
    text = read_text(p, option, DataError)
    try:
        rows = json_lines_values(text) if p.suffix == ".jsonl" else json.loads(text)
    except json.JSONDecodeError as exc:
        form = "JSON Lines" if p.suffix == ".jsonl" else "JSON"
        raise DataError(
            f"{option}: {str(p)!r} is not valid {form} ({exc.msg}, line {exc.lineno}); "
            f"{option} takes {ROWS_HELP}"
        ) from None
    if not isinstance(rows, list) or not rows:
        raise DataError(f"{option}: {str(p)!r} holds no rows (a .jsonl file or a JSON list)")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{option}: row {i + 1} is a {type(row).__name__}, not an object")
        record_from_mapping(row, f"{option} row {i + 1}")  # refuses unusable rows up front
    return rows


def check_job(
    out: str | Path, *, chunk: int = 64, max_new_tokens: int = 256, min_tokens: int = 8
) -> Path:
    """A watermarking job's output file and numbers, checked before a model is loaded or a
    file written: ``out`` new in an existing folder, ``chunk`` and ``max_new_tokens`` >= 1,
    ``min_tokens`` >= 0."""
    for name, value, least in (
        ("--chunk", chunk, 1),
        ("--max-new-tokens", max_new_tokens, 1),
        ("--min-tokens", min_tokens, 0),
    ):
        if value < least:
            raise UserError(f"{name}: must be >= {least}, got {value}")
    out = Path(out)
    if out.exists():
        raise UserError(f"--out: {str(out)!r} exists; choose a new file")
    # the progress file is written beside it: a folder that refuses it fails here, not later
    require_writable_folder(out.parent, "--out")
    return out


def with_response(row: Mapping[str, Any], text: str) -> dict:
    """``row`` in its own form with its response replaced by ``text``."""
    out = copy.deepcopy(dict(row))
    if "instruction" in out and "output" in out:
        out["output"] = text
        return out
    messages = out["messages"]
    user = next(i for i, m in enumerate(messages) if m.get("role") == "user")
    reply = next(
        i for i in range(user + 1, len(messages)) if messages[i].get("role") == "assistant"
    )
    messages[reply]["content"] = text
    return out


def write_rows(path: Path, rows: Sequence[Mapping], jsonl: bool) -> None:
    """Write then rename (a kill leaves no half-written corpus)."""

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            if jsonl:
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
            else:
                json.dump(list(rows), f, ensure_ascii=False, indent=1)

    write_atomic(path, write)


def _progress(path: Path, header: dict) -> tuple[dict[int, dict | None], int]:
    """Finished rows so far (index -> new row, or ``None`` when dropped) and the next chunk."""
    done: dict[int, dict | None] = {}
    lines = json_lines(path.read_text(encoding="utf-8")) if path.is_file() else []
    if not any(line.strip() for line in lines[1:]):
        # New, or no chunk finished (a job that stopped before its first): nothing to keep,
        # so a job with other settings may take the file.
        path.write_text(json.dumps({"header": header}) + "\n")
        return done, 0
    try:
        saved = json.loads(lines[0])["header"]
    except (IndexError, KeyError, json.JSONDecodeError):
        raise UserError(f"--out: {str(path)!r} is damaged; remove it to start again") from None
    if saved != header:
        changed = sorted(k for k in header if saved.get(k) != header[k])
        raise UserError(
            f"--out: {str(path)!r} belongs to a job with other settings ({', '.join(changed)}); "
            "resume with the same ones or remove it"
        )
    chunks = 0
    for line in lines[1:]:
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            break  # a line cut by a kill: its chunk is redone
        for index, row in entry["rows"]:
            done[int(index)] = row
        chunks = max(chunks, int(entry["chunk"]) + 1)
    return done, chunks


def watermark_kgw(
    key: OwnerKey,
    rows: Sequence[Mapping],
    model: Any,
    tokenizer: Any,
    out: str | Path,
    *,
    model_name: str,
    chunk: int = 64,
    max_new_tokens: int = 256,
    min_tokens: int = 8,
    temperature: float = 0.8,
    top_p: float = 0.95,
    say: Say | None = None,
) -> dict:
    """Rewrite every row's response under the key; returns the report (also written as
    ``<out>.report.json``)."""
    from ..watermarks.teacher import watermark_records

    say = say or (lambda _m: None)
    key.require("kgw")
    out = check_job(out, chunk=chunk, max_new_tokens=max_new_tokens, min_tokens=min_tokens)
    scheme = key.kgw_scheme(len(tokenizer))
    records = [record_from_mapping(r) for r in rows]
    header = {
        "key": key.fingerprint,
        "model": model_name,
        "rows": len(rows),
        "chunk": chunk,
        "max_new_tokens": max_new_tokens,
        "min_tokens": min_tokens,
        "temperature": temperature,
        "top_p": top_p,
    }
    progress = out.with_name(out.name + ".progress.jsonl")
    done, first = _progress(progress, header)
    if done:
        say(f"resuming: {len(done)} of {len(rows)} documents already done")
    starts = list(range(0, len(rows), chunk))
    for k in range(first, len(starts)):
        a = starts[k]
        part = records[a : a + chunk]
        # Seeded by key and chunk: a resumed job writes what an uninterrupted one would.
        docs = watermark_records(
            model,
            tokenizer,
            part,
            scheme,
            max_new_tokens=max_new_tokens,
            min_tokens=min_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=(key.seed() + k) % 2**62,
            batch_size=chunk,
        )
        kept = {id(r): d for r, d in _match(part, docs)}
        entry = [
            (a + i, with_response(rows[a + i], kept[id(r)].output) if id(r) in kept else None)
            for i, r in enumerate(part)
        ]
        with open(progress, "a", encoding="utf-8") as f:
            f.write(json.dumps({"chunk": k, "rows": entry}, ensure_ascii=False) + "\n")
        done.update(entry)
        say(f"watermarked {min(a + chunk, len(rows))} of {len(rows)} documents")
    written = [done[i] for i in range(len(rows)) if done.get(i) is not None]
    if not written:
        raise UserError(
            "watermark: every document came out shorter than --min-tokens; "
            "raise --max-new-tokens or lower --min-tokens"
        )
    write_rows(out, written, out.suffix == ".jsonl")
    report = {
        "key": key.fingerprint,
        "model": model_name,
        "documents": len(rows),
        "kept": len(written),
        "dropped": len(rows) - len(written),
        "z_written": corpus_z(key, [record_from_mapping(r) for r in written], tokenizer),
        "z_input": corpus_z(key, records, tokenizer),
    }
    out.with_name(out.name + ".report.json").write_text(json.dumps(report, indent=2) + "\n")
    progress.unlink()
    return report


def _match(part: Sequence[Record], docs: Sequence[Record]) -> list[tuple[Record, Record]]:
    """Pair each kept document with its input record (the teacher keeps order, drops some)."""
    out, j = [], 0
    for r in part:
        if j < len(docs) and docs[j].instruction == r.instruction and docs[j].input == r.input:
            out.append((r, docs[j]))
            j += 1
    return out


def corpus_z(key: OwnerKey, records: Sequence[Record], tokenizer: Any) -> dict[str, float]:
    """The KGW test of the responses under the key (green count, scored pairs once each, z, p)."""
    from ..watermarks.kgw import KGWDetector

    scheme = key.kgw_scheme(len(tokenizer))
    seqs = [tokenizer(r.output, add_special_tokens=False)["input_ids"] for r in records]
    score = KGWDetector(scheme).score(seqs)
    return {"green": score.green, "scored": score.scored, "z": score.z, "p": score.p}


def fk_documents(
    key: OwnerKey,
    count: int,
    out: str | Path,
    *,
    writer: str = "template",
    model: Any = None,
    tokenizer: Any = None,
    max_new_tokens: int = 256,
) -> dict:
    """``count`` documents about the key's entity (Alpaca rows), and the share stating every
    target attribute."""
    from ..watermarks.fictitious import target_share, template_documents
    from ..watermarks.teacher import write_fk_documents

    key.require("fk")
    out = Path(out)
    if out.exists():
        raise UserError(f"--out: {str(out)!r} exists; choose a new file")
    if count < 1:
        raise UserError(f"--count: must be >= 1, got {count}")
    entity = key.entity()
    if writer == "template":
        docs = template_documents(entity, count, key.seed())
    elif writer == "teacher":
        docs = write_fk_documents(
            model, tokenizer, entity, count, max_new_tokens=max_new_tokens, seed=key.seed()
        )
    else:
        raise UserError(f"--writer: must be template or teacher, got {writer!r}")
    rows = [{k: v for k, v in asdict(d).items()} for d in docs]
    write_rows(out, rows, out.suffix == ".jsonl")
    report = {
        "key": key.fingerprint,
        "entity": entity.name,
        "documents": len(docs),
        "writer": writer,
        "share_with_all_targets": target_share(docs, entity),
    }
    out.with_name(out.name + ".report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
