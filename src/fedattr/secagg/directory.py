"""The deployment's directory: every sealed-mode party's public envelope key and the run's
configuration, provisioned to each party out of band.

The coordinator of a distributed run relays every message, so it also hands each party the
others' public keys and the run's settings. A coordinator that lied about them could have a
client seal both shares to itself, pose as an owner, or lower the masks' scale. A party given a
directory (``--node-config "directory='deployment.json' key-file='me.key'"``) takes none of it
from the coordinator: it checks its own key, the run's configuration (a digest) and every key it
is handed against the directory, and it opens an envelope only from the sender the directory
names (authenticated envelopes, :mod:`fedattr.secagg.envelope`), so a coordinator posing as
clients cannot fill a round with shares of its own. It plays the part of a DAP task's
parameters, provisioned to both aggregators before any report.
"""

from __future__ import annotations

import hashlib
import json
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


def _key(raw: Any, where: str) -> bytes:
    try:
        key = bytes.fromhex(str(raw))
    except ValueError:
        key = b""
    if len(key) != 32:
        raise UserError(f"directory: {where} must be a public key of 64 hex digits, got {raw!r}")
    return key


@dataclass(frozen=True)
class Directory:
    """Public keys by party (servers ``A``/``B``; owners by index, as an owner node's
    ``owner=`` setting numbers them: their names in sorted order; clients by id) and the digest
    of the run's configuration."""

    servers: Mapping[str, bytes]
    owners: Mapping[int, bytes]
    clients: Mapping[int, bytes]
    run: str

    def __post_init__(self) -> None:
        if sorted(self.servers) != list(SERVERS):
            raise UserError(f"directory: servers must be A and B, got {sorted(self.servers)}")
        keys = [*self.servers.values(), *self.owners.values(), *self.clients.values()]
        if len(set(keys)) != len(keys):
            raise UserError("directory: a public key is listed for two parties; each has its own")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Directory:
        """The directory from its JSON form (:meth:`to_dict`)."""
        unknown = sorted(set(d) - {"servers", "owners", "clients", "run"})
        if unknown:
            raise UserError(
                f"directory: unknown field(s) {unknown}; allowed: servers, owners, clients, run"
            )
        try:
            run = str(d["run"])
            return cls(
                {s: _key(k, f"servers.{s}") for s, k in dict(d["servers"]).items()},
                {int(o): _key(k, f"owners.{o}") for o, k in dict(d.get("owners", {})).items()},
                {int(c): _key(k, f"clients.{c}") for c, k in dict(d["clients"]).items()},
                run,
            )
        except KeyError as exc:
            raise UserError(f"directory: missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise UserError(f"directory: malformed ({exc})") from None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form every party reads."""
        return {
            "run": self.run,
            "servers": {s: k.hex() for s, k in sorted(self.servers.items())},
            "owners": {str(o): k.hex() for o, k in sorted(self.owners.items())},
            "clients": {str(c): k.hex() for c, k in sorted(self.clients.items())},
        }

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
        digest = run_digest(text)
        if digest != self.run:
            raise QueryRefused(
                f"{who} refused: the coordinator's configuration (sha256 {digest[:16]}...) is "
                f"not the run its directory pins ({self.run[:16]}...)"
            )

    def server(self, label: str) -> bytes:
        """Share server ``label``'s key."""
        return self.servers[label]

    def owner(self, index: int, who: str) -> bytes:
        """Owner ``index``'s key; an owner the directory does not list is refused."""
        if index not in self.owners:
            raise QueryRefused(
                f"{who} refused: owner {index} is not in its directory "
                f"({sorted(self.owners) or 'no owners'})"
            )
        return self.owners[index]

    def client(self, client: int, who: str) -> bytes:
        """Client ``client``'s key; a client the directory does not list is refused."""
        if client not in self.clients:
            raise QueryRefused(f"{who} refused: client {client} is not in its directory")
        return self.clients[client]

    def expect(self, given: bytes, pinned: bytes, what: str, who: str) -> None:
        """Refuse a key handed by the coordinator that is not the pinned one."""
        if bytes(given) != pinned:
            raise QueryRefused(
                f"{who} refused: the coordinator gave {what} the key {bytes(given).hex()[:16]}...; "
                f"its directory pins {pinned.hex()[:16]}..."
            )
