"""The deployment's directory: every sealed-mode party's public envelope key and the run's
configuration, provisioned to each party out of band.

The coordinator of a distributed run relays every message, so it also hands each party the
others' public keys and the run's settings. A coordinator that lied about them could have a
client seal both shares to itself, pose as an owner, or lower the masks' scale. A party given a
directory (``--node-config "directory='deployment.json' key-file='me.key'"``) takes none of it
from the coordinator: it checks its own key, the run's configuration (a digest) and every key it
is handed against the directory, and it opens an envelope only from the sender the directory
names (authenticated envelopes, :mod:`fedattr.secagg.envelope`), so a coordinator posing as
clients cannot fill a round with shares of its own; each client signs its secure-aggregation key
of a round, and a client answers a subset-sum query only when every member's key carries its
pinned signature. A random ``nonce`` names the run: every envelope context and signature carries
it, so nothing of another run (the same keys in another directory) opens or verifies. It plays
the part of a DAP task's parameters, provisioned to both aggregators before any report.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UserError
from .errors import QueryRefused

SERVERS = ("A", "B")


def run_digest(text: str) -> str:
    """SHA-256 of a run's configuration (its JSON, keys sorted: the same settings, one digest)."""
    canonical = json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


IDENTITY_BYTES = 64
"""A party's public identity: its envelope (X25519) and signing (Ed25519) public keys."""


def _key(raw: Any, where: str) -> bytes:
    try:
        key = bytes.fromhex(str(raw))
    except ValueError:
        key = b""
    if len(key) != IDENTITY_BYTES:
        raise UserError(
            f"directory: {where} must be a party's public identity, {2 * IDENTITY_BYTES} hex "
            f"digits as 'fedattr flower keygen' prints it; got {raw!r}"
        )
    return key


@dataclass(frozen=True)
class Directory:
    """Public identities by party (servers ``A``/``B``; owners by index, as an owner node's
    ``owner=`` setting numbers them: their names in sorted order; clients by id), the digest of
    the run's configuration and the run's nonce."""

    servers: Mapping[str, bytes]
    owners: Mapping[int, bytes]
    clients: Mapping[int, bytes]
    run: str
    nonce: str

    def __post_init__(self) -> None:
        if sorted(self.servers) != list(SERVERS):
            raise UserError(f"directory: servers must be A and B, got {sorted(self.servers)}")
        keys = [*self.servers.values(), *self.owners.values(), *self.clients.values()]
        if len(set(keys)) != len(keys):
            raise UserError("directory: a public key is listed for two parties; each has its own")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Directory:
        """The directory from its JSON form (:meth:`to_dict`)."""
        unknown = sorted(set(d) - {"servers", "owners", "clients", "run", "nonce"})
        if unknown:
            raise UserError(
                f"directory: unknown field(s) {unknown}; allowed: servers, owners, clients, "
                "run, nonce"
            )
        try:
            run, nonce = str(d["run"]), str(d["nonce"])
            if len(nonce) < 32 or any(ch not in "0123456789abcdef" for ch in nonce):
                raise UserError(f"directory: nonce must be 32+ hex digits, got {nonce!r}")
            return cls(
                {s: _key(k, f"servers.{s}") for s, k in dict(d["servers"]).items()},
                {int(o): _key(k, f"owners.{o}") for o, k in dict(d.get("owners", {})).items()},
                {int(c): _key(k, f"clients.{c}") for c, k in dict(d["clients"]).items()},
                run,
                nonce,
            )
        except KeyError as exc:
            raise UserError(f"directory: missing field {exc.args[0]!r}") from None
        except UserError:
            raise
        except (TypeError, ValueError) as exc:
            raise UserError(f"directory: malformed ({exc})") from None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form every party reads."""
        return {
            "run": self.run,
            "nonce": self.nonce,
            "servers": {s: k.hex() for s, k in sorted(self.servers.items())},
            "owners": {str(o): k.hex() for o, k in sorted(self.owners.items())},
            "clients": {str(c): k.hex() for c, k in sorted(self.clients.items())},
        }

    @classmethod
    def new(
        cls,
        servers: Mapping[str, bytes],
        owners: Mapping[int, bytes],
        clients: Mapping[int, bytes],
        run: str,
    ) -> Directory:
        """A directory for one run: a fresh random nonce names it."""
        return cls(dict(servers), dict(owners), dict(clients), run, secrets.token_hex(16))

    @classmethod
    def load(cls, path: str | Path) -> Directory:
        """Read a directory file (``directory`` in a node's configuration)."""
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except OSError as exc:
            raise UserError(f"directory: cannot read {str(p)!r} ({exc.strerror})") from None
        except json.JSONDecodeError as exc:
            raise UserError(f"directory: {str(p)!r} is not JSON ({exc.msg})") from None
        return cls.from_dict(data)

    def save(self, path: str | Path) -> Path:
        """Write the directory (JSON) to ``path``."""
        p = Path(path)
        p.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return p

    # -- the checks a party makes --------------------------------------------------------

    def check_run(self, text: str, who: str) -> None:
        """Refuse a configuration other than the pinned run's."""
        try:
            digest = run_digest(text)
        except json.JSONDecodeError:
            raise QueryRefused(
                f"{who} refused: the coordinator's configuration is not JSON"
            ) from None
        if digest != self.run:
            raise QueryRefused(
                f"{who} refused: the coordinator's configuration (sha256 {digest[:16]}...) is "
                f"not the run its directory pins ({self.run[:16]}...)"
            )

    def server(self, label: str) -> bytes:
        """Share server ``label``'s envelope key."""
        return self.servers[label][:32]

    def owner(self, index: int, who: str) -> bytes:
        """Owner ``index``'s envelope key; an owner the directory does not list is refused."""
        return self.owner_identity(index, who)[:32]

    def owner_identity(self, index: int, who: str) -> bytes:
        """Owner ``index``'s whole identity."""
        if index not in self.owners:
            raise QueryRefused(
                f"{who} refused: owner {index} is not in its directory "
                f"({sorted(self.owners) or 'no owners'})"
            )
        return self.owners[index]

    def client(self, client: int, who: str) -> bytes:
        """Client ``client``'s envelope key; a client the directory does not list is refused."""
        return self.client_identity(client, who)[:32]

    def client_identity(self, client: int, who: str) -> bytes:
        """Client ``client``'s whole identity (its signing key too)."""
        if client not in self.clients:
            raise QueryRefused(f"{who} refused: client {client} is not in its directory")
        return self.clients[client]

    def context(self, context: str) -> str:
        """An envelope context bound to this run (its nonce)."""
        return f"{context}/run={self.nonce}"

    def key_message(self, round_id: int, client: int, public_key: bytes, agreed: str = "") -> bytes:
        """What client ``client`` signs for its secure-aggregation key of ``round_id``;
        ``agreed``: a digest of what it trained from (the global state and the round's
        participants), so that members who trained from different states cannot sum."""
        head = f"fedattr/sa-key/v2/run={self.nonce}/round={round_id}/client={client}/"
        return f"{head}agreed={agreed}/".encode() + bytes(public_key)

    def size_message(self, client: int, size: int) -> bytes:
        """What client ``client`` signs for its data size (its FedAvg weight) in this run."""
        return f"fedattr/data-size/v1/run={self.nonce}/client={client}/size={int(size)}".encode()

    def expect(self, given: bytes, pinned: bytes, what: str, who: str) -> None:
        """Refuse a key handed by the coordinator that is not the pinned one."""
        if bytes(given) != pinned:
            raise QueryRefused(
                f"{who} refused: the coordinator gave {what} the key {bytes(given).hex()[:16]}...; "
                f"its directory pins {pinned.hex()[:16]}..."
            )
