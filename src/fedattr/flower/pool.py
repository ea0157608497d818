"""The client pool whose clients are Flower SuperNodes."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ..errors import UserError
from ..fl.pool import ClientPool, require_usable_examples
from ..fl.progress import Progress
from ..fl.timing import Stopwatch
from ..secagg.aggregator import SecureAggregator
from ..secagg.remote_server import RemoteMaskingServer
from .link import FlowerLink
from .pinned_client import round_digest
from .records import state_record, unarrays
from .sealed import FlowerParties


class FlowerPool(ClientPool):
    """Clients on SuperNodes: the pool sends ``train`` and registers each answering client's
    public key and layout with SA; a client that does not answer in time is offline for the
    round (the round goes on with the others)."""

    def __init__(
        self,
        link: FlowerLink,
        sizes: Sequence[int],
        send_state: bool = True,
        sealed: FlowerParties | None = None,
    ) -> None:
        require_usable_examples(sizes)
        self.link, self._sizes, self.send_state = link, list(sizes), send_state
        self.sealed = sealed
        """The sealed mode's parties: each client also sends them its reading shares."""

    @property
    def num_clients(self) -> int:
        return len(self._sizes)

    def data_sizes(self) -> list[int]:
        return list(self._sizes)

    def train_round(
        self,
        round_id: int,
        participants: Sequence[int],
        state: Any,
        sa: SecureAggregator,
        scales: dict[int, float],
        progress: Progress,
        timing: Stopwatch | None = None,
    ) -> dict[int, float]:
        if not isinstance(sa, RemoteMaskingServer):
            raise UserError(
                f"secagg.backend: Flower clients mask their own updates; allowed: pairwise-mask "
                f"(got {sa.name})"
            )
        progress(f"round {round_id}: training on {len(participants)} SuperNodes")
        extra = None
        if self.sealed is not None:
            extra = self.sealed.train_fields(state)
            # What the clients sign their round keys and seal their shares under (clients with
            # a directory): the state as sent, and the participants.
            sent = unarrays(state_record(state)) if self.send_state else {}
            self.sealed.agreed = round_digest(sent, participants)
        replies = self.link.train(round_id, participants, state, scales, self.send_state, extra)
        losses: dict[int, float] = {}
        for c in participants:
            reply = replies.get(c)
            if reply is None:
                self.link.refused(c, f"round {round_id}")
                progress(f"round {round_id}: client {c} did not answer; offline for the round")
                sa.drop(c)
                continue
            sa.register(c, bytes(reply["public_key"]), json.loads(str(reply["layout"])))
            # A client with a directory signs its key; the others check it in every query.
            self.link.key_signatures.pop(c, None)
            if "sa_signature" in reply:
                self.link.key_signatures[c] = bytes(reply["sa_signature"])
            if self.sealed is not None:
                self.sealed.receive(c, reply)
            if "loss" in reply:
                losses[c] = float(reply["loss"])
            if timing is not None:
                for key in ("train_tokens", "train_steps"):
                    if key in reply:
                        timing.count(key, int(reply[key]))
        return losses
