"""The ClientApp: one fedattr client per SuperNode (``node_config`` ``partition-id``).

Three messages per round reach a client: ``train`` (the global state; the client trains, keeps
its scaled update and a fresh X25519 key in the node's state, and answers with its public key,
its update's layout and its loss: never the update), then one ``query.sa_batch`` per SA
exchange (every query of the batch; the client checks each, see
:class:`~fedattr.secagg.party.MaskingParty`, and answers the ones it is a member of with one
masked vector each). ``query.register`` comes once per run with the configuration: the client
builds its own data and reports its example count.

Every message may start a fresh process, so everything a client keeps lives in
``context.state``. Node settings (``flower-supernode --node-config``): ``partition-id`` (the
client id, required) and ``min-members`` (the client's own SA threshold; the run's
``secagg.min_members`` if larger).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from ..attribution.sealed.observer import mask_sd
from ..data.records import Record
from ..errors import UserError
from ..fl.node import LLMClientNode, SyntheticClientNode
from ..fl.registry import make_strategy
from ..runtime import set_threads
from ..secagg.directory import Directory
from ..secagg.envelope import Recipient, seal_arrays, verify
from ..secagg.errors import QueryRefused
from ..secagg.party import MaskingParty
from ..secagg.sealed import split_update
from ..secagg.wire import QueryBatch
from ..updates import UpdateLayout
from . import pinned_client, sealed_nodes
from .records import arrays, config, config_of, record_state, unarrays

app = ClientApp()

_NODE, _PARTY, _UPDATE = "fedattr.node", "fedattr.party", "fedattr.update"
_AGREED = "fedattr.agreed"  # a client with a directory: what it trained from this round


def partition_id(node_config: Any) -> int:
    """The client id this SuperNode serves."""
    raw = node_config.get("partition-id")
    if raw is None or isinstance(raw, bool):
        raise UserError(
            "partition-id: every SuperNode needs --node-config 'partition-id=<client id>'"
        )
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise UserError(f"partition-id: must be an integer client id, got {raw!r}") from None


def _node(command: str, cfg: Any, client: int, records: list[Record] | None = None) -> Any:
    if command == "demo":
        return SyntheticClientNode(cfg.synthetic, client)
    return LLMClientNode(cfg.model, cfg.lora, cfg.data, cfg.watermark, cfg.fl, client, records)


def _registered(context: Context) -> tuple[str, Any, int, ConfigRecord]:
    if _NODE not in context.state.config_records:
        raise UserError("this node was never registered for the run (no query.register message)")
    stored = context.state.config_records[_NODE]
    command = str(stored["command"])
    return command, config_of(command, str(stored["config"])), int(stored["client"]), stored


def _party(cfg: Any, client: int, context: Context) -> MaskingParty:
    sa = cfg.secagg
    own = context.node_config.get("min-members")
    threshold = max(sa.min_members, int(own)) if own is not None else sa.min_members
    # Every pair expands its seed on two machines: one cipher for all, whatever the devices.
    prg = sa.resolved_prg(distributed=True)
    return MaskingParty(
        client, sa.codec(), prg, threshold, sa.release_budget or None, sa.torch_device()
    )


@app.query("register")
def register(msg: Message, context: Context) -> Message:
    """Build this client's data from the run's configuration; report its example count (a
    node playing one of the sealed mode's other parties builds that party instead)."""
    set_threads()
    rec = msg.content.config_records["fedattr"]
    command, text = str(rec["command"]), str(rec["config"])
    role = sealed_nodes.role_of(context.node_config)
    if role != "client":
        if command != "run":
            raise UserError(f"role: {role} serves LLM runs only (command 'run')")
        reply = sealed_nodes.register(context, role, text)
        return Message(RecordDict({"fedattr": config(reply)}), reply_to=msg)
    client = partition_id(context.node_config)
    stored: dict[str, Any] = {"command": command, "config": text, "client": client}
    # Its envelope key and, given a directory, the pinned run and parties: checked first,
    # whatever the coordinator's configuration says (a directory pins it).
    stored |= sealed_nodes.identity(
        context, text, lambda d: d.client_identity(client, f"client {client}")
    )
    if stored["directory"]:
        # The rounds it answered outlive the Flower run: a coordinator that starts the run again
        # (the same directory, the same updates trained again) gets no second sum of a round.
        folder = context.node_config.get("state-dir")
        if not folder:
            raise UserError(
                f"state-dir: client {client} has a directory, so it keeps the rounds it "
                "answered on its own disk (--node-config \"... state-dir='...'\")"
            )
        folder = Path(str(folder)).resolve()
        folder.mkdir(parents=True, exist_ok=True)
        stored["state_dir"] = str(folder)
    cfg = config_of(command, text)
    cfg.secagg.torch_device()  # this node's masking device: checked here, before any round
    node = _node(command, cfg, client)
    size = node.data_size()
    if isinstance(node, LLMClientNode):
        stored["records"] = json.dumps(node.records_dicts())  # built once per run
    context.state.config_records[_NODE] = config(stored)
    reply: dict[str, Any] = {"client": client, "size": size}
    directory = sealed_nodes.directory_of(stored)
    if directory is not None:  # its FedAvg weight, signed: the coordinator cannot rescale it
        me = Recipient(bytes(stored["private_key"]))
        reply["size_signature"] = pinned_client.size_signature(me, directory, client, size)
    return Message(RecordDict({"fedattr": config(reply)}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Local training; the scaled update stays here, only its public key and layout go back."""
    set_threads()
    command, cfg, client, stored = _registered(context)
    rec = msg.content.config_records["fedattr"]
    directory = sealed_nodes.directory_of(stored)
    sealer = None
    if "sealed.pk.A" in rec:
        # Before any training: a substituted key is refused.
        sealer = _sealing_key(rec, directory, stored, client)
    elif directory is not None:
        raise QueryRefused(
            f"client {client} refused: its directory pins the sealed mode; this round's message "
            "names no share servers"
        )
    round_id, scale = int(rec["round"]), float(rec["scale"])
    participants = [int(c) for c in rec["participants"]]
    records = None
    if "records" in stored:
        records = [Record(**r) for r in json.loads(str(stored["records"]))]
    node = _node(command, cfg, client, records)
    party = _party(cfg, client, context)
    agreed = ""
    if directory is not None:  # before any training
        pinned_client.check_round(directory, round_id, cfg.fl.rounds, client)
        sizes = pinned_client.check_train(
            rec, directory, client, node.data_size(), participants, scale
        )
        raw = msg.content.array_records.get("state")
        agreed = pinned_client.round_digest(unarrays(raw) if raw is not None else {}, participants)
        pinned_client.check_members(client, participants, sizes, party.min_members)
        ledger = pinned_client.Ledger(Path(str(stored["state_dir"])), directory.run)
        with ledger.lock():  # a round trained among other participants is refused at once
            ledger.check(client, round_id, participants, agreed)
        context.state.config_records[_AGREED] = config(
            {"round": round_id, "digest": agreed, "sizes": json.dumps(sizes)}
        )
    state = record_state(msg.content.array_records["state"]) if command == "run" else None
    update, stats = node.train(round_id, state, scale)
    layout = UpdateLayout.of(update)
    mask_seed = None
    if directory is not None:
        # Recorded before anything of the update leaves: one set, state and update a round.
        digest = pinned_client.update_digest(layout.flatten(update))
        with ledger.lock():
            ledger.check(client, round_id, participants, agreed, digest)
            ledger.record(round_id, participants, agreed, digest)
        # The same update gets the same shares (a resumed round sends nothing new).
        mask_seed = pinned_client.mask_seed(
            bytes(stored["private_key"]), directory.run, round_id, agreed, digest
        )
    public_key = party.start_round(round_id, participants, layout.flatten(update))
    _save(context, party)
    reply = {
        "client": client,
        "public_key": public_key,
        "layout": json.dumps(layout.to_dict()),
        **stats,
    }
    if directory is not None:
        # Its secure-aggregation key of the round, signed with what it trained from: no client
        # answers a subset sum whose members' keys the coordinator made up, or whose members
        # trained from another state.
        me = Recipient(bytes(stored["private_key"]))
        message = directory.key_message(round_id, client, public_key, agreed)
        reply["sa_signature"] = me.sign(message)
    if "sealed.pk.A" in rec:
        # The sealed mode: what it submits, split into two reading shares, one sealed to each
        # share server (the coordinator relays them unread). The masks' scale is the client's
        # own reading of the run's settings, not the coordinator's to choose.
        strategy, _ = make_strategy(cfg.fl, cfg.lora)
        sd = mask_sd(cfg.attribution.sealed.mask_scale, strategy.scoring_params(state))
        shares = split_update(layout.flatten(update), sd, mask_seed)
        for server, share in zip(sealed_nodes.SERVERS, shares, strict=True):
            reply[f"sealed.{server}"] = seal_arrays(
                bytes(rec[f"sealed.pk.{server}"]),
                {"share": share},
                sealed_nodes.bound(
                    directory,
                    sealed_nodes.share_context(
                        round_id,
                        client,
                        server,
                        participants if directory is not None else None,
                        agreed,
                    ),
                ),
                sealer,
            )
    return Message(RecordDict({"fedattr": config(reply)}), reply_to=msg)


def _sealing_key(
    rec: Any, directory: Directory | None, stored: ConfigRecord, client: int
) -> Recipient | None:
    """The sealed mode: check the share servers' keys the coordinator handed out (distinct; with
    a directory, the pinned ones) and return the key this client seals its shares with (None:
    no directory, unauthenticated envelopes)."""
    if bytes(rec["sealed.pk.A"]) == bytes(rec["sealed.pk.B"]):
        raise QueryRefused("sealed: share servers A and B were given one key; refused")
    if directory is None:
        return None
    for server in sealed_nodes.SERVERS:
        directory.expect(
            bytes(rec[f"sealed.pk.{server}"]),
            directory.server(server),
            f"share server {server}",
            f"client {client}",
        )
    return Recipient(bytes(stored["private_key"]))


def _save(context: Context, party: MaskingParty) -> None:
    meta, private_key, flat = party.state()
    context.state.config_records[_PARTY] = config({"meta": meta, "private_key": private_key})
    context.state.array_records[_UPDATE] = arrays({"flat": flat})


@app.query("sa_batch")
def sa_batch(msg: Message, context: Context) -> Message:
    """Check every query of the batch; answer this client's with masked vectors."""
    _, cfg, client, stored = _registered(context)
    rec = msg.content.config_records["fedattr"]
    batch = QueryBatch(
        int(rec["round"]),
        QueryBatch.queries_from_json(str(rec["queries"])),
        {int(k[3:]): bytes(v) for k, v in rec.items() if k.startswith("pk.")},
    )
    directory = sealed_nodes.directory_of(stored)
    mine = [q for q in batch.queries if client in q.members]
    party = _party(cfg, client, context)
    if directory is not None:
        pinned_client.check_round(directory, batch.round, cfg.fl.rounds, client)
        trained = context.state.config_records.get(_AGREED)
        if trained is None or int(trained["round"]) != batch.round:
            raise QueryRefused(
                f"client {client} refused: it trained nothing in round {batch.round}"
            )
        agreed = str(trained["digest"])
        # Every member's key must be the one that member signed for this round and run, having
        # trained from the state this client trained from, among the same participants.
        for c, key in sorted(batch.public_keys.items()):
            what = f"client {client} refused: client {c}'s key of round {batch.round}"
            signature = rec.get(f"sig.{c}")
            if signature is None:
                raise QueryRefused(f"{what} comes unsigned")
            verify(
                directory.client_identity(c, f"client {client}"),
                bytes(signature),
                directory.key_message(batch.round, c, key, agreed),
                what,
            )
        # The sealed mode asks one sum a round, the aggregate: a weighted sum, a member listed
        # twice or a second sum of the round (whose difference with the first would isolate a
        # client) is refused.
        for q in mine:
            if set(q.coefficients) != {1} or len(set(q.members)) != len(q.members):
                raise QueryRefused(
                    f"client {client} refused: query {q.query_id} is not a plain sum of distinct "
                    "members (its directory pins the sealed mode: one aggregate a round)"
                )
        if len(mine) > 1:
            raise QueryRefused(
                f"client {client} refused: a second sum of round {batch.round} (its directory "
                "pins the sealed mode: one aggregate a round)"
            )
        sizes = {int(k): int(v) for k, v in json.loads(str(trained["sizes"])).items()}
        for q in mine:
            pinned_client.check_members(client, q.members, sizes, party.min_members)
            # The sum is over every participant of the round, as the shares it sealed to the
            # servers name them: the servers' total is then this sum, not a second one.
            if sorted(q.members) != sorted(sizes):
                raise QueryRefused(
                    f"client {client} refused: query {q.query_id} sums {sorted(q.members)}; the "
                    f"round's participants are {sorted(sizes)} (its directory pins one "
                    "aggregate over all of them)"
                )
    flat = None
    if _PARTY in context.state.config_records:
        saved = context.state.config_records[_PARTY]
        flat = unarrays(context.state.array_records[_UPDATE])["flat"]
        party.restore(str(saved["meta"]), bytes(saved["private_key"]), flat)
    if directory is None or not mine or flat is None:
        reply = party.answer(batch)
    else:
        # The round as it trained it: the same members, state and update (its ledger, on its
        # own disk, recorded before its shares left).
        ledger = pinned_client.Ledger(Path(str(stored["state_dir"])), directory.run)
        digest = pinned_client.update_digest(flat)
        with ledger.lock():
            ledger.check(client, batch.round, mine[0].members, agreed, digest, trained=True)
            reply = party.answer(batch)
    if party.round is not None:
        _save(context, party)  # the ledger moved on
    content = RecordDict(
        {
            "fedattr": config(
                {
                    "client": client,
                    "refused": json.dumps({str(k): v for k, v in reply.refused.items()}),
                    "seconds": json.dumps({str(k): v for k, v in reply.seconds.items()}),
                }
            ),
            "masked": arrays({str(k): v for k, v in reply.masked.items()}),
        }
    )
    return Message(content, reply_to=msg)


# -- the sealed mode's other parties (see :mod:`.sealed_nodes`) -------------------------------


@app.query("sealed_read")
def sealed_read(msg: Message, context: Context) -> Message:
    """A share server: open the round's sum once, read every share."""
    set_threads()
    return sealed_nodes.read_round(msg, context)


@app.query("sealed_open")
def sealed_open(msg: Message, context: Context) -> Message:
    """A share server: a phase of the owners' openings."""
    set_threads()
    return sealed_nodes.open_owners(msg, context)


@app.query("sealed_key")
def sealed_key(msg: Message, context: Context) -> Message:
    """An owner: its key's shares, sealed to the servers."""
    return sealed_nodes.share_key(msg, context)


@app.query("sealed_verdict")
def sealed_verdict(msg: Message, context: Context) -> Message:
    """An owner: its p-values from what the servers sealed to it."""
    return sealed_nodes.verdict(msg, context)
