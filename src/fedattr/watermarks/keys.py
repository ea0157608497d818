"""Owner key files: the secret behind a watermark, kept by its owner.

A key file is JSON, readable by its owner only (mode 0600; a file that others can read is
refused), written once (never overwritten). It names the watermark ``kind`` and everything a
detector needs besides the secret: KGW's green fraction ``gamma``, bias ``delta``, context
width and seeding ``scheme`` (``fedattr``: a SHA-256 PRF of the 256-bit secret and the previous
token; ``lm-watermarking`` and ``markllm``: the two reference codes' seedings from an integer
hash key, for corpora watermarked with them), or the Fictitious-Knowledge domain. A KGW key
made for a tokenizer also records its vocabulary size and the tokenizer's fingerprint, so a
test with another tokenizer is refused instead of answering "no watermark" (keys written
before these fields existed load as keys that record none). The **fingerprint** (a hash of
the secret) is public: it names a key without revealing it.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserError, not_writable, require_file, require_writable_folder

FORMAT = "fedattr-owner-key/1"
KINDS = ("kgw", "fk")
KGW_SCHEMES = ("fedattr", "lm-watermarking", "markllm")
MARKLLM_HASH_KEY = 15485863
"""lm-watermarking's and MarkLLM's default hash key (a prime)."""


class KeyFileError(UserError):
    """A key file that cannot be used (missing, unreadable, world-readable, wrong scheme)."""


@dataclass(frozen=True)
class OwnerKey:
    """One owner's watermark secret and the parameters of its scheme."""

    kind: str
    secret: str
    """64 hex digits (256 bits); the reference schemes use :attr:`hash_key` instead."""
    gamma: float = 0.25
    delta: float = 3.0
    context: int = 1
    scheme: str = "fedattr"
    hash_key: int | None = None
    """``lm-watermarking`` / ``markllm`` schemes: the reference code's integer hash key."""
    fk: dict[str, Any] = field(default_factory=dict)
    """``fk``: ``{"domain": index, "decoys": n}`` (the entity is derived from the secret)."""
    vocab_size: int | None = None
    """KGW: the size of the vocabulary the green lists are over, when the key was made for a
    tokenizer (``keygen --model``); ``None`` in keys made without one (and before fedattr
    recorded it)."""
    tokenizer: str | None = None
    """KGW: the fingerprint (:func:`tokenizer_fingerprint`) of that tokenizer, when known."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise KeyFileError(f"key kind: must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if len(self.secret) != 64 or any(c not in "0123456789abcdef" for c in self.secret):
            raise KeyFileError("key secret: must be 64 lowercase hex digits (256 bits)")
        if self.kind == "kgw":
            if self.scheme not in KGW_SCHEMES:
                raise KeyFileError(
                    f"key scheme: must be one of {', '.join(KGW_SCHEMES)}, got {self.scheme!r}"
                )
            if not 0.0 < self.gamma < 1.0 or self.delta < 0:
                raise KeyFileError("key gamma/delta: gamma must be in (0, 1) and delta >= 0")
            if self.context != 1:
                raise KeyFileError(f"key context: only width 1 is supported, got {self.context}")
            if self.vocab_size is not None and self.vocab_size < 2:
                raise KeyFileError(f"key vocab_size: must be >= 2, got {self.vocab_size}")
            if self.scheme != "fedattr" and not (
                isinstance(self.hash_key, int) and 0 < self.hash_key < 2**31
            ):
                raise KeyFileError(
                    f"key hash_key: the {self.scheme} scheme needs an integer in 1..2^31-1"
                )

    @property
    def fingerprint(self) -> str:
        """Public name of the key: 16 hex digits of a hash of the secret and the scheme."""
        material = f"{FORMAT}|{self.kind}|{self.scheme}|{self.hash_key}|{self.secret}"
        digest = hashlib.sha256(material.encode()).hexdigest()[:16]
        return "-".join(digest[i : i + 4] for i in range(0, 16, 4))

    def seed(self) -> int:
        """A 62-bit integer derived from the secret (for schemes that need an integer seed)."""
        return int.from_bytes(hashlib.sha256(bytes.fromhex(self.secret)).digest()[:8], "big") >> 2

    def describe(self, fingerprint: bool = True) -> str:
        """One line: kind, scheme, parameters and (unless told not to) the fingerprint; never
        the secret."""
        tail = f", fingerprint {self.fingerprint}" if fingerprint else ""
        if self.kind == "kgw":
            extra = f" hash_key={self.hash_key}" if self.scheme != "fedattr" else ""
            vocab = ""
            if self.vocab_size is not None:
                vocab = f", vocabulary of {self.vocab_size} tokens"
                vocab += f" (tokenizer {self.tokenizer})" if self.tokenizer else ""
            return (
                f"KGW key ({self.scheme} seeding{extra}, gamma={self.gamma}, delta={self.delta}, "
                f"context {self.context}{vocab}){tail}"
            )
        domain = self.fk.get("domain")
        return f"Fictitious-Knowledge key (domain {domain}){tail}"

    def check_tokenizer(
        self,
        tokenizer: Any,
        what: str,
        fix: str = "give the --model the text was watermarked with",
    ) -> None:
        """Refuse, in one line, a tokenizer (named ``what``: ``--model 'tiny'``) whose
        vocabulary is not the one this key's green lists were made for: counted under another
        vocabulary, a watermark reads as absent (a wrong answer, not an error). A key that
        records no vocabulary accepts any tokenizer. ``fix``: what to do instead."""
        if self.vocab_size is None:
            return
        size = len(tokenizer)
        if size != self.vocab_size:
            raise UserError(
                f"{what}: its tokenizer has {size} tokens, but this key's green lists are over "
                f"a vocabulary of {self.vocab_size}: {fix}"
            )
        if self.tokenizer is not None:
            seen = tokenizer_fingerprint(tokenizer)
            if seen != self.tokenizer:
                raise UserError(
                    f"{what}: its tokenizer (fingerprint {seen}) is not the one this key was "
                    f"made for ({self.tokenizer}), though both have {size} tokens: {fix}"
                )

    def kgw_scheme(self, vocab_size: int):
        """The green lists of this key over a ``vocab_size`` vocabulary."""
        from .kgw import SCHEMES

        self.require("kgw")
        key = int(self.secret, 16) if self.scheme == "fedattr" else self.hash_key
        return SCHEMES[self.scheme](key, vocab_size, self.gamma, self.delta)

    def entity(self):
        """The fabricated entity this key stands for (Fictitious Knowledge)."""
        from .fictitious import make_entities

        self.require("fk")
        domain = int(self.fk.get("domain", 0))
        return make_entities(domain + 1, self.seed(), decoys=int(self.fk.get("decoys", 31)))[domain]

    def require(self, kind: str, option: str = "--key") -> None:
        """Refuse a key made for another kind of watermark (``option``: how it was given)."""
        if self.kind != kind:
            raise KeyFileError(f"{option}: this is a {self.kind} key; this step needs a {kind} key")

    def to_json(self) -> str:
        """The key file's content."""
        data = asdict(self)
        for name in ("vocab_size", "tokenizer"):  # unrecorded: left out, as keys before them
            if data[name] is None:
                del data[name]
        return json.dumps({"format": FORMAT, **data}, indent=2) + "\n"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A public name of a tokenizer's vocabulary: 16 hex digits of a hash of every token and
    its id (two tokenizers with the same fingerprint give the same ids)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]
    return "-".join(digest[i : i + 4] for i in range(0, 16, 4))


def generate_key(kind: str = "kgw", **params: Any) -> OwnerKey:
    """A fresh key (256 bits from the OS CSPRNG) with ``params`` (gamma, delta, scheme, ...).

    A reference scheme's hash key is the reference default unless ``hash_key`` is given (a
    corpus watermarked with the reference code carries that key)."""
    if kind == "fk":
        from .fictitious import DOMAINS

        domain = params.pop("domain", None)
        if domain is None:
            domain = secrets.randbelow(len(DOMAINS))
        if not 0 <= int(domain) < len(DOMAINS):
            raise KeyFileError(f"--domain: must be in 0..{len(DOMAINS) - 1}, got {domain}")
        params["fk"] = {"domain": int(domain), "decoys": int(params.pop("decoys", 31))}
    elif params.get("scheme", "fedattr") != "fedattr" and params.get("hash_key") is None:
        params["hash_key"] = MARKLLM_HASH_KEY
    return OwnerKey(kind, secrets.token_hex(32), **params)


def save_key(key: OwnerKey, path: str | Path) -> Path:
    """Write ``key`` to a new file readable by its owner only; an existing file is refused."""
    p = Path(path)
    if p.exists():
        raise KeyFileError(f"--out: {str(p)!r} exists; a key file is never overwritten")
    require_writable_folder(p.parent, "--out")
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise not_writable(p.parent, "--out", exc) from None
    with os.fdopen(fd, "w") as f:
        f.write(key.to_json())
    os.chmod(p, 0o600)  # whatever the umask
    return p


_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "kind": ((str,), "a string"),
    "secret": ((str,), "a string"),
    "gamma": ((int, float), "a number"),
    "delta": ((int, float), "a number"),
    "context": ((int,), "an integer"),
    "scheme": ((str,), "a string"),
    "hash_key": ((int, type(None)), "an integer or null"),
    "fk": ((dict,), "an object"),
    "vocab_size": ((int, type(None)), "an integer or null"),
    "tokenizer": ((str, type(None)), "a string or null"),
}
"""The fields of a key file (besides ``format``): the JSON types each may hold, in words."""


def load_key(path: str | Path, kind: str | None = None, option: str = "--key") -> OwnerKey:
    """Read a key file; refuse a missing, damaged, foreign or world-readable one, or one made
    for another kind than ``kind``. ``option``: how the user named the file (``--key``,
    ``watermark.kgw.key_files``), for messages."""
    p = require_file(
        path, option, "a key file", "make one with fedattr owner keygen", error=KeyFileError
    )
    where = f"{option}: {str(p)!r}"
    mode = stat.S_IMODE(p.stat().st_mode)
    if mode & 0o077:
        raise KeyFileError(
            f"{where} can be read by other users (mode {mode:04o}); a watermark key "
            f"is a secret: chmod 600 {p}"
        )
    try:
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise KeyFileError(f"{where} is not a fedattr key file ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise KeyFileError(f"{where} is not a fedattr key file (format {FORMAT})")
    fields = {k: v for k, v in data.items() if k != "format"}
    missing = [k for k in ("kind", "secret") if k not in fields]
    unknown = sorted(set(fields) - set(_FIELDS))
    if missing or unknown:
        what = f"missing field {missing[0]!r}" if missing else f"unknown field {unknown[0]!r}"
        raise KeyFileError(f"{where} is damaged: {what} (fields: {', '.join(_FIELDS)})")
    for k, v in fields.items():
        types, wanted = _FIELDS[k]
        if not isinstance(v, types) or isinstance(v, bool):
            raise KeyFileError(f"{where} is damaged: field {k!r} must be {wanted}, got {v!r}")
    try:
        key = OwnerKey(**fields)
    except KeyFileError as exc:
        raise KeyFileError(f"{where} is damaged: {exc}") from None
    if kind is not None:
        key.require(kind, option)
    return key
