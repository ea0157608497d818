"""The server's side of the Flower messages: who is which client, and one exchange per step.

:class:`FlowerLink` sends each step's messages to every addressed SuperNode at once and waits
for the replies up to ``timeout`` seconds (a node that has not answered by then, or answered
with an error, counts as not answering: its queries fail with nothing released, as in-process).
It is the :class:`~fedattr.secagg.transport.Transport` of the run's
:class:`~fedattr.secagg.remote_server.RemoteMaskingServer`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

from ..errors import UserError
from ..secagg.wire import BatchReply, QueryBatch
from .records import config, state_record, unarrays

Say = Callable[[str], None]


class FlowerLink:
    """Messages between the ServerApp and the clients' SuperNodes."""

    def __init__(
        self, grid: Grid, timeout: float, say: Say | None = None, poll: float = 0.1
    ) -> None:
        if not timeout > 0:
            raise UserError(f"timeout: must be > 0 seconds, got {timeout}")
        self.grid, self.timeout, self.poll = grid, float(timeout), poll
        self.say = say or (lambda _msg: None)
        self.node_of: dict[int, int] = {}
        self.parties: dict[tuple[str, str], dict[str, Any]] = {}
        """(role, name) -> what a SuperNode that is not a client registered (``node``, its
        ``public_key``): the sealed mode's share servers and owners."""
        self.messages = 0
        self.seconds: dict[str, float] = {}
        """Wall time per message type (sending to the last reply)."""
        self.errors: dict[int, str] = {}
        """Node id -> the last line of its last error reply."""
        self.key_signatures: dict[int, bytes] = {}
        """Client -> its signature of this round's secure-aggregation key (clients with a
        directory), relayed with the key in every query."""
        self.sizes: dict[int, int] = {}
        self.size_signatures: dict[int, bytes] = {}
        """Client -> its signature of its data size (clients with a directory), relayed with
        the participants' sizes in every ``train`` message, so each checks its own scale."""

    def refused(self, client: int, what: str) -> None:
        """Stop the run in one line where client ``client``'s last error is a refusal (its
        checks, e.g. a directory's: a misconfiguration or a lying coordinator) or a setting it
        cannot work with (a ``UserError``, e.g. a garbled ledger), rather than carry on as if it
        had dropped out."""
        reason = self.errors.get(self.node_of.get(client, -1), "")
        if any(name in reason for name in ("QueryRefused", "SecAggError", "UserError")):
            raise UserError(f"flower: client {client} refused {what}: {reason}")

    def wait_for_nodes(self, count: int, wait: float) -> list[int]:
        """Node ids once ``count`` SuperNodes are connected (at most ``wait`` seconds)."""
        deadline = time.monotonic() + wait
        while True:
            nodes = sorted(self.grid.get_node_ids())
            if len(nodes) >= count or time.monotonic() > deadline:
                return nodes
            time.sleep(0.5)

    def _exchange(
        self, kind: str, group: str, contents: Mapping[int, RecordDict], by_node: bool = False
    ) -> dict[int, Message]:
        """Send ``contents[c]`` to client ``c``'s node (to node ``c`` with ``by_node``)."""
        start = time.perf_counter()
        messages = [
            Message(
                content,
                dst_node_id=c if by_node else self.node_of[c],
                message_type=kind,
                group_id=group,
            )
            for c, content in contents.items()
        ]
        for m in messages:  # a node's errors are this exchange's, not an earlier one's
            self.errors.pop(m.metadata.dst_node_id, None)
        # Replies are matched to requests by message id: an error the SuperLink generates for
        # an unreachable node does not carry that node's id.
        ids = [str(i) for i in self.grid.push_messages(messages)]
        recipients = dict(zip(ids, contents, strict=True))
        replies = self._pull(set(recipients))
        self.messages += len(messages)
        self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - start
        out: dict[int, Message] = {}
        for reply in replies:
            who = recipients.get(reply.metadata.reply_to_message_id)
            if who is None:
                continue
            node = who if by_node else self.node_of[who]
            if reply.has_error():
                reason = str(reply.error.reason).strip().splitlines()
                self.errors[node] = reason[-1] if reason else f"error code {reply.error.code}"
                self.say(f"{kind}: node {node} answered with an error: {self.errors[node]}")
                continue
            out[who] = reply
        return out

    def _pull(self, pending: set[str]) -> list[Message]:
        """Pull every ``poll`` seconds until every reply is in or the timeout passes
        (``Grid.send_and_receive`` pulls every 3 s, which adds up over a run)."""
        deadline = time.monotonic() + self.timeout
        replies: list[Message] = []
        while pending:
            got = list(self.grid.pull_messages(sorted(pending)))
            replies += got
            pending = pending - {m.metadata.reply_to_message_id for m in got}
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(self.poll)
        return replies

    def register(
        self, command: str, config_json: str, clients: int, wait: float, parties: int = 0
    ) -> list[int]:
        """Send the configuration to every node; map client ids to nodes (and the ``parties``
        other SuperNodes to their roles); return the clients' example counts (client order)."""
        nodes = self.wait_for_nodes(clients + parties, wait)
        if len(nodes) != clients + parties:
            others = f" and {parties} for the sealed mode's parties" if parties else ""
            raise UserError(
                f"fl.K: the run has {clients} clients but {len(nodes)} SuperNodes are connected "
                f"after {wait:.0f} s; start one SuperNode per client "
                f"(partition-id 0..{clients - 1}){others}"
            )
        content = {"command": command, "config": config_json}
        replies = self._exchange(
            "query.register",
            "0",
            {n: RecordDict({"fedattr": config(content)}) for n in nodes},
            by_node=True,
        )
        failed = {n: self.errors[n] for n in nodes if n not in replies and n in self.errors}
        if failed:
            node, reason = next(iter(failed.items()))
            raise UserError(f"flower: SuperNode {node} could not register: {reason}")
        missing = sorted(set(nodes) - set(replies))
        if missing:
            raise UserError(
                f"flower: SuperNodes {missing} did not register within the timeout "
                f"({self.timeout:.0f} s); see their logs"
            )
        sizes: dict[int, int] = {}
        for node, reply in replies.items():
            rec = reply.content.config_records["fedattr"]
            role = str(rec.get("role", "client"))
            if role != "client":
                who = (role, str(rec["name"]))
                if who in self.parties:
                    raise UserError(f"role: two SuperNodes play {role} {who[1]}; one each")
                self.parties[who] = {
                    "node": node,
                    "public_key": bytes(rec["public_key"]),
                    "documents": str(rec.get("documents", "")),
                }
                continue
            client = int(rec["client"])
            if client in self.node_of:
                raise UserError(
                    f"partition-id: {client} is served by two SuperNodes "
                    f"({self.node_of[client]} and {node}); each needs its own id"
                )
            self.node_of[client] = node
            sizes[client] = int(rec["size"])
            if "size_signature" in rec:
                self.size_signatures[client] = bytes(rec["size_signature"])
        if sorted(sizes) != list(range(clients)):
            raise UserError(
                f"partition-id: the SuperNodes serve clients {sorted(sizes)}; "
                f"allowed: each of 0..{clients - 1} once"
            )
        self.say(
            f"{clients} clients registered: "
            + ", ".join(f"{c}->node {self.node_of[c]}" for c in sorted(self.node_of))
            + "".join(f"; {r} {n}->node {i['node']}" for (r, n), i in sorted(self.parties.items()))
        )
        self.sizes = dict(sizes)
        return [sizes[c] for c in range(clients)]

    def call(self, kind: str, contents: Mapping[int, RecordDict]) -> dict[int, Message]:
        """One message to each node of ``contents`` (node id -> content); replies by node (a
        node that answered with an error, or not in time, is missing; see :attr:`errors`)."""
        return self._exchange(kind, kind, contents, by_node=True)

    def train(
        self,
        round_id: int,
        participants: Sequence[int],
        state: Any,
        scales: Mapping[int, float],
        send_state: bool,
        extra: Mapping[str, Any] | None = None,
    ) -> dict[int, dict]:
        """One ``train`` message per participant (``extra`` fields added to each); the
        replies' fields by client."""
        contents = {}
        for c in participants:
            fields = {
                "round": round_id,
                "scale": float(scales[c]),
                "participants": [int(p) for p in participants],
                **(extra or {}),
            }
            for p in participants:  # every participant's signed size, where it signed one
                if p in self.size_signatures:
                    fields[f"size.{p}"] = int(self.sizes[p])
                    fields[f"size_sig.{p}"] = self.size_signatures[p]
            records = {"fedattr": config(fields)}
            if send_state:
                records["state"] = state_record(state)
            contents[c] = RecordDict(records)
        replies = self._exchange("train", str(round_id), contents)
        return {c: dict(r.content.config_records["fedattr"]) for c, r in replies.items()}

    def ask(self, batch: QueryBatch, recipients: Sequence[int]) -> dict[int, BatchReply]:
        """The :class:`~fedattr.secagg.transport.Transport` call: one ``query.sa_batch`` per
        recipient holding the whole batch."""
        fields: dict[str, Any] = {"round": batch.round, "queries": batch.plan_json()}
        fields.update({f"pk.{c}": key for c, key in batch.public_keys.items()})
        fields.update(
            {
                f"sig.{c}": self.key_signatures[c]
                for c in batch.public_keys
                if c in self.key_signatures
            }
        )
        contents = {c: RecordDict({"fedattr": config(fields)}) for c in recipients}
        replies = self._exchange("query.sa_batch", str(batch.round), contents)
        for c in recipients:
            if c not in replies:
                self.refused(c, f"the sums of round {batch.round}")
        out = {}
        for c, reply in replies.items():
            rec = reply.content.config_records["fedattr"]
            masked = reply.content.array_records.get("masked")
            out[c] = BatchReply(
                {int(k): v for k, v in (unarrays(masked) if masked is not None else {}).items()},
                {int(k): v for k, v in json.loads(str(rec["refused"])).items()},
                {int(k): float(v) for k, v in json.loads(str(rec["seconds"])).items()},
            )
        return out
