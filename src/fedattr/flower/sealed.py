"""The sealed mode on Flower, the coordinator's side: the ServerApp relays the parties'
sealed messages (:mod:`.sealed_nodes`), deals the Beaver triples and keeps only what is public.

Per round: each client's ``train`` reply carries its two reading shares, sealed to the two
share servers; the coordinator forwards each server its envelopes with the public reference,
taper and (round 1) centre, and adds the two servers' sums (the round's aggregate). At the end:
each owner's key shares (sealed to the servers), the triples, the servers' two Beaver phases
(their openings sealed to each other), and each owner's verdict from what the servers sealed
to it. The coordinator holds no share, key or opening in the clear: only triples it dealt, the
aggregates and the owners' published p-values.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from flwr.app import Message, RecordDict

from ..attribution.sealed.parties import Opening, RoundWork, Verdicts, opening_bytes
from ..errors import UserError
from ..secagg.beaver import Dealer
from .link import FlowerLink
from .records import arrays, config, state_record, unarrays
from .sealed_nodes import SERVERS


class FlowerParties:
    """The sealed mode's parties on SuperNodes (see :class:`~fedattr.attribution.sealed.
    parties.Parties`): two share servers and one node per owner, registered with the run."""

    def __init__(self, link: FlowerLink) -> None:
        self.link = link
        servers = {n: info for (role, n), info in link.parties.items() if role == "share-server"}
        if sorted(servers) != list(SERVERS):
            raise UserError(
                f"role: the sealed mode needs share servers A and B, one SuperNode each "
                f"(--node-config \"role='share-server' server='A' state-dir='...'\"); "
                f"registered: {sorted(servers) or 'none'}"
            )
        self.servers = servers
        self.owner_nodes = {
            n: info for (role, n), info in sorted(link.parties.items()) if role == "owner"
        }
        written = {f"{r} {n}": i["documents"] for (r, n), i in link.parties.items()}
        if len(set(written.values())) > 1:
            raise UserError(
                "sealed: the parties wrote different owners' documents from one configuration "
                f"(digests {written}); their readings would not add up"
            )
        self.envelopes: dict[int, dict[str, bytes]] = {}
        """This round's sealed shares, by client (filled from the ``train`` replies)."""
        self.agreed = ""
        """The digest of this round's state and participants (set by the pool as it sends
        ``train``): clients with a directory seal their shares under it."""
        self.seen: set[int] = set()
        self._reads = 0
        self.last: int | None = None
        self.exchanged = 0
        """Bytes of sealed envelopes relayed at the end."""

    # -- what the clients need -----------------------------------------------------------

    def train_fields(self, state: Any) -> dict[str, Any]:
        """Added to every ``train`` message: the servers' keys (each client computes the masks'
        scale itself, from the run's settings and the state it trains from)."""
        return {f"sealed.pk.{s}": bytes(self.servers[s]["public_key"]) for s in SERVERS}

    def receive(self, client: int, reply: Mapping[str, Any]) -> None:
        """Keep a client's two sealed shares from its ``train`` reply."""
        missing = [s for s in SERVERS if f"sealed.{s}" not in reply]
        if missing:
            raise UserError(f"sealed: client {client} sent no share for server(s) {missing}")
        self.envelopes[client] = {s: bytes(reply[f"sealed.{s}"]) for s in SERVERS}

    # -- Parties ---------------------------------------------------------------------------

    def owners(self) -> list[str]:
        return sorted(self.owner_nodes)

    def clients(self) -> list[int]:
        return sorted(self.seen)

    @property
    def reads(self) -> int:
        return self._reads

    def attack(self) -> dict[str, Any]:
        return {}  # the truth is on the clients' nodes: measured in process only

    def _ask(self, kind: str, contents: Mapping[int, RecordDict], who: str) -> dict[int, Message]:
        """Every node's reply; a refusal or bad input there is one line (UserError), anything
        else a bug there (RuntimeError with the node's reason: its traceback is in its log)."""
        for node in contents:
            self.link.errors.pop(node, None)  # an earlier message's
        replies = self.link.call(kind, contents)
        for node in contents:
            if node in replies:
                continue
            reason = self.link.errors.get(node)
            if reason is None:
                raise UserError(f"sealed: {who} (node {node}) did not answer {kind} in time")
            if any(e in reason for e in ("UserError", "QueryRefused", "SecAggError")):
                raise UserError(f"sealed: {who} (node {node}) refused {kind}: {reason}")
            raise RuntimeError(f"sealed: {who} (node {node}) failed {kind}: {reason}")
        return replies

    def round(self, work: RoundWork) -> np.ndarray:
        missing = [c for c in work.answered if c not in self.envelopes]
        if missing:
            raise RuntimeError(f"sealed mode: no shares of answering clients {missing}")
        contents = {}
        for s in SERVERS:
            fields: dict[str, Any] = {
                "round": work.round,
                "previous": -1 if work.previous is None else work.previous,
                "answered": [int(c) for c in work.answered],
                "layout": json.dumps(work.layout.to_dict()),
                "agreed": self.agreed,
            }
            fields |= {f"env.{c}": self.envelopes[c][s] for c in work.answered}
            records: dict[str, Any] = {
                "fedattr": config(fields),
                "reference": state_record(work.reference),
            }
            if work.previous is None:
                records["weights"] = state_record(dict(work.weights))
            if work.centre is not None and s == "A":
                records["centre"] = state_record(dict(work.centre))  # one share holds it
            contents[int(self.servers[s]["node"])] = RecordDict(records)
        replies = self._ask("query.sealed_read", contents, "a share server")
        total = sum(unarrays(r.content.array_records["total"])["total"] for r in replies.values())
        self._reads += sum(
            int(r.content.config_records["fedattr"]["reads"]) for r in replies.values()
        )
        self.seen |= set(work.answered)
        self.last = work.round
        self.envelopes = {}
        return np.asarray(total)

    def open(self, opening: Opening) -> tuple[Verdicts, dict[str, Any]]:
        t0 = time.perf_counter()
        clients, owners = opening.clients, self.owners()
        verdicts = Verdicts(clients, opening.keys)
        if not clients or not owners or self.last is None:
            return verdicts, {"opening_bytes": 0, "cells": {}, "triples_dealt": 0, "seconds": 0.0}
        pk = {s: bytes(self.servers[s]["public_key"]) for s in SERVERS}
        # 1. Each owner shares its key, one share sealed to each server.
        keys = self._ask(
            "query.sealed_key",
            {
                int(self.owner_nodes[o]["node"]): RecordDict(
                    {"fedattr": config({"index": j, **{f"pk.{s}": pk[s] for s in SERVERS}})}
                )
                for j, o in enumerate(owners)
            },
            "an owner",
        )
        shared = [
            dict(keys[int(self.owner_nodes[o]["node"])].content.config_records["fedattr"])
            for o in owners
        ]
        described = [
            {"name": o, "part": str(k["part"]), "cells": int(k["cells"])}
            for o, k in zip(owners, shared, strict=True)
        ]
        # 2. The dealer (this coordinator, which sees no share) deals one triple per owner.
        dealer = Dealer()
        triples = [dealer.triples(len(clients), d["cells"]) for d in described]
        common = {
            "last": self.last,
            "clients": [int(c) for c in clients],
            "owners": json.dumps(described),
            "keys": opening.keys,
            "seed": opening.seed,
            "frac_bits": opening.frac_bits,
            **{
                f"pk.owner.{j}": bytes(self.owner_nodes[o]["public_key"])
                for j, o in enumerate(owners)
            },
        }

        def phase(number: int, extra: Callable[[str], dict[str, Any]]) -> dict[str, dict]:
            contents = {}
            for i, s in enumerate(SERVERS):
                fields = {
                    **common,
                    "phase": number,
                    "pk.peer": pk[SERVERS[1 - i]],
                    **{f"env.key.{j}": bytes(k[f"env.{s}"]) for j, k in enumerate(shared)},
                    **extra(s),
                }
                parts = {}
                for j, t in enumerate(triples):
                    mine = t[i]
                    parts |= {
                        f"A.{j}": mine.A.numpy(),
                        f"b.{j}": mine.b.numpy(),
                        f"c.{j}": mine.c.numpy(),
                    }
                contents[int(self.servers[s]["node"])] = RecordDict(
                    {"fedattr": config(fields), "triples": arrays(parts)}
                )
            replies = self._ask("query.sealed_open", contents, "a share server")
            return {
                s: dict(replies[int(self.servers[s]["node"])].content.config_records["fedattr"])
                for s in SERVERS
            }

        # 3. Two phases: each server's opening, sealed to the other, relayed; then its results.
        first = phase(1, lambda _s: {})
        peer = {s: SERVERS[1 - i] for i, s in enumerate(SERVERS)}
        second = phase(
            2,
            lambda s: {
                f"env.peer.{j}": first[peer[s]][f"env.open.{j}"] for j in range(len(owners))
            },
        )
        # 4. Each owner opens what the servers sealed to it and publishes its p-values.
        asked = {}
        for j, o in enumerate(owners):
            fields = {
                "index": j,
                "clients": [int(c) for c in clients],
                "keys": opening.keys,
                "frac_bits": opening.frac_bits,
                **{f"env.result.{s}": second[s][f"env.result.{j}"] for s in SERVERS},
                **{f"env.random.{s}": first[s][f"env.random.{j}"] for s in SERVERS},
            }
            asked[int(self.owner_nodes[o]["node"])] = RecordDict({"fedattr": config(fields)})
        published = self._ask("query.sealed_verdict", asked, "an owner")
        for o in owners:
            rec = published[int(self.owner_nodes[o]["node"])].content.config_records["fedattr"]
            verdicts.p[o] = np.asarray(rec["p"], dtype=np.float64)
            verdicts.Z[o] = np.asarray(rec["Z"], dtype=np.float64)
        self.exchanged = sum(
            len(v)
            for fields in [*first.values(), *second.values()]
            for v in fields.values()
            if isinstance(v, bytes)
        )
        cells = {o: d["cells"] for o, d in zip(owners, described, strict=True)}
        cost = {
            "opening_bytes": opening_bytes(len(clients), cells, opening.keys),
            "cells": cells,
            "triples_dealt": dealer.dealt,
            "seconds": time.perf_counter() - t0,
            "sealed_envelope_bytes": self.exchanged,
        }
        return verdicts, cost

    def state(self) -> dict:
        return {"seen": sorted(self.seen), "reads": self._reads, "last": self.last}

    def load(self, state: dict) -> None:
        self.seen, self._reads = set(state["seen"]), int(state["reads"])
        self.last = state["last"]
