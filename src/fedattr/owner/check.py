"""Is this text watermarked under my key? The owner's text-level KGW test, with exact p-values.

A corpus owner checks that its corpus came out of ``owner watermark`` carrying its key, or
whether a leaked document carries it. Each text is tokenized with the tokenizer the corpus was
watermarked with (the green lists are over its ``V`` tokens) and every ``(previous token,
token)`` pair is coloured by the key's own :class:`~fedattr.watermarks.kgw.KGWScheme` through
:class:`~fedattr.watermarks.kgw.KGWDetector`, whatever the key's seeding scheme.

**The test.** A pair's colour is a deterministic function of the pair, so a repeated pair is
one trial seen twice: pairs are deduplicated (each distinct pair scored once; per document
within the document, for the whole input over all its documents), as Sander et al. do for
radioactivity ("Watermarking makes language models radioactive", 2024). Under a key
independent of the text, each scored pair is green with probability ``q = m / V`` (``m``
green tokens per list: ``gamma V`` rounded by fedattr's scheme, truncated by the references';
``q = gamma`` whenever ``gamma V`` is an integer), so the green count ``G`` of ``n`` pairs is
``Binomial(n, q)`` and ``p = P(G' >= G)`` is computed exactly (``scipy.stats.binom.logsf``:
``log10_p`` stays finite far below 1e-300). ``z = (G - gamma n) / sqrt(n gamma (1 - gamma))``
is the references' statistic (equal to lm-watermarking's and MarkLLM's z with the same
deduplication).

**Where the binomial is approximate.** A green list has exactly ``m`` tokens, so the ``k``
distinct pairs sharing a previous token are ``k`` draws *without* replacement from one list:
their green count is ``Hypergeometric(V, m, k)``, not ``Binomial(k, q)`` (same mean, variance
smaller by ``(V - k) / (V - 1)``). Contexts are independent, so the exact null of ``G`` is the
sum of one hypergeometric count per context; :func:`fixed_lists_log10_sf` computes its tail
(``log10_p_fixed_lists``) by convolution, exponentially tilted at the observed count so it
stays finite where ``p`` underflows. The binomial is **conservative** where it matters: in the
upper tail (``p`` below about 0.1, where a watermark shows) its p-value is larger than the
exact one, the more so the more pairs share a context (the binomial's tail is heavier); just
above the mean, where ``p`` is 0.1 to 0.5, it can be smaller by ``O(k / V)``, which decides
nothing. Without deduplication (``dedupe=False``, to compare with detectors that score every
token) the binomial is anti-conservative on repetitive text and no exact tail is given.
"""

from __future__ import annotations

import functools
import json
import math
import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import reduce
from pathlib import Path
from typing import Any, TextIO

import numpy as np
from scipy.optimize import brentq
from scipy.signal import fftconvolve
from scipy.special import logsumexp
from scipy.stats import binom, hypergeom

from ..data.loaders import json_lines_values
from ..errors import UserError
from ..watermarks.keys import OwnerKey
from ..watermarks.kgw import KGWDetector

LN10 = math.log(10.0)
ROW_SUFFIXES = (".jsonl", ".json")
IN_HELP = "a .txt file (one document), .jsonl/.json rows (Alpaca or chat), or - for stdin"


@dataclass(frozen=True)
class Document:
    """One document to check: its name and the texts scored (a chat row: one per turn)."""

    name: str
    texts: tuple[str, ...]


@dataclass(frozen=True)
class TextScore:
    """The KGW test of one document, or of the whole input."""

    name: str
    green: int
    """Green pairs among the scored ones."""
    scored: int
    """Pairs scored (distinct pairs, unless deduplication is off)."""
    pairs: int
    """All (previous token, token) pairs of the text, repeats included."""
    z: float
    p: float
    """Exact binomial tail ``P(Binomial(scored, m / V) >= green)`` (0.0 where it underflows)."""
    log10_p: float
    log10_p_fixed_lists: float | None
    """The exact tail under fixed-size green lists (``None`` without deduplication)."""


@dataclass(frozen=True)
class CheckReport:
    """``owner check``'s answer: the key, the tokenizer, every document and the total."""

    key: str
    """The key's public fingerprint."""
    scheme: str
    gamma: float
    green_size: int
    vocab_size: int
    tokenizer: str
    source: str
    field: str | None
    """``--field`` (``None``: Alpaca rows' ``output``, chat rows' assistant turns)."""
    dedupe: bool
    documents: list[TextScore]
    total: TextScore

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (``log10`` values stay finite; ``p`` may be 0.0)."""
        return asdict(self)


def fixed_lists_log10_sf(green: int, context_sizes: Sequence[int], vocab: int, m: int) -> float:
    """``log10 P(S >= green)``, ``S`` the sum of independent ``Hypergeometric(vocab, m, k)``
    counts, one per context with ``k`` distinct scored tokens: the exact null of a deduplicated
    green count when every green list holds ``m`` of the ``vocab`` tokens.

    Computed by convolution of the per-context laws, each exponentially tilted so the tilted
    sum's mean is ``green`` (the terms that make the tail are then of order one, however small
    the tail: no underflow), then untilted in log space."""
    groups = Counter(int(k) for k in context_sizes if k > 0)
    ks = sorted(groups)
    counts = np.array([groups[k] for k in ks], dtype=float)
    tops = np.array([min(k, m) for k in ks])
    most = int(counts @ tops)
    if green <= 0:
        return 0.0
    if green > most:
        return -math.inf
    # one row per context size: its log pmf, -inf beyond its top
    x = np.arange(int(tops.max()) + 1)
    logpmf = np.full((len(ks), len(x)), -np.inf)
    for i, k in enumerate(ks):
        logpmf[i, : tops[i] + 1] = _hypergeom_logpmf(vocab, m, k)
    if green == most:  # every context at its top: one term
        return float(counts @ logpmf[np.arange(len(ks)), tops]) / LN10

    def tilt(theta: float) -> tuple[np.ndarray, np.ndarray]:
        """Each size's tilted law (rows) and log normaliser."""
        lt = logpmf + theta * x
        top = lt.max(axis=1, keepdims=True)
        w = np.exp(lt - top)
        z = w.sum(axis=1, keepdims=True)
        return w / z, (top + np.log(z))[:, 0]

    def excess(theta: float) -> float:
        return float(counts @ (tilt(theta)[0] @ x)) - green

    theta = 0.0
    if excess(0.0) < 0:
        hi = 1.0
        while excess(hi) < 0:
            hi *= 2.0
        theta = brentq(excess, 0.0, hi, xtol=1e-10)
    laws, log_z = tilt(theta)
    parts = [_power(laws[i, : tops[i] + 1], int(c)) for i, c in enumerate(counts)]
    dist = reduce(_convolve, sorted(parts, key=len))
    tail = dist[green : most + 1]
    with np.errstate(divide="ignore"):
        terms = np.log(tail) - theta * np.arange(green, green + len(tail))
    return float(min(0.0, (logsumexp(terms) + counts @ log_z) / LN10))


@functools.lru_cache(maxsize=4096)
def _hypergeom_logpmf(vocab: int, m: int, k: int) -> np.ndarray:
    """``log P(X = 0..min(k, m))``, ``X ~ Hypergeometric(vocab, m, k)`` (kept: documents of
    one corpus share their context sizes)."""
    out = hypergeom.logpmf(np.arange(min(k, m) + 1), vocab, m, k)
    out.flags.writeable = False
    return out


def _convolve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if min(len(a), len(b)) < 32:
        return np.convolve(a, b)
    return np.clip(fftconvolve(a, b), 0.0, None)


def _power(q: np.ndarray, c: int) -> np.ndarray:
    """The law of the sum of ``c`` independent copies (binary powering)."""
    out, base = np.ones(1), q
    while c:
        if c & 1:
            out = _convolve(out, base)
        c >>= 1
        if c:
            base = _convolve(base, base)
    return out


def binomial_log10_sf(green: int, scored: int, q: float) -> float:
    """``log10 P(Binomial(scored, q) >= green)``, finite far below 1e-300: ``binom.logsf``
    (the log of ``binom.sf``, which underflows below about 1e-308), and below 1e-260 the
    log-sum of the upper terms' ``binom.logpmf``."""
    if green <= 0:
        return 0.0
    if green > scored:
        return -math.inf
    log_sf = float(binom.logsf(green - 1, scored, q))
    if log_sf > -600.0:
        return log_sf / LN10
    return float(logsumexp(binom.logpmf(np.arange(green, scored + 1), scored, q))) / LN10


def score_document(
    detector: KGWDetector, name: str, sequences: Sequence[Sequence[int]]
) -> TextScore:
    """The test of the pairs in ``sequences`` (one document, or all of them)."""
    scheme = detector.scheme
    pairs = detector.scored_pairs(sequences)
    score = detector.score_pairs(pairs)
    log10_p = binomial_log10_sf(score.green, score.scored, scheme.green_size / scheme.vocab_size)
    fixed = None
    if detector.dedupe:
        sizes = Counter(prev for prev, _ in pairs).values()
        fixed = fixed_lists_log10_sf(score.green, list(sizes), scheme.vocab_size, scheme.green_size)
    return TextScore(
        name,
        score.green,
        score.scored,
        sum(max(0, len(s) - 1) for s in sequences),
        score.z,
        10.0**log10_p if log10_p > -300 else 0.0,
        log10_p,
        fixed,
    )


def check_documents(
    key: OwnerKey,
    tokenizer: Any,
    documents: Sequence[Document],
    *,
    dedupe: bool = True,
    tokenizer_name: str = "",
    source: str = "",
    field: str | None = None,
) -> CheckReport:
    """Test every document, and all of them together, for ``key`` (a KGW key of any seeding
    scheme) with ``tokenizer`` (the one the corpus was watermarked with)."""
    key.require("kgw")
    scheme = key.kgw_scheme(len(tokenizer))
    detector = KGWDetector(scheme, dedupe=dedupe)
    flat = [t for d in documents for t in d.texts]
    ids = list(tokenizer(flat, add_special_tokens=False)["input_ids"]) if flat else []
    per_doc, at = [], 0
    for d in documents:
        per_doc.append(ids[at : at + len(d.texts)])
        at += len(d.texts)
    scores = [score_document(detector, d.name, s) for d, s in zip(documents, per_doc, strict=True)]
    name = f"all {len(documents)} documents" if len(documents) != 1 else "the document"
    total = score_document(detector, name, [s for doc in per_doc for s in doc])
    return CheckReport(
        key.fingerprint,
        key.scheme,
        key.gamma,
        scheme.green_size,
        scheme.vocab_size,
        tokenizer_name,
        source,
        field,
        dedupe,
        scores,
        total,
    )


def read_documents(
    path: str, field: str | None = None, stdin: TextIO | None = None
) -> list[Document]:
    """The documents of ``path`` (``--in``): a ``.jsonl``/``.json`` file of Alpaca rows (the
    ``field`` scored, default ``output``) or chat rows (the turns of role ``field``, default
    ``assistant``, one text each); any other file is one plain-text document; ``-`` reads
    standard input, as rows when it parses as JSON rows, else as one text."""
    if path == "-":
        text, name = _read_stdin(stdin or sys.stdin), "<stdin>"
        if not text.strip():
            raise UserError(f"--in: {name} is empty: no text to check ({IN_HELP})")
        start = text.lstrip()[:1]
        if start in ("{", "["):
            try:
                rows = _parse_rows(text, jsonl=start == "{", name=name)
            except UserError:
                rows = None  # not JSON rows: a plain text that starts with a bracket
            if rows is not None:
                return _row_documents(rows, field)
        return [Document(name, (text,))]
    p = Path(path)
    if p.is_dir():
        raise UserError(f"--in: {path!r} is a folder; give a file ({IN_HELP})")
    if not p.is_file():
        raise UserError(f"--in: {path!r} does not exist ({IN_HELP})")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(
            f"--in: {path!r} is not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None
    if not text.strip():
        raise UserError(f"--in: {path!r} is empty: no text to check ({IN_HELP})")
    if p.suffix in ROW_SUFFIXES:
        return _row_documents(_parse_rows(text, p.suffix == ".jsonl", repr(path)), field)
    if field is not None:
        raise UserError(f"--field: for .jsonl/.json rows only; {path!r} is one plain text")
    return [Document(p.name, (text,))]


def _read_stdin(stdin: TextIO) -> str:
    """Standard input's text, decoded strictly as UTF-8 as a file given by path is, else one
    line naming ``--in``. (Under a C or POSIX locale, or in UTF-8 mode, Python's own standard
    input hands bytes that are not UTF-8 on as lone surrogates (``surrogateescape``), on which
    a tokenizer then fails.) A stream without bytes beneath it (a test's ``StringIO``) is read
    as text."""
    buffer = getattr(stdin, "buffer", None)
    if buffer is None:
        return stdin.read()
    try:
        return buffer.read().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(
            f"--in: <stdin> is not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None


def _parse_rows(text: str, jsonl: bool, name: str) -> list:
    try:
        rows = json_lines_values(text) if jsonl else json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(
            f"--in: {name} is not valid JSON{' Lines' if jsonl else ''} "
            f"({exc.msg}, line {exc.lineno})"
        ) from None
    if not isinstance(rows, list) or not rows:
        raise UserError(
            f"--in: {name} holds no rows (JSON Lines, or a JSON list of Alpaca or chat objects)"
        )
    return rows


def _row_documents(rows: list, field: str | None) -> list[Document]:
    docs = []
    for i, row in enumerate(rows, start=1):
        docs.append(Document(f"row {i}", tuple(_row_texts(row, field, i))))
    if not any(d.texts for d in docs):
        raise UserError(
            f"--field: no row has a {field or 'output'!r} field or "
            f"{field or 'assistant'!r} turns (Alpaca rows: instruction, input or "
            "output; chat rows: a role such as assistant or user)"
        )
    return docs


def _row_texts(row: Any, field: str | None, i: int) -> list[str]:
    if not isinstance(row, Mapping):
        raise UserError(f"--in: row {i} is a {type(row).__name__}, not an Alpaca or chat object")
    name = field or "output"
    if name in row:
        value = row[name]
        if not isinstance(value, str):
            raise UserError(f"--field: row {i}'s {name!r} is a {type(value).__name__}, not text")
        return [value]
    messages = row.get("messages")
    if isinstance(messages, list):
        role = field or "assistant"
        texts = []
        for turn in messages:
            if isinstance(turn, Mapping) and turn.get("role") == role:
                content = turn.get("content")
                if not isinstance(content, str):
                    raise UserError(f"--in: row {i}: a {role!r} turn's content is not text")
                texts.append(content)
        return texts
    if "instruction" in row and "output" in row:
        return []  # an Alpaca row without this field (``input`` is optional)
    raise UserError(
        f"--in: row {i} has no {name!r} field and no chat 'messages' (Alpaca rows: "
        "--field instruction|input|output, default output; chat rows: --field "
        "ROLE, default assistant)"
    )


def watermark_report_model(path: str, key: OwnerKey) -> str | None:
    """The ``--model`` that ``owner watermark`` recorded in ``<path>.report.json`` with this
    key, if any: the tokenizer ``path`` was watermarked with."""
    if path == "-":
        return None
    report = Path(path + ".report.json")
    try:
        data = json.loads(report.read_text())
    except (OSError, ValueError):
        return None
    if isinstance(data, dict) and data.get("key") == key.fingerprint:
        model = data.get("model")
        return model if isinstance(model, str) and model else None
    return None


def format_report(report: CheckReport, say: Callable[[str], None]) -> None:
    """The human-readable answer, one line per document then the total."""
    say(
        f"key {report.key} ({report.scheme} seeding, gamma {report.gamma}): green lists of "
        f"{report.green_size} of {report.vocab_size} tokens; tokenizer {report.tokenizer}"
    )
    width = max([len(d.name) for d in report.documents] + [8])
    say(
        f"{'document':<{width}}  {'green':>6}  {'scored':>6}  {'pairs':>6}  {'z':>7}  "
        f"{'log10 p':>8}"
    )
    for d in report.documents:
        say(
            f"{d.name:<{width}}  {d.green:>6}  {d.scored:>6}  {d.pairs:>6}  {d.z:>+7.2f}  "
            f"{d.log10_p:>8.2f}"
        )
    t = report.total
    how = (
        "distinct pairs, over all documents"
        if report.dedupe
        else "every pair: repeats counted, p anti-conservative"
    )
    line = (
        f"{t.name} ({how}): {t.green} green of {t.scored} scored: z = {t.z:+.2f}, "
        f"p = {t.p:.3g} (log10 p = {t.log10_p:.2f}"
    )
    if t.log10_p_fixed_lists is not None:
        line += f"; exact under fixed-size green lists: {t.log10_p_fixed_lists:.2f}"
    say(line + ")")
