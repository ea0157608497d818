"""What a client with a deployment directory checks before it trains or answers a sum.

A coordinator that relays every message could otherwise read one client's update from sums that
pass every other check:

- **Its scale.** Clients submit ``n * p_i * Delta_i`` (:func:`~fedattr.fl.aggregate.sa_scales`);
  a coordinator that gave every other member a scale of zero would read one client from an
  honest-looking plain sum. Each client signs its data size for the run at registration; a
  client trains only when every participant's size carries that participant's signature and its
  own scale is the one those sizes give (:func:`check_train`).
- **One round, one set, on its own disk.** A second sum of a round over other members (or the
  servers' shares of one set and a sum over another) would read a client from the difference.
  Before its shares leave, the client records the round's participants, state digest and
  update digest in its ``state-dir`` (:class:`Ledger`, one file per run configuration, so
  neither a registration sent again, nor the run started again as a new Flower run, nor a new
  directory for the same configuration forgets it); training the round again, or summing it,
  must match them. The same round again (a resumed run: the same members, state and update,
  bit for bit) reveals nothing new and goes on.
- **One state for every member.** A coordinator that sent the target the global state and every
  other member a state from which nothing is learnt (LoRA factors of zero: a zero update) would
  read the target from one sum (a model-inconsistency attack). Each client signs its round key
  together with a digest of the state it trained from and the round's participants
  (:func:`round_digest`), and answers a sum only when every member's key verifies against its
  own digest: every member trained from the same state, among the same participants.
- **Members that hold data.** A member whose signed data size is 0 submits an exact zero; it
  does not count towards the client's threshold (:func:`check_members`).
- **One sum, two channels.** The share servers' totals add up to an aggregate too. A client
  sums over every participant of the round and seals its shares under a context naming the
  participants and the state digest (``sealed_nodes.share_context``), so a server opens a round
  only over exactly those clients, trained from one state: the servers' total is the
  secure-aggregation sum again, never a second sum to difference it with.
- **Rounds of the run.** Round numbers outside ``1..fl.rounds`` are refused.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from ..attribution.round_folder import write_json_durably
from ..errors import UserError
from ..fl.aggregate import sa_scales
from ..models.filelock import file_lock
from ..secagg.directory import Directory
from ..secagg.envelope import Recipient, verify
from ..secagg.errors import QueryRefused


def size_signature(me: Recipient, directory: Directory, client: int, size: int) -> bytes:
    """What a client sends with its data size at registration."""
    return me.sign(directory.size_message(client, size))


def check_round(directory: Directory | None, round_id: int, rounds: int, client: int) -> None:
    """Refuse a round number outside the run's ``1..rounds`` (clients with a directory)."""
    if directory is not None and not 1 <= round_id <= rounds:
        raise QueryRefused(
            f"client {client} refused: round {round_id} is not a round of this run "
            f"(1..{rounds}, fl.rounds)"
        )


def check_train(
    rec: Mapping[str, Any],
    directory: Directory,
    client: int,
    own_size: int,
    participants: Sequence[int],
    scale: float,
) -> dict[int, int]:
    """Refuse a ``train`` message whose participants' sizes are not signed by them, whose size
    for this client is not its own, or whose scale is not the one the sizes give; returns the
    participants' verified sizes."""
    if len(set(participants)) != len(participants) or client not in participants:
        raise QueryRefused(
            f"client {client} refused: the round's participants {list(participants)} must be "
            "distinct and include it"
        )
    sizes = []
    for p in participants:
        what = f"client {client} refused: client {p}'s data size"
        raw, signature = rec.get(f"size.{p}"), rec.get(f"size_sig.{p}")
        if raw is None or signature is None:
            raise QueryRefused(f"{what} comes unsigned")
        verify(
            directory.client_identity(p, f"client {client}"),
            bytes(signature),
            directory.size_message(p, int(raw)),
            what,
        )
        sizes.append(int(raw))
    at = list(participants).index(client)
    mine = sizes[at]
    if mine != own_size:
        raise QueryRefused(
            f"client {client} refused: the coordinator gives its data size as {mine}; it holds "
            f"{own_size} usable examples"
        )
    expected = sa_scales(sizes)[at]
    if not math.isclose(scale, expected, rel_tol=1e-12, abs_tol=0.0):
        raise QueryRefused(
            f"client {client} refused: the coordinator gives it the scale {scale!r}; the "
            f"participants' signed data sizes give {expected!r}"
        )
    return dict(zip((int(p) for p in participants), sizes, strict=True))


def round_digest(state: Mapping[str, np.ndarray], participants: Sequence[int]) -> str:
    """SHA-256 of the global state a client trained from (every array: name, dtype, shape,
    bytes) and the round's participants: what the members of a sum must share."""
    h = hashlib.sha256()
    for name in sorted(state):
        a = np.ascontiguousarray(state[name])
        h.update(f"{name}|{a.dtype.str}|{list(a.shape)}|".encode())
        h.update(a.tobytes())
    h.update(("participants=" + ",".join(str(int(p)) for p in participants)).encode())
    return h.hexdigest()


def check_members(
    client: int, members: Sequence[int], sizes: Mapping[int, int], threshold: int
) -> None:
    """Refuse a sum with fewer than ``threshold`` members holding data (signed sizes above 0):
    the others submit exact zeros and hide nothing."""
    holding = [m for m in members if sizes.get(int(m), 0) > 0]
    if len(holding) < threshold:
        raise QueryRefused(
            f"client {client} refused: only {len(holding)} of the sum's members {list(members)} "
            f"hold data (signed sizes above 0); its threshold is {threshold}"
        )


def mask_seed(private_key: bytes, run: str, round_id: int, agreed: str, update: str) -> bytes:
    """The seed of a client's share masks for one round's update: secret (keyed by its private
    key), and the same for the same update, so that a round sent again (a resumed run) repeats
    its shares instead of giving a server a second, independent noisy copy."""
    label = f"fedattr/share-mask/v1/run={run}/round={round_id}/agreed={agreed}/update={update}"
    return hmac.new(private_key, label.encode(), hashlib.sha256).digest()


def update_digest(flat: np.ndarray) -> str:
    """SHA-256 of a client's scaled update as it holds it (float64)."""
    return hashlib.sha256(np.ascontiguousarray(flat, dtype=np.float64).tobytes()).hexdigest()


class Ledger:
    """What a client with a directory trained, by round: ``ledger-<run>.json`` in its
    ``state-dir`` (``run``: the directory's digest of the run's configuration, so a new
    directory for the same configuration, whose training is the same, shares it). Each round
    holds the participants, the digest of the state it trained from (``agreed``) and of its
    update, recorded before its shares leave; every later use of the round (its shares again,
    its sum) must match them."""

    def __init__(self, folder: Path, run: str) -> None:
        self.path = folder / f"ledger-{run}.json"
        self.run = run

    @contextmanager
    def lock(self) -> Iterator[None]:
        """An exclusive lock over check, work and record (two processes, one folder); refused
        where the folder's file system takes no lock (check and record would not be atomic)."""
        with file_lock(self.path.with_name(self.path.name + ".lock")) as locked:
            if not locked:
                raise UserError(
                    f"state-dir: {str(self.path.parent)!r} takes no file lock; give the client a "
                    "folder on a local file system"
                )
            yield

    def read(self) -> dict[int, dict[str, Any]]:
        """Round -> ``{"members", "agreed", "update"}``; a garbled file is refused in one line
        (never read as empty: that would let a round be used again)."""
        if not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or data.get("run") != self.run:
                raise ValueError("not this run's ledger")
            rounds = {}
            for key, entry in dict(data["rounds"]).items():
                members = [int(m) for m in entry["members"]]
                if not all(isinstance(entry[k], str) for k in ("agreed", "update")):
                    raise ValueError("malformed entry")
                if int(key) < 1:
                    raise ValueError("malformed round")
                rounds[int(key)] = {
                    "members": members,
                    "agreed": entry["agreed"],
                    "update": entry["update"],
                }
            return rounds
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UserError(
                f"state-dir: {str(self.path)!r} is not a readable ledger of this run ({exc}); "
                "restore it (deleting it would let the coordinator use a round again)"
            ) from None

    def check(
        self,
        client: int,
        round_id: int,
        members: Sequence[int],
        agreed: str,
        update: str | None = None,
        trained: bool = False,
    ) -> None:
        """Refuse a round already recorded with other participants, another state or another
        update (a second sum, or shares of a second set, would isolate a client); with
        ``trained``, also a round never recorded."""
        done = self.read().get(round_id)
        if done is None:
            if trained:
                raise QueryRefused(
                    f"client {client} refused: its ledger holds no training of round {round_id}"
                )
            return
        same = done["members"] == sorted(int(m) for m in members) and done["agreed"] == agreed
        if same and update is not None and done["update"] != update:
            raise QueryRefused(
                f"client {client} refused: round {round_id} trained again from the same state "
                "among the same participants gave another update (training that is not bit for "
                "bit repeatable: another device or thread count); a second sum of it would read "
                "the difference"
            )
        if not same:
            raise QueryRefused(
                f"client {client} refused: a second sum of round {round_id} (it trained that "
                f"round among {done['members']}; its directory pins one aggregate a round)"
            )

    def record(self, round_id: int, members: Sequence[int], agreed: str, update: str) -> None:
        """Add the round, written whole and flushed to disk before its shares leave."""
        rounds = self.read()
        rounds[round_id] = {
            "members": sorted(int(m) for m in members),
            "agreed": agreed,
            "update": update,
        }
        data = {"run": self.run, "rounds": {str(r): e for r, e in sorted(rounds.items())}}
        write_json_durably(self.path, data)
