"""Sealed envelopes: a message only its recipient can open, carried by a relay that cannot.

The sealed mode on a distributed runtime routes every party's message through the federation's
coordinator (Flower's ServerApp): a client's reading share to each share server, one server's
Beaver opening to the other, every server's result shares to each owner. Each is sealed to the
recipient's X25519 public key: a fresh ephemeral key pair, ``HKDF-SHA256`` of the Diffie-Hellman
secret (bound to both public keys and a context labelling sender, recipient and purpose) and
ChaCha20-Poly1305. The relay learns the length; a changed byte, or an envelope replayed under
another context (another round, another recipient), fails to open.

Without a sender key the sender is a label (a sealed box: anyone holding the recipient's public
key can seal to it). With one (``sender=``, as HPKE's authenticated mode) the key also mixes
the Diffie-Hellman secret of the sender's static key and the recipient's, so the envelope opens
only for a recipient that names that sender: a party that pins every other party's public key
(:class:`~fedattr.secagg.directory.Directory`) takes nothing from a relay posing as a client,
an owner or the other server. See ``docs/explanation/sealed-mode.md``.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from ..errors import UserError, not_writable
from .errors import SecAggError

_SALT = b"fedattr/secagg/envelope/v1"
_AUTH_SALT = b"fedattr/secagg/envelope/v1/auth"
_NONCE = bytes(12)  # every key is used for one message only


def _raw(public: X25519PublicKey) -> bytes:
    return public.public_bytes(Encoding.Raw, PublicFormat.Raw)


def _key(
    secret: bytes, ephemeral: bytes, recipient: bytes, context: bytes, sender: bytes | None
) -> bytes:
    salt, info = _SALT, ephemeral + recipient + context
    if sender is not None:  # the sender's static key is bound too (its own salt: no mode mix-up)
        salt, info = _AUTH_SALT, ephemeral + recipient + sender + context
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=info).derive(secret)


def _public(raw: bytes, what: str, context: str) -> X25519PublicKey:
    if len(raw) != 32:
        raise SecAggError(f"envelope ({context}): a {what} key is 32 bytes, got {len(raw)}")
    return X25519PublicKey.from_public_bytes(raw)


def _exchange(key: X25519PrivateKey, public: X25519PublicKey, context: str) -> bytes:
    try:
        return key.exchange(public)
    except ValueError:  # a low-order point: no shared secret (a forged key)
        raise SecAggError(f"envelope ({context}): a key of low order; refused") from None


def verify(identity: bytes, signature: bytes, message: bytes, what: str) -> None:
    """Check ``signature`` over ``message`` by the signing half of ``identity`` (see
    :attr:`Recipient.identity`); a bad one is refused in one line naming ``what``."""
    try:
        Ed25519PublicKey.from_public_bytes(identity[32:]).verify(signature, message)
    except (InvalidSignature, ValueError):
        raise SecAggError(f"{what}: the signature does not verify under the pinned key") from None


class Recipient:
    """A party's envelope key pair (its public key goes to every sender, through the relay)."""

    def __init__(self, private_key: bytes | None = None) -> None:
        self._key = (
            X25519PrivateKey.generate()
            if private_key is None
            else X25519PrivateKey.from_private_bytes(private_key)
        )
        self.public_key = _raw(self._key.public_key())
        # Its signing key is derived from the same secret: one key file, one identity.
        seed = HKDF(
            algorithm=hashes.SHA256(), length=32, salt=_SALT, info=b"fedattr/identity/sign"
        ).derive(self.private_bytes())
        self._signer = Ed25519PrivateKey.from_private_bytes(seed)
        self.identity = self.public_key + self._signer.public_key().public_bytes(
            Encoding.Raw, PublicFormat.Raw
        )
        """The envelope key and the signing key's public halves (64 bytes): what a directory
        lists for this party."""

    def sign(self, message: bytes) -> bytes:
        """An Ed25519 signature of ``message`` (checked with :func:`verify` and
        :attr:`identity`)."""
        return self._signer.sign(message)

    def private_bytes(self) -> bytes:
        """The raw private key (for the party's own storage only)."""
        return self._key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())

    def save(self, path: str | Path) -> Path:
        """Write the private key to a new file (hex, mode 0600); an existing file is kept."""
        p = Path(path)
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise UserError(f"key file: {str(p)!r} exists; a key is never overwritten") from None
        except OSError as exc:
            raise not_writable(p.parent, "key file", exc) from None
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.private_bytes().hex() + "\n")
        except OSError as exc:  # no half-written key left behind
            p.unlink(missing_ok=True)
            raise not_writable(p.parent, "key file", exc) from None
        os.chmod(p, 0o600)  # whatever the umask
        return p

    @classmethod
    def load(cls, path: str | Path) -> Recipient:
        """A key written by :meth:`save`."""
        p = Path(path)
        try:
            text = p.read_text().strip()
        except OSError as exc:
            raise UserError(f"key-file: cannot read {str(p)!r} ({exc.strerror})") from None
        try:
            raw = bytes.fromhex(text)
        except ValueError:
            raw = b""
        if len(raw) != 32:
            raise UserError(
                f"key-file: {str(p)!r} is not an envelope key (64 hex digits, as "
                "'fedattr flower keygen' writes)"
            )
        return cls(raw)

    def open(self, envelope: bytes, context: str, sender: bytes | None = None) -> bytes:
        """The plaintext of an envelope sealed to this party under ``context`` (and, given
        ``sender``, sealed by the holder of that public key)."""
        if len(envelope) < 32 + 16:
            raise SecAggError(f"envelope ({context}): {len(envelope)} bytes is too short")
        ephemeral, body = envelope[:32], envelope[32:]
        secret = _exchange(self._key, X25519PublicKey.from_public_bytes(ephemeral), context)
        if sender is not None:
            secret += _exchange(self._key, _public(sender, "sender", context), context)
        key = _key(secret, ephemeral, self.public_key, context.encode(), sender)
        try:
            return ChaCha20Poly1305(key).decrypt(_NONCE, body, None)
        except InvalidTag:
            why = (
                "or not by the pinned sender"
                if sender is not None
                else "or by a sender pinning its key: give this party the directory too"
            )
            raise SecAggError(
                f"envelope ({context}): does not open (altered, sealed for another party or "
                f"context, {why})"
            ) from None

    def open_arrays(
        self, envelope: bytes, context: str, sender: bytes | None = None
    ) -> dict[str, np.ndarray]:
        """:meth:`open` of an envelope made by :func:`seal_arrays`."""
        with np.load(io.BytesIO(self.open(envelope, context, sender)), allow_pickle=False) as data:
            return {k: data[k] for k in data.files}


def seal(
    recipient: bytes, plaintext: bytes, context: str, sender: Recipient | None = None
) -> bytes:
    """``plaintext`` sealed to the X25519 public key ``recipient`` under ``context`` (sender,
    recipient and purpose: an envelope opens under its own context only); with ``sender``, also
    bound to the sender's static key (the recipient opens it naming that sender's public key)."""
    ephemeral = X25519PrivateKey.generate()
    public = _raw(ephemeral.public_key())
    theirs = _public(recipient, "recipient", context)
    secret = _exchange(ephemeral, theirs, context)
    if sender is not None:
        secret += _exchange(sender._key, theirs, context)
    key = _key(
        secret, public, recipient, context.encode(), None if sender is None else sender.public_key
    )
    return public + ChaCha20Poly1305(key).encrypt(_NONCE, plaintext, None)


def seal_arrays(
    recipient: bytes,
    arrays: Mapping[str, np.ndarray],
    context: str,
    sender: Recipient | None = None,
) -> bytes:
    """Named numpy arrays (any numeric dtype, no objects) sealed as one envelope."""
    buffer = io.BytesIO()
    named: dict[str, Any] = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    np.savez(buffer, allow_pickle=False, **named)
    return seal(recipient, buffer.getvalue(), context, sender)
