"""The sealed mode's parties that are not clients, each a Flower SuperNode of its own: the two
share servers and the owners (``--node-config "role='share-server' server='A'
state-dir='...'"``; ``role='owner' owner=0``).

Everything a party receives through the ServerApp (the coordinator) is sealed to it
(:mod:`fedattr.secagg.envelope`): clients' shares to a server, one server's Beaver opening to
the other, an owner's key shares to the servers, the servers' results to an owner. The
coordinator only relays; it deals the Beaver triples (it sees no data) and reads the aggregate.

- A **share server** opens its sum of a round's shares once, over the round's answering clients
  (at least ``secagg.min_members``: one client's share, or a second set for the same round, is
  refused), reads every share to first order and keeps its running sums on its own disk
  (``state-dir``, one file a round read: a coordinator that resumes asks from the round it
  checkpointed). At the end it enters the owners' inner products and reads its shares under the
  public random keys, both sealed to the owner.
- An **owner** holds its key (green lists): it sends the key's ring shares to the servers and,
  from what they send back, computes its own rank p per client, and publishes only that (with
  each client's value standardised by the random keys', for display).

Given a deployment directory (``directory='deployment.json' key-file='party.key'``, see
:mod:`fedattr.secagg.directory`) a party takes no key and no setting from the coordinator: it
checks the run's configuration, its own key and every key it is handed against the directory,
and opens an envelope only from the sender the directory names. Without one the coordinator is
trusted to relay keys honestly (honest but curious).

In this simulation every party derives the owners' documents from the configuration (the
teacher writes them once per party, kept in the node's state); the servers' code reads no key.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict

from ..attribution.round_folder import write_json_durably
from ..attribution.sealed.parties import (
    check_laws,
    expected_keys,
    owner_keys,
    owner_statistics,
    random_keys,
    server_random_values,
)
from ..attribution.sealed.servers import ReadingServer, first_order_parts
from ..errors import UserError
from ..secagg.beaver import InnerProductParty, TripleShare
from ..secagg.beaver import split as ring_split
from ..secagg.directory import SERVERS, Directory
from ..secagg.envelope import Recipient, seal_arrays
from ..secagg.errors import QueryRefused
from ..updates import UpdateLayout
from ..watermarks.tail.laws import RowSubsets
from .records import arrays, config, config_of, record_state, unarrays

ROLES = ("client", "share-server", "owner")
"""What a SuperNode plays (``--node-config role=...``; ``client`` by default)."""
_PARTY, _KEY = "fedattr.sealed", "fedattr.sealed.key"

# A SuperNode may serve many messages from one process: the reader is built once there.
_READERS: dict[str, Any] = {}


def role_of(node_config: Any) -> str:
    """This SuperNode's role, checked."""
    role = str(node_config.get("role", "client"))
    if role not in ROLES:
        raise UserError(f"role: unknown {role!r}; allowed: {', '.join(ROLES)}")
    return role


def share_context(
    round_id: int, client: int, server: str, members: list[int] | None = None, agreed: str = ""
) -> str:
    """The envelope context of a client's share to a server; with a directory, also the round's
    members and the digest of the state they trained from (``agreed``): a server opens a round
    only over exactly the members the clients' secure-aggregation sum has, all trained from one
    state, so its total is that sum again and no second one."""
    base = f"sealed/share/round={round_id}/client={client}/server={server}"
    if members is None:
        return base
    return f"{base}/members={','.join(str(int(m)) for m in sorted(members))}/agreed={agreed}"


def _reader(text: str, documents: dict[str, Any]) -> Any:
    if text not in _READERS:
        from ..pipeline.run import public_reader

        _READERS.clear()
        _READERS[text] = public_reader(config_of("run", text), documents)
    return _READERS[text]


def identity(context: Context, text: str, pinned: Any) -> dict[str, Any]:
    """This node's envelope key (``key-file``, else a fresh one) and, with ``directory`` in its
    node configuration, the deployment directory, checked: the coordinator's configuration must
    be the pinned run's and this node's key the one the directory lists for it (``pinned``:
    ``Directory -> bytes``, the identity it lists). Returns what the node keeps."""
    node_config = context.node_config
    key_file, where = node_config.get("key-file"), node_config.get("directory")
    me = Recipient.load(str(key_file)) if key_file else Recipient()
    kept: dict[str, Any] = {"private_key": me.private_bytes(), "directory": ""}
    if where:
        if not key_file:
            raise UserError(
                "key-file: a node with a directory needs its own key, the one the directory "
                "lists for it (fedattr flower keygen)"
            )
        directory = Directory.load(str(where))
        directory.check_run(text, "this node")
        listed = pinned(directory)
        if me.identity != listed:
            raise UserError(
                f"key-file: {str(key_file)!r} holds the key {me.identity.hex()[:16]}...; the "
                f"directory lists {listed.hex()[:16]}... for this node"
            )
        kept["directory"] = json.dumps(directory.to_dict())
    return kept


def directory_of(stored: ConfigRecord) -> Directory | None:
    """The directory a node registered with (None: it trusts the coordinator's keys)."""
    text = str(stored.get("directory", ""))
    return Directory.from_dict(json.loads(text)) if text else None


def _stored(context: Context) -> tuple[ConfigRecord, Recipient]:
    if _PARTY not in context.state.config_records:
        raise UserError("this node was never registered for the run (no query.register message)")
    stored = context.state.config_records[_PARTY]
    return stored, Recipient(bytes(stored["private_key"]))


def _reader_of(stored: ConfigRecord) -> Any:
    """The detector a server reads shares with (built once per process)."""
    return _reader(str(stored["config"]), json.loads(str(stored["documents"])))


def _laws(stored: ConfigRecord) -> dict[str, RowSubsets]:
    return {p: RowSubsets(m, cols) for p, (m, cols) in json.loads(str(stored["laws"])).items()}


def register(context: Context, role: str, text: str) -> dict[str, Any]:
    """Build this party from the run's configuration (the owners' documents, written once and
    kept); its envelope key. Returns what it tells the coordinator: its role, name and public
    key."""
    node_config = context.node_config
    cfg = config_of("run", text)
    stored: dict[str, Any] = {"role": role, "config": text}
    if role == "share-server":
        name = str(node_config.get("server", ""))
        if name not in SERVERS:
            raise UserError(f"server: a share server is A or B, got {name!r}")
        folder = node_config.get("state-dir")
        if not folder:
            raise UserError("state-dir: a share server keeps its running sums on its own disk")
        # Its identity and the pinned run first: a refused node has done no work.
        stored |= identity(context, text, lambda d: d.servers[name])
        Path(str(folder)).mkdir(parents=True, exist_ok=True)
        stored["state_dir"] = str(folder)
    else:
        raw = node_config.get("owner")
        try:
            index = int(raw)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise UserError(f"owner: an owner node's index (0, 1, ...); got {raw!r}") from None
        stored |= identity(context, text, lambda d: d.owner_identity(index, "this node"))
    documents: dict[str, Any] = {}
    _READERS.pop(text, None)
    reader = _reader(text, documents)
    if role == "owner":
        names = sorted(owner_keys(reader))
        if not 0 <= index < len(names):
            raise UserError(
                f"owner: {index} is not an owner of this run; allowed: 0..{len(names) - 1}"
            )
        name = names[index]
        # The owner keeps its key (its green mask), nothing else of the documents' reading.
        part, G = owner_keys(reader)[name]
        stored |= {"part": part, "owners": len(names)}
        context.state.array_records[_KEY] = arrays({"green": G.numpy().astype(np.uint8)})
    recipient = Recipient(stored["private_key"])
    laws = {p: [law.m, law.cols] for p, law in reader.key_laws().items()}
    if role == "share-server":  # it reads every round with them; an owner never does
        stored["documents"] = json.dumps(documents)
    stored |= {
        "name": name,
        "frac_bits": cfg.attribution.sealed.frac_bits,
        "laws": json.dumps(laws),
        "min_members": cfg.secagg.min_members,
    }
    context.state.config_records[_PARTY] = config(stored)
    # Every party writes the owners' documents itself: parties that disagree would read
    # different changes, so each reports what it wrote (a digest) for the coordinator to compare.
    digest = hashlib.sha256(json.dumps(documents, sort_keys=True).encode()).hexdigest()
    return {"role": role, "name": name, "public_key": recipient.public_key, "documents": digest}


# -- the share servers -----------------------------------------------------------------------


def _server(stored: ConfigRecord) -> tuple[ReadingServer, Path]:
    server = ReadingServer(str(stored["name"]), int(stored["min_members"]), _laws(stored))
    return server, Path(str(stored["state_dir"]))


def _sums(folder: Path, round_id: int) -> Path:
    return folder / f"sums-round{round_id}.pt"


def _load_sums(server: ReadingServer, folder: Path, round_id: int) -> None:
    path = _sums(folder, round_id)
    if not path.is_file():
        raise UserError(
            f"sealed: server {server.label} holds no running sums after round {round_id} "
            f"(in {folder}); the run cannot continue from there"
        )
    server.load(torch.load(path, weights_only=True))


def _opened(folder: Path, stored: ConfigRecord) -> dict[str, Any]:
    """What this server opened so far (``opened.json`` on its disk), refused where the folder
    holds another run's state."""
    path = folder / "opened.json"
    run = hashlib.sha256(str(stored["config"]).encode()).hexdigest()[:16]
    opened = json.loads(path.read_text()) if path.is_file() else {"run": run}
    if opened.get("run") != run:
        raise UserError(
            f"state-dir: {str(folder)!r} holds another run's sums (run {opened.get('run')}); "
            "give each run's share server a folder of its own"
        )
    return opened


def _record(folder: Path, opened: dict[str, Any]) -> None:
    """Write ``opened.json`` whole and durably (a crash leaves the previous one, never half)."""
    write_json_durably(folder / "opened.json", opened)


def read_round(msg: Message, context: Context) -> Message:
    """Open this server's sum of the round's shares (once per round) and read every share."""
    stored, me = _stored(context)
    rec = msg.content.config_records["fedattr"]
    server, folder = _server(stored)
    round_id, previous = int(rec["round"]), int(rec["previous"])
    answered = sorted(int(c) for c in rec["answered"])
    opened = _opened(folder, stored)
    if "end" in opened:
        raise QueryRefused(
            f"server {server.label} refused: its sums were opened to the owners after round "
            f"{opened['end']['last']}; it reads no further round"
        )
    before = opened.get(str(round_id))
    if before is not None and before != answered:
        raise QueryRefused(
            f"server {server.label} refused: round {round_id}'s shares were opened over "
            f"{before}; a second set {answered} would isolate the difference"
        )
    if previous >= 0:
        _load_sums(server, folder, previous)
    directory, who = directory_of(stored), f"server {server.label}"
    # With a directory, one state digest for the whole round: shares of clients that trained
    # from other states, or among other members, do not open.
    agreed = str(rec.get("agreed", "")) if directory is not None else ""
    members = answered if directory is not None else None
    read_from = opened.get("agreed", {}).get(str(round_id))
    if read_from is not None and read_from != agreed:
        raise QueryRefused(
            f"server {server.label} refused: round {round_id} was opened for shares of another "
            "state; a second state's total would be a second sum"
        )
    for c in answered:
        envelope = bytes(rec[f"env.{c}"])
        sender = None if directory is None else directory.client(c, who)
        where = bound(directory, share_context(round_id, c, server.label, members, agreed))
        share = me.open_arrays(envelope, where, sender)["share"]
        server.shares.receive(c, share)
    total = server.shares.total(answered)  # refused below min_members clients
    opened[str(round_id)] = answered
    if directory is not None:
        opened.setdefault("agreed", {})[str(round_id)] = agreed
    _record(folder, opened)
    content = msg.content.array_records
    weights_file = folder / "weights.pt"
    if "weights" in content:
        weights = dict(record_state(content["weights"])) if len(content["weights"]) else {}
        torch.save(weights, weights_file)
    elif weights_file.is_file():
        weights = torch.load(weights_file, weights_only=True)
    else:
        raise UserError(
            f"state-dir: {str(folder)!r} holds no taper (weights.pt) for a round after "
            f"round {previous}; the run cannot continue from there"
        )
    centre = dict(record_state(content["centre"])) if "centre" in content else None
    layout = UpdateLayout.from_dict(json.loads(str(rec["layout"])))
    reference = record_state(content["reference"])
    read = first_order_parts(_reader_of(stored))
    server.read_round(read, reference, layout, weights, centre)
    server.check_fits(int(stored["frac_bits"]))  # the run's, as the openings will encode
    server.shares.close_round()
    torch.save(server.state(), _sums(folder, round_id))
    reply = RecordDict(
        {
            "fedattr": config({"reads": len(answered)}),
            "total": arrays({"total": np.asarray(total)}),
        }
    )
    return Message(reply, reply_to=msg)


def open_owners(msg: Message, context: Context) -> Message:
    """The end, for every owner: phase 1, this server's Beaver opening (sealed to the other
    server) and its share of every client's random-key values with their L1 bound (sealed to
    the owner); phase 2, with the other server's opening, its share of every inner product
    (sealed to the owner). Stateless: each phase recomputes the opening from its inputs."""
    stored, me = _stored(context)
    rec = msg.content.config_records["fedattr"]
    server, folder = _server(stored)
    label, index = server.label, SERVERS.index(server.label)
    peer = SERVERS[1 - index]
    clients = [int(c) for c in rec["clients"]]
    owners = json.loads(str(rec["owners"]))
    phase = int(rec["phase"])
    who = f"server {label}"
    # The public parameters of the openings are the run's, not the coordinator's to choose.
    cfg = config_of("run", str(stored["config"]))
    frac, seed = cfg.attribution.sealed.frac_bits, cfg.attribution.seed
    n_keys = expected_keys(cfg, len(server.laws))
    asked = (int(rec["frac_bits"]), int(rec["seed"]), int(rec["keys"]))
    if asked != (frac, seed, n_keys):
        raise QueryRefused(
            f"{who} refused: openings at frac_bits, seed, keys = {asked}; the run's "
            f"are {(frac, seed, n_keys)}"
        )
    parts = [str(o["part"]) for o in owners]
    if sorted(parts) != sorted(server.laws):
        raise QueryRefused(f"{who} refused: owners' parts {parts}; the run's {sorted(server.laws)}")
    # The owners' openings happen once a run: a second set (other clients, other sums) would
    # open more functionals of the same sums.
    end = {"last": int(rec["last"]), "clients": clients, "parts": parts}
    opened = _opened(folder, stored)
    if opened.get("end", end) != end:
        raise QueryRefused(
            f"{who} refused: its sums were opened to the owners once already "
            f"({opened['end']}); a second opening would reveal more of them"
        )
    # With a directory nothing is sealed to a key, or opened from a sender, it does not list,
    # and each owner's key is entered only against that owner's own part.
    directory = directory_of(stored)
    pins: dict[str, Any] = {"peer": None, "owners": [None] * len(owners)}
    if directory is not None:
        directory.expect(bytes(rec["pk.peer"]), directory.server(peer), f"server {peer}", who)
        mine_of = owner_keys(_reader_of(stored))
        names = sorted(mine_of)  # the owners' indices, as it reads them
        listed = [str(o.get("name", "")) for o in owners]
        if len(set(listed)) != len(listed):
            raise QueryRefused(f"{who} refused: an owner listed twice ({listed})")
        for j, (name, part) in enumerate(zip(listed, parts, strict=True)):
            if name not in names or mine_of[name][0] != part:
                raise QueryRefused(
                    f"{who} refused: owner {name!r} with part {part!r} is not an owner of "
                    "this run reading that part"
                )
            pinned = directory.owner(names.index(name), who)
            directory.expect(bytes(rec[f"pk.owner.{j}"]), pinned, f"owner {name}", who)
            pins["owners"][j] = pinned
        pins["peer"] = directory.server(peer)
    sender = me if directory is not None else None
    # Every envelope opens (from its pinned sender) before anything is recorded: a forged one
    # costs nothing.
    keys_in = [
        me.open_arrays(
            bytes(rec[f"env.key.{j}"]), bound(directory, key_context(j, label)), pins["owners"][j]
        )["key"]
        for j in range(len(parts))
    ]
    peers_in = [
        me.open_arrays(
            bytes(rec[f"env.peer.{j}"]),
            bound(directory, opening_context(j, peer, label)),
            pins["peer"],
        )
        for j in range(len(parts))
        if phase != 1
    ]
    if "end" not in opened:
        opened["end"] = end
        _record(folder, opened)
    _load_sums(server, folder, end["last"])
    triples = unarrays(msg.content.array_records["triples"])
    fields: dict[str, Any] = {}
    law = check_laws([server.laws[p] for p in parts])
    rows = max(int(server.W[clients[0]][p].numel()) for p in parts) // law.cols
    if phase == 1:
        keys = random_keys(n_keys, seed, law, rows)
        (values,) = server_random_values([server], parts, clients, keys)
    for j, part in enumerate(parts):
        triple = TripleShare(
            torch.from_numpy(triples[f"A.{j}"]),
            torch.from_numpy(triples[f"b.{j}"]),
            torch.from_numpy(triples[f"c.{j}"]),
        )
        X = server.ring_shares(part, clients, frac)
        party = InnerProductParty(index, X, torch.from_numpy(keys_in[j]), triple)
        mine = party.opening()
        owner_key = bytes(rec[f"pk.owner.{j}"])
        if phase == 1:
            fields[f"env.open.{j}"] = seal_arrays(
                bytes(rec["pk.peer"]),
                {"D": mine[0].numpy(), "e": mine[1].numpy()},
                bound(directory, opening_context(j, label, peer)),
                sender,
            )
            fields[f"env.random.{j}"] = seal_arrays(
                owner_key,
                {"values": values[j].numpy(), "l1": server.l1(part, clients)},
                bound(directory, result_context(j, label, "random")),
                sender,
            )
        else:
            theirs = peers_in[j]
            share = party.result(
                mine, (torch.from_numpy(theirs["D"]), torch.from_numpy(theirs["e"]))
            )
            fields[f"env.result.{j}"] = seal_arrays(
                owner_key,
                {"z": share.numpy()},
                bound(directory, result_context(j, label, "inner")),
                sender,
            )
    return Message(RecordDict({"fedattr": config(fields)}), reply_to=msg)


def bound(directory: Directory | None, context: str) -> str:
    """An envelope context, bound to the run's nonce where the party has a directory."""
    return context if directory is None else directory.context(context)


def key_context(owner: int, server: str) -> str:
    """The envelope context of owner ``owner``'s key share to ``server``."""
    return f"sealed/key/owner={owner}/server={server}"


def opening_context(owner: int, sender: str, recipient: str) -> str:
    """The envelope context of a server's Beaver opening to the other."""
    return f"sealed/beaver/owner={owner}/from={sender}/to={recipient}"


def result_context(owner: int, server: str, what: str) -> str:
    """The envelope context of a server's results (``inner`` or ``random``) to an owner."""
    return f"sealed/result/owner={owner}/server={server}/{what}"


# -- the owners ------------------------------------------------------------------------------


def _owner_key(context: Context) -> tuple[str, torch.Tensor]:
    green = unarrays(context.state.array_records[_KEY])["green"]
    return str(context.state.config_records[_PARTY]["part"]), torch.from_numpy(green).bool()


def share_key(msg: Message, context: Context) -> Message:
    """The owner's key as two ring shares, one sealed to each server."""
    stored, me = _stored(context)
    rec = msg.content.config_records["fedattr"]
    index = int(rec["index"])
    part, G = _owner_key(context)
    directory, who = directory_of(stored), f"owner {stored['name']}"
    if directory is not None:
        for label in SERVERS:
            directory.expect(
                bytes(rec[f"pk.{label}"]), directory.server(label), f"server {label}", who
            )
    shares = ring_split(G.reshape(-1).long())
    fields: dict[str, Any] = {"part": part, "cells": int(G.numel())}
    for label, share in zip(SERVERS, shares, strict=True):
        fields[f"env.{label}"] = seal_arrays(
            bytes(rec[f"pk.{label}"]),
            {"key": share.numpy()},
            bound(directory, key_context(index, label)),
            None if directory is None else me,
        )
    return Message(RecordDict({"fedattr": config(fields)}), reply_to=msg)


def verdict(msg: Message, context: Context) -> Message:
    """The owner adds the servers' shares of its values and publishes each client's rank p
    (and its standardised value), nothing else."""
    stored, me = _stored(context)
    rec = msg.content.config_records["fedattr"]
    index, name = int(rec["index"]), str(stored["name"])
    _, G = _owner_key(context)
    directory = directory_of(stored)
    pins = {s: None if directory is None else directory.server(s) for s in SERVERS}
    inner = [
        me.open_arrays(
            bytes(rec[f"env.result.{s}"]),
            bound(directory, result_context(index, s, "inner")),
            pins[s],
        )
        for s in SERVERS
    ]
    random = [
        me.open_arrays(
            bytes(rec[f"env.random.{s}"]),
            bound(directory, result_context(index, s, "random")),
            pins[s],
        )
        for s in SERVERS
    ]
    clients = [int(c) for c in rec["clients"]]
    cfg = config_of("run", str(stored["config"]))
    frac, n_keys = cfg.attribution.sealed.frac_bits, expected_keys(cfg, int(stored["owners"]))
    shape = tuple(random[0]["values"].shape)
    if (int(rec["frac_bits"]), int(rec["keys"]), shape) != (frac, n_keys, (len(clients), n_keys)):
        raise QueryRefused(
            f"owner {name} refused: values at frac_bits {rec['frac_bits']}, {shape[-1]} random "
            f"keys; the run's are {frac} and {n_keys}"
        )
    _, p, Z = owner_statistics(
        name,
        clients,
        n_keys,
        [torch.from_numpy(x["z"]) for x in inner],
        [torch.from_numpy(x["values"]) for x in random],
        [x["l1"] for x in random],
        G,
        frac,
    )
    out = {"owner": name, "p": [float(v) for v in p], "Z": [float(v) for v in Z]}
    return Message(RecordDict({"fedattr": config(out)}), reply_to=msg)
