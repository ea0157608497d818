"""The sealed mode on Flower, every party a SuperNode (in this process, no network): the
clients, two share servers and one node per owner; the ServerApp only relays sealed
envelopes, deals triples and reads the aggregate. The verdict is the in-process run's; a
server refuses to open one client's share, or a second set of a round's shares."""

import json
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.flower

flwr = pytest.importorskip(
    "flwr", reason="the Flower extra is not installed (pip install '.[flower]')"
)

from flwr.app import Context, Message, RecordDict  # noqa: E402

from conftest import sealed_overrides, small_overrides  # noqa: E402
from fedattr.config import load  # noqa: E402
from fedattr.errors import UserError  # noqa: E402
from fedattr.flower import sealed_nodes  # noqa: E402
from fedattr.flower.client_app import app as client_app  # noqa: E402
from fedattr.flower.launch import sealed_nodes as launch_nodes  # noqa: E402
from fedattr.flower.records import config  # noqa: E402
from fedattr.flower.server_app import check_settings, serve  # noqa: E402
from fedattr.pipeline.config import RunConfig  # noqa: E402
from fedattr.pipeline.run import run_experiment  # noqa: E402
from fedattr.secagg.directory import Directory  # noqa: E402
from fedattr.secagg.envelope import Recipient, seal, seal_arrays, verify  # noqa: E402
from fedattr.secagg.errors import SecAggError  # noqa: E402
from test_flower_app import (  # noqa: E402,F401
    LocalGrid,
    _claimed,
    _task_identity,
    killed_in_round_2,
)


class PartiesGrid(LocalGrid):
    """The clients' SuperNodes and the sealed mode's other parties (node ids 200 on), each
    with its own node configuration (keys, the directory), as ``fedattr flower local`` starts
    them."""

    def __init__(self, clients, nodes):
        super().__init__(clients)
        for p, extra in nodes.clients.items():
            self.contexts[100 + p].node_config.update(extra)
        for i, node_config in enumerate(nodes.parties):
            self.contexts[200 + i] = Context(1, 200 + i, dict(node_config), RecordDict(), {})
        self.replies: list[tuple[str, Message]] = []
        """(message type, reply) of every message answered."""

    def push_messages(self, messages):
        ids = super().push_messages(messages)
        for m, i in zip(messages, ids, strict=True):
            if i in self.inbox:
                self.replies.append((m.metadata.message_type, self.inbox[i]))
        return ids


def _sealed_cfg(tiny_cache, *extra):
    return load(RunConfig, None, sealed_overrides(tiny_cache, *extra))


def test_a_sealed_run_with_every_party_a_node_names_what_the_in_process_run_names(
    tiny_cache, tmp_path
):
    # Flower's clients train one after another: so does the in-process reference.
    cfg = _sealed_cfg(tiny_cache, "fl.batched=false")
    check_settings(cfg, "run")  # allowed on Flower now
    folder = _claimed(tmp_path, cfg)
    nodes = launch_nodes(cfg, tmp_path / "nodes")
    roles = [p["role"] for p in nodes.parties]
    assert roles == ["share-server", "share-server", "owner", "owner"]
    assert all("directory" in n for n in [*nodes.parties, *nodes.clients.values()])
    grid = PartiesGrid(range(cfg.fl.K), nodes)
    remote = serve(grid, {"run-folder": str(folder.path), "timeout": 120}, say=lambda _m: None)
    local = run_experiment(cfg)
    # Fresh masks each run: the same verdicts, the same owners' values up to the shares'
    # float32 rounding (~5e-4 in Z here), so the same rank p but where a random key reads
    # within that of the owner's.
    assert [c.flagged for c in remote.report.clients] == [c.flagged for c in local.report.clients]
    for a, b in zip(remote.report.clients, local.report.clients, strict=True):
        assert abs(a.p - b.p) <= 2 * 2 / 32, (a.id, a.p, b.p)
    for owner, rep in remote.report.components.items():
        ours = [c.Z for c in rep.clients]
        theirs = [c.Z for c in local.report.components[owner].clients]
        np.testing.assert_allclose(ours, theirs, atol=5e-3)
    out = remote.to_dict()
    assert out["mode"] == "sealed" and out["sealed"]["share_reads"] == 2 * 2 * cfg.fl.K
    assert out["sealed"]["sealed_envelope_bytes"] > 0
    assert out["runtime"]["name"] == "flower"
    # What the coordinator saw: the clients' train replies carry no update, only envelopes
    # sealed to the servers; every server and owner message is envelopes and public values.
    trained = [r for kind, r in grid.replies if kind == "train"]
    assert len(trained) == 2 * cfg.fl.K and all(not r.content.array_records for r in trained)
    for r in trained:
        fields = r.content.config_records["fedattr"]
        assert {"sealed.A", "sealed.B"} <= set(fields)
        assert not any(isinstance(v, list) and len(v) > 8 for v in fields.values())
    views = json.loads((folder.path / "parties.json").read_text())
    assert set(views["end"]) >= {"server A", "server B", "dealer"}
    # The owners' openings happen once: asked again over other clients, or to read a further
    # round, a server refuses.
    server_a = grid.contexts[200]
    parts = json.loads(str(server_a.state.config_records["fedattr.sealed"]["laws"]))
    owners = json.dumps([{"part": p, "cells": 0} for p in sorted(parts)])
    ask = {"last": 2, "clients": [0, 1, 2], "owners": owners, "frac_bits": 32, "phase": 1}
    again = Message(
        RecordDict({"fedattr": config({**ask, "keys": 31, "seed": cfg.attribution.seed})}),
        dst_node_id=200,
        message_type="query.sealed_open",
    )
    with pytest.raises(Exception, match="opened to the owners once already"):
        client_app(again, server_a)
    # Nor are the openings' public parameters the coordinator's to choose.
    other_seed = Message(
        RecordDict({"fedattr": config({**ask, "keys": 31, "seed": cfg.attribution.seed + 1})}),
        dst_node_id=200,
        message_type="query.sealed_open",
    )
    with pytest.raises(Exception, match="the run's are"):
        client_app(other_seed, server_a)
    more = Message(
        RecordDict({"fedattr": config({"round": 3, "previous": 2, "answered": [0, 1, 2, 3]})}),
        dst_node_id=200,
        message_type="query.sealed_read",
    )
    with pytest.raises(Exception, match="opened to the owners after round 2"):
        client_app(more, server_a)
    # Each server kept its running sums on its own disk, one file a round read.
    for s in "AB":
        files = sorted(p.name for p in (tmp_path / "nodes" / f"server-{s}").iterdir())
        assert files == ["opened.json", "sums-round1.pt", "sums-round2.pt", "weights.pt"]


def test_a_share_server_refuses_one_clients_share_and_a_second_set_of_a_round(tiny_cache, tmp_path):
    cfg = _sealed_cfg(tiny_cache)
    from fedattr.flower.records import config_json

    node = {"role": "share-server", "server": "A", "state-dir": str(tmp_path / "A")}
    ctx = Context(1, 7, node, RecordDict(), {})
    register = Message(
        RecordDict({"fedattr": config({"command": "run", "config": config_json(cfg)})}),
        dst_node_id=7,
        message_type="query.register",
    )
    reply = client_app(register, ctx)
    key = bytes(reply.content.config_records["fedattr"]["public_key"])

    def read(answered):
        fields = {
            "round": 1,
            "previous": -1,
            "answered": answered,
            "layout": json.dumps({"names": ["x"], "shapes": [[3]], "dtypes": ["float32"]}),
            "frac_bits": 32,
        }
        for c in answered:
            share = np.full(3, float(c))
            fields[f"env.{c}"] = seal_arrays(
                key, {"share": share}, sealed_nodes.share_context(1, c, "A")
            )
        msg = Message(
            RecordDict({"fedattr": config(fields)}), dst_node_id=7, message_type="query.x"
        )
        return sealed_nodes.read_round(msg, ctx)

    with pytest.raises(Exception, match=r"refused: opening 1 client\(s\) \[2\] is below"):
        read([2])
    # A first set opens (recorded before its reading, which then lacks this message's public
    # inputs: the taper, the reference).
    with pytest.raises(UserError, match=r"holds no taper \(weights\.pt\)"):
        read([0, 1, 2])
    assert json.loads((tmp_path / "A" / "opened.json").read_text())["1"] == [0, 1, 2]
    with pytest.raises(Exception, match=r"opened over \[0, 1, 2\]; a second set \[0, 1\]"):
        read([0, 1])


def test_an_envelope_opens_for_its_recipient_under_its_context_only():
    alice, eve = Recipient(), Recipient()
    box = seal(alice.public_key, b"share", "round=1/client=2/server=A")
    assert alice.open(box, "round=1/client=2/server=A") == b"share"
    for who, context in [(eve, "round=1/client=2/server=A"), (alice, "round=2/client=2/server=A")]:
        with pytest.raises(SecAggError, match="does not open"):
            who.open(box, context)
    altered = box[:-1] + bytes([box[-1] ^ 1])
    with pytest.raises(SecAggError, match="does not open"):
        alice.open(altered, "round=1/client=2/server=A")
    again = Recipient(alice.private_bytes())
    arrays = {"x": np.arange(4.0), "k": np.arange(3, dtype=np.int64)}
    opened = again.open_arrays(seal_arrays(alice.public_key, arrays, "c"), "c")
    assert all(np.array_equal(opened[k], v) for k, v in arrays.items())


def test_flower_refuses_a_sealed_variant_beside_the_main_attribution(tiny_cache):
    cfg = load(
        RunConfig,
        None,
        small_overrides(
            tiny_cache, "attribution.protocol.mode=sealed", 'variants=[{"name": "more"}]'
        ),
    )
    with pytest.raises(UserError, match="variants: on Flower the sealed mode is the main"):
        check_settings(cfg, "run")


def test_an_interrupted_sealed_flower_run_resumes_from_the_servers_own_sums(tiny_cache, tmp_path):
    cfg = _sealed_cfg(tiny_cache)
    whole_folder = _claimed(tmp_path / "a", cfg)
    whole = serve(
        PartiesGrid(range(cfg.fl.K), launch_nodes(cfg, tmp_path / "a-nodes")),
        {"run-folder": str(whole_folder.path)},
        say=lambda _m: None,
    )

    Killed = killed_in_round_2(PartiesGrid)
    nodes = launch_nodes(cfg, tmp_path / "b-nodes")
    folder = _claimed(tmp_path / "b", cfg)
    with pytest.raises(KeyboardInterrupt):
        serve(Killed(range(cfg.fl.K), nodes), {"run-folder": str(folder.path)}, say=lambda _m: None)
    # A new session: every node registers afresh (new envelope keys); the servers' disks keep
    # their sums after round 1.
    said = []
    again = serve(
        PartiesGrid(range(cfg.fl.K), nodes), {"run-folder": str(folder.path)}, said.append
    )
    assert "resuming after round 1 of 2" in said
    assert [c.flagged for c in again.report.clients] == [c.flagged for c in whole.report.clients]
    for a, b in zip(again.report.clients, whole.report.clients, strict=True):
        assert abs(a.p - b.p) <= 2 * 2 / 32, (a.id, a.p, b.p)
    assert again.to_dict()["sealed"]["share_reads"] == 2 * 2 * cfg.fl.K


def test_a_party_with_a_directory_takes_no_key_and_no_setting_from_the_coordinator(
    tiny_cache, tmp_path
):
    from dataclasses import replace

    from fedattr.flower.records import config_json

    cfg = _sealed_cfg(tiny_cache)
    nodes = launch_nodes(cfg, tmp_path / "nodes")
    server_a, owner_0 = nodes.parties[0], nodes.parties[2]
    eve = Recipient()

    run = config_json(cfg)

    def registered(node_config, text=run, node=7):
        ctx = Context(1, node, dict(node_config), RecordDict(), {})
        msg = Message(
            RecordDict({"fedattr": config({"command": "run", "config": text})}),
            dst_node_id=node,
            message_type="query.register",
        )
        return ctx, client_app(msg, ctx)

    # The run's configuration is pinned: a coordinator that lowers the masks' scale is refused,
    # and so is a node whose key is not the one the directory lists for it.
    lowered = replace(cfg, attribution=replace(cfg.attribution))
    lowered.attribution.sealed = replace(cfg.attribution.sealed, mask_scale=1e-3)
    with pytest.raises(SecAggError, match="is not the run its directory pins"):
        registered(server_a, config_json(lowered))
    wrong = {**server_a, "key-file": nodes.parties[1]["key-file"]}
    with pytest.raises(UserError, match="the directory lists"):
        registered(wrong)

    # A share server opens a share only from the client the directory names.
    ctx, reply = registered(server_a)
    key = bytes(reply.content.config_records["fedattr"]["public_key"])
    clients = {c: Recipient.load(n["key-file"]) for c, n in nodes.clients.items()}
    pinned = Directory.load(server_a["directory"])

    agreed = "a" * 64  # the digest of the state and participants the clients trained with

    def read(senders, members=None, digests=None):
        fields = {
            "round": 1,
            "previous": -1,
            "answered": list(senders),
            "layout": json.dumps({"names": ["x"], "shapes": [[3]], "dtypes": ["float32"]}),
            "agreed": agreed,
        }
        for c, sender in senders.items():
            # As the client seals it: this run's, naming the round's members and its state.
            digest = (digests or {}).get(c, agreed)
            context = sealed_nodes.share_context(1, c, "A", members or list(senders), digest)
            where = pinned.context(context)
            fields[f"env.{c}"] = seal_arrays(key, {"share": np.full(3, 1.0)}, where, sender)
        msg = Message(
            RecordDict({"fedattr": config(fields)}), dst_node_id=7, message_type="query.x"
        )
        return sealed_nodes.read_round(msg, ctx)

    for forged in (None, eve):  # a relay posing as client 2, anonymously or with its own key
        with pytest.raises(SecAggError, match="not by the pinned sender"):
            read({0: clients[0], 1: clients[1], 2: forged})
    with pytest.raises(SecAggError, match="client 99 is not in its directory"):
        read({0: clients[0], 1: clients[1], 99: eve})
    # Nor a set of clients other than the round's members (the servers' total would differ from
    # the secure-aggregation sum by one client), nor shares of clients that trained from
    # another state (which a coordinator could make learn nothing).
    genuine = {c: clients[c] for c in range(3)}
    with pytest.raises(SecAggError, match="not by the pinned sender"):
        read({0: clients[0], 1: clients[1]}, members=[0, 1, 2])
    with pytest.raises(SecAggError, match="not by the pinned sender"):
        read(genuine, digests={1: "b" * 64})
    assert not (tmp_path / "nodes" / "server-A" / "opened.json").exists()  # nothing opened
    with pytest.raises(UserError, match=r"holds no taper"):  # the genuine shares open
        read({c: clients[c] for c in range(3)})

    # Nor does it open to the owners with the peer's or an owner's key substituted, or an
    # owner's key against another owner's part; nothing is recorded for a refused opening.
    from fedattr.attribution.sealed.parties import expected_keys

    stored = ctx.state.config_records["fedattr.sealed"]
    mine = sealed_nodes.owner_keys(sealed_nodes._reader_of(stored))
    names = sorted(mine)
    owners = [{"name": n, "part": mine[n][0], "cells": 0} for n in names]
    base = {
        "last": 1,
        "clients": [0, 1, 2],
        "frac_bits": cfg.attribution.sealed.frac_bits,
        "seed": cfg.attribution.seed,
        "keys": expected_keys(cfg, len(names)),
        "phase": 1,
        "pk.peer": pinned.server("B"),
        **{f"pk.owner.{j}": pinned.owner(j, "x") for j in range(len(names))},
    }
    swapped = [{**o, "part": p["part"]} for o, p in zip(owners, owners[::-1], strict=True)]
    for change, message in (
        ({"pk.peer": eve.public_key}, "gave server B the key"),
        ({"pk.owner.0": eve.public_key}, f"gave owner {names[0]} the key"),
        ({"owners": json.dumps(swapped)}, "is not an owner of this run reading that part"),
    ):
        fields = {**base, "owners": json.dumps(owners), **change}
        msg = Message(
            RecordDict({"fedattr": config(fields)}), dst_node_id=7, message_type="query.x"
        )
        with pytest.raises(SecAggError, match=message):
            sealed_nodes.open_owners(msg, ctx)
    assert "end" not in json.loads((tmp_path / "nodes" / "server-A" / "opened.json").read_text())

    # An owner shares its key only to the pinned servers.
    ctx, _ = registered(owner_0, node=8)
    pins = {s: pinned.server(s) for s in "AB"}
    ask = {"index": 0, "pk.A": eve.public_key, "pk.B": pins["B"]}
    msg = Message(RecordDict({"fedattr": config(ask)}), dst_node_id=8, message_type="query.x")
    with pytest.raises(SecAggError, match=r"gave server A the key .* directory pins"):
        sealed_nodes.share_key(msg, ctx)


def _register(node_config, text, node, ctx=None):
    """A ``register`` message to a node (a fresh node state unless ``ctx`` is given)."""
    ctx = ctx or Context(1, node, dict(node_config), RecordDict(), {})
    msg = Message(
        RecordDict({"fedattr": config({"command": "run", "config": text})}),
        dst_node_id=node,
        message_type="query.register",
    )
    return ctx, client_app(msg, ctx)


def test_a_client_with_a_directory_checks_its_scale_and_answers_one_sum_a_round(
    tiny_cache, tmp_path
):
    from fedattr.fl.aggregate import sa_scales
    from fedattr.flower import client_app as client_module
    from fedattr.flower.pinned_client import Ledger, update_digest
    from fedattr.flower.records import config_json

    cfg = _sealed_cfg(tiny_cache)
    nodes = launch_nodes(cfg, tmp_path / "nodes")
    run = config_json(cfg)
    pinned = Directory.load(nodes.clients[0]["directory"])
    clients = {c: Recipient.load(n["key-file"]) for c, n in nodes.clients.items()}
    pins = {s: pinned.server(s) for s in "AB"}
    eve = Recipient()

    # It keeps the rounds it answered on its own disk: no state-dir, no registration.
    client = {"partition-id": 0, **nodes.clients[0]}
    with pytest.raises(UserError, match="state-dir: client 0 has a directory"):
        _register({k: v for k, v in client.items() if k != "state-dir"}, run, 9)
    ctx, reply = _register(client, run, 9)
    registered = reply.content.config_records["fedattr"]
    size = int(registered["size"])
    assert size > 0  # and it signs its data size for the run
    signature = bytes(registered["size_signature"])
    verify(clients[0].identity, signature, pinned.size_message(0, size), "size")

    def train(**changes):
        fields = {
            "round": 1,
            "scale": 1.0,
            "participants": [0],
            "sealed.pk.A": pins["A"],
            "sealed.pk.B": pins["B"],
            "size.0": size,
            "size_sig.0": signature,
        }
        fields.update(changes)
        fields = {k: v for k, v in fields.items() if v is not None}
        msg = Message(RecordDict({"fedattr": config(fields)}), dst_node_id=9, message_type="train")
        return client_app(msg, ctx)

    # It seals its shares only to the pinned servers and trains only in the sealed mode.
    with pytest.raises(SecAggError, match="gave share server B the key"):
        train(**{"sealed.pk.B": eve.public_key})
    with pytest.raises(SecAggError, match="names no share servers"):
        train(**{"sealed.pk.A": None, "sealed.pk.B": None})
    # Its scale is the one the participants' signed data sizes give: a coordinator that scaled
    # the other members to zero (reading one client from a plain sum) is refused, and so is a
    # size it did not sign, or a size that is not its own, or a round the run does not have.
    with pytest.raises(SecAggError, match="client 0's data size comes unsigned"):
        train(**{"size_sig.0": None})
    with pytest.raises(SecAggError, match=r"gives it the scale 0\.5; .* give 1\.0"):
        train(scale=0.5)
    with pytest.raises(SecAggError, match="client 1's data size comes unsigned"):
        train(scale=2 * size / (size + 7), participants=[0, 1], **{"size.1": 7})
    with pytest.raises(SecAggError, match="client 1's data size: the signature does not"):
        train(participants=[0, 1], **{"size.1": 7, "size_sig.1": eve.sign(b"x")})
    forged = clients[0].sign(pinned.size_message(0, size + 1))
    with pytest.raises(SecAggError, match="gives its data size as"):
        train(**{"size.0": size + 1, "size_sig.0": forged})
    with pytest.raises(SecAggError, match="round 99 is not a round of this run"):
        train(round=99)

    # A client answers a subset sum only when every member's key carries that member's
    # signature for the round and run: a coordinator posing as clients 1 and 2 is refused.
    agreed = "d" * 64  # the digest of the state and participants it trained with

    ledger = Ledger(Path(client["state-dir"]), pinned.run)

    def hold(ctx, flat, sizes=None, record=True):  # what train leaves: node state, ledger
        sizes = sizes or {0: size, 1: 5, 2: 5}  # the round's participants, their sizes
        party = client_module._party(cfg, 0, ctx)
        party.start_round(1, sorted(sizes), flat)
        client_module._save(ctx, party)
        ctx.state.config_records["fedattr.agreed"] = config(
            {"round": 1, "digest": agreed, "sizes": json.dumps(sizes)}
        )
        if record:
            ledger.record(1, sorted(sizes), agreed, update_digest(flat))

    def ask_sum(signed, *rows, members=(0, 1, 2), round_id=1, trained=None):
        rows = rows or ([1] * len(members),)
        query = json.dumps(
            [
                {"id": i, "members": list(members), "coefficients": list(c)}
                for i, c in enumerate(rows)
            ]
        )
        fields = {"round": round_id, "queries": query}
        for c in members:
            key = Recipient().public_key
            fields[f"pk.{c}"] = key
            if signed.get(c) is not None:
                digest = (trained or {}).get(c, agreed)
                message = pinned.key_message(round_id, c, key, digest)
                fields[f"sig.{c}"] = signed[c].sign(message)
        msg = Message(
            RecordDict({"fedattr": config(fields)}), dst_node_id=9, message_type="query.sa_batch"
        )
        reply = client_app(msg, ctx)
        return json.loads(str(reply.content.config_records["fedattr"]["refused"]))

    signed = {c: clients[c] for c in range(4)}
    with pytest.raises(SecAggError, match="it trained nothing in round 1"):
        ask_sum(signed)
    update = np.linspace(-1.0, 1.0, 5)
    hold(ctx, update)
    with pytest.raises(SecAggError, match="client 2's key of round 1 comes unsigned"):
        ask_sum({0: clients[0], 1: clients[1]})
    with pytest.raises(SecAggError, match="client 1's key of round 1: the signature does not"):
        ask_sum({0: clients[0], 1: eve, 2: clients[2]})
    # A member that trained from another state (a coordinator that sent the others a state
    # from which nothing is learnt would read this client from one sum) is refused.
    with pytest.raises(SecAggError, match="client 2's key of round 1: the signature does not"):
        ask_sum(signed, trained={2: "0" * 64})
    # Members whose signed size is 0 submit exact zeros: they do not count towards the
    # threshold.
    hold(ctx, update, sizes={0: size, 1: 0, 2: 0})
    threshold = client_module._party(cfg, 0, ctx).min_members
    assert threshold == 2
    with pytest.raises(SecAggError, match=r"only 1 of the sum's members \[0, 1, 2\] hold data"):
        ask_sum(signed)
    hold(ctx, update)
    # Signed by all, it still answers one plain sum a round: no weighted sum (which would read
    # one client alone) and no second sum (whose difference with the first would).
    with pytest.raises(SecAggError, match="query 0 is not a plain sum of distinct members"):
        ask_sum(signed, [1, 0, 0])
    with pytest.raises(SecAggError, match="a second sum of round 1"):
        ask_sum(signed, [1, 1, 1], [1, 1, 1])
    with pytest.raises(SecAggError, match="round 0 is not a round of this run"):
        ask_sum(signed, round_id=0)
    # The sum is over every participant (as its shares to the servers name them).
    with pytest.raises(SecAggError, match=r"sums \[0, 1\]; the round's participants are"):
        ask_sum(signed, members=(0, 1))
    assert ask_sum(signed) == {}  # the round's one aggregate
    assert ask_sum(signed) == {}  # the same sum again (a resumed run): nothing new
    # No second set after a registration sent again, nor in the run started again as a new
    # Flower run (a fresh node state): the ledger is on the client's disk, per run. Training
    # the round again among other participants is refused before it trains (its shares would
    # be a second set), and so is one with too few members holding data.
    _register(client, run, 9, ctx)
    assert ask_sum(signed) == {}  # the same sum still
    ctx, _ = _register(client, run, 9)
    sizes = {1: 5, 3: 5}
    signs = {f"size_sig.{c}": clients[c].sign(pinned.size_message(c, n)) for c, n in sizes.items()}
    again = {f"size.{c}": n for c, n in sizes.items()} | signs
    scale = sa_scales([size, 5, 5])[0]
    with pytest.raises(SecAggError, match=r"a second sum of round 1 \(it trained that round among"):
        train(participants=[0, 1, 3], scale=scale, **again)
    empty = {"size.1": 0, "size_sig.1": clients[1].sign(pinned.size_message(1, 0))}
    with pytest.raises(SecAggError, match=r"only 1 of the sum's members \[0, 1\] hold data"):
        train(participants=[0, 1], scale=sa_scales([size, 0])[0], **empty)
    hold(ctx, update + 1e-9, record=False)  # the round's update changed: no sum of it
    with pytest.raises(SecAggError, match=r"gave another update .*not bit for bit repeatable"):
        ask_sum(signed)
    assert list(ledger.read()) == [1]
    assert ledger.read()[1]["members"] == [0, 1, 2]
    # A garbled ledger is refused in one line, never read as empty.
    ledger.path.write_text('{"run": "' + pinned.run + '", "rounds": ["1"]}')
    with pytest.raises(UserError, match="is not a readable ledger of this run"):
        ask_sum(signed)


def test_a_clients_refusal_stops_the_run_in_one_line_not_as_a_dropout():
    from fedattr.flower.link import FlowerLink

    link = FlowerLink(grid=None, timeout=1.0)
    link.node_of = {0: 10, 1: 11, 2: 12}
    # As the SuperNode's runtime words a ClientApp's exception.
    link.errors = {
        10: "<class 'fedattr.secagg.errors.QueryRefused'>:<'client 0 refused: the coordinator "
        "gives it the scale 0.0; the participants' signed data sizes give 1.0'>",
        11: "<class 'TimeoutError'>:<'slow'>",
        12: "<class 'fedattr.errors.UserError'>:<'state-dir: ... is not a readable ledger'>",
    }
    with pytest.raises(UserError, match=r"client 0 refused round 3: .*signed data sizes"):
        link.refused(0, "round 3")
    with pytest.raises(UserError, match=r"client 2 refused the sums of round 3: .*ledger"):
        link.refused(2, "the sums of round 3")
    link.refused(1, "round 3")  # another error: a dropout, as before
    link.node_of[3] = 13
    link.refused(3, "round 3")  # no error at all
