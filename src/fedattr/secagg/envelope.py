"""Sealed envelopes: a message only its recipient can open, carried by a relay that cannot.

The sealed mode on a distributed runtime routes every party's message through the federation's
coordinator (Flower's ServerApp): a client's reading share to each share server, one server's
Beaver opening to the other, every server's result shares to each owner. Each is sealed to the
recipient's X25519 public key: a fresh ephemeral key pair, ``HKDF-SHA256`` of the Diffie-Hellman
secret (bound to both public keys and a context labelling sender, recipient and purpose) and
ChaCha20-Poly1305. The relay learns the length; a changed byte, or an envelope replayed under
another context (another round, another recipient), fails to open. The sender is a label, not
authenticated (a sealed box: anyone holding the recipient's public key can seal to it), and the
recipient's key is what the relay handed out: the relay is trusted to hand out the parties'
keys honestly (honest but curious; see ``docs/explanation/sealed-mode.md``).
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from .errors import SecAggError

_SALT = b"fedattr/secagg/envelope/v1"
_NONCE = bytes(12)  # every key is used for one message only


def _raw(public: X25519PublicKey) -> bytes:
    return public.public_bytes(Encoding.Raw, PublicFormat.Raw)


def _key(secret: bytes, ephemeral: bytes, recipient: bytes, context: bytes) -> bytes:
    return HKDF(
        algorithm=hashes.SHA256(), length=32, salt=_SALT, info=ephemeral + recipient + context
    ).derive(secret)


class Recipient:
    """A party's envelope key pair (its public key goes to every sender, through the relay)."""

    def __init__(self, private_key: bytes | None = None) -> None:
        self._key = (
            X25519PrivateKey.generate()
            if private_key is None
            else X25519PrivateKey.from_private_bytes(private_key)
        )
        self.public_key = _raw(self._key.public_key())

    def private_bytes(self) -> bytes:
        """The raw private key (for the party's own storage only)."""
        from cryptography.hazmat.primitives.serialization import NoEncryption, PrivateFormat

        return self._key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())

    def open(self, envelope: bytes, context: str) -> bytes:
        """The plaintext of an envelope sealed to this party under ``context``."""
        if len(envelope) < 32 + 16:
            raise SecAggError(f"envelope ({context}): {len(envelope)} bytes is too short")
        ephemeral, body = envelope[:32], envelope[32:]
        secret = self._key.exchange(X25519PublicKey.from_public_bytes(ephemeral))
        key = _key(secret, ephemeral, self.public_key, context.encode())
        try:
            return ChaCha20Poly1305(key).decrypt(_NONCE, body, None)
        except InvalidTag:
            raise SecAggError(
                f"envelope ({context}): does not open (altered, or sealed for another party "
                "or context)"
            ) from None

    def open_arrays(self, envelope: bytes, context: str) -> dict[str, np.ndarray]:
        """:meth:`open` of an envelope made by :func:`seal_arrays`."""
        with np.load(io.BytesIO(self.open(envelope, context)), allow_pickle=False) as data:
            return {k: data[k] for k in data.files}


def seal(recipient: bytes, plaintext: bytes, context: str) -> bytes:
    """``plaintext`` sealed to the X25519 public key ``recipient`` under ``context`` (sender,
    recipient and purpose: an envelope opens under its own context only)."""
    if len(recipient) != 32:
        raise SecAggError(
            f"envelope ({context}): a recipient key is 32 bytes, got {len(recipient)}"
        )
    ephemeral = X25519PrivateKey.generate()
    public = _raw(ephemeral.public_key())
    secret = ephemeral.exchange(X25519PublicKey.from_public_bytes(recipient))
    key = _key(secret, public, recipient, context.encode())
    return public + ChaCha20Poly1305(key).encrypt(_NONCE, plaintext, None)


def seal_arrays(recipient: bytes, arrays: Mapping[str, np.ndarray], context: str) -> bytes:
    """Named numpy arrays (any numeric dtype, no objects) sealed as one envelope."""
    buffer = io.BytesIO()
    named: dict[str, Any] = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    np.savez(buffer, allow_pickle=False, **named)
    return seal(recipient, buffer.getvalue(), context)
