"""Pairwise-mask secure aggregation (Bonawitz et al., CCS'17), run once per subset query.

Each client holds an X25519 key pair per round; the server only relays public keys. For a query
``(round, query_id, W)`` every member ``j`` of ``W`` uploads

    y_j = enc(Delta_j) + sum_{k in W, k > j} PRG(s_jk) - sum_{k in W, k < j} PRG(s_jk)  (mod 2^b)

where ``s_jk = HKDF(X25519(sk_j, pk_k), info=(round, query_id, j, k))``. Members add masks only
for pairs inside ``W``, so the masks cancel exactly in ``sum_j y_j`` and the server learns
``enc(S(W))`` and nothing else; a new query id gives fresh, unrelated masks, so two uploads of
the same client can never be subtracted to strip its mask.

Bonawitz's self-masks and Shamir shares exist to *recover* a sum when members drop out; here a
member that does not answer makes the query fail and nothing is released, so plain pairwise
masks suffice for a server that follows the protocol (the honest-but-curious model of FedAttr).

The simulation keeps the two sides apart: :class:`PairwiseMaskServer` is everything the server
holds (public keys and the masked uploads of the current query); :class:`MaskingClient` objects
are the clients' machines, which alone hold their updates and private keys.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import numpy as np
import torch
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .aggregator import SecureAggregator
from .errors import QueryFailed, SecAggError
from .fixedpoint import FixedPointCodec
from .prg import PRG_NAMES, masked

if TYPE_CHECKING:
    from .config import SecAggConfig
    from .policy import SessionLedgers

_HKDF_SALT = b"fedattr/secagg/pairwise-mask/v1"


def pair_seed(shared_secret: bytes, round_id: int, query_id: int, a: int, b: int) -> bytes:
    """32-byte PRG seed for pair ``{a, b}`` bound to one (round, query)."""
    lo, hi = (a, b) if a < b else (b, a)
    info = f"round={round_id};query={query_id};pair={lo},{hi}".encode()
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=_HKDF_SALT, info=info).derive(
        shared_secret
    )


class MaskingClient:
    """A client's side of the protocol: its private key and its encoded update."""

    def __init__(
        self,
        client_id: int,
        codec: FixedPointCodec,
        prg: str,
        device: torch.device,
        private_key: bytes | None = None,
    ) -> None:
        self.client_id = client_id
        self._codec = codec
        self._prg = prg
        self._device = device
        # A client whose process restarts between messages (Flower) brings its raw key back.
        self._private = (
            X25519PrivateKey.generate()
            if private_key is None
            else X25519PrivateKey.from_private_bytes(private_key)
        )
        self._secrets: dict[int, bytes] = {}
        self._encoded: torch.Tensor | None = None

    @property
    def public_key(self) -> bytes:
        """Raw 32-byte X25519 public key, sent to the server for relay."""
        return self._private.public_key().public_bytes_raw()

    @property
    def private_key(self) -> bytes:
        """Raw 32-byte X25519 private key (for the client's own storage only)."""
        return self._private.private_bytes_raw()

    def hold(self, flat: np.ndarray) -> None:
        """Encode and keep this round's update (it never leaves the client unmasked)."""
        self._encoded = self._codec.encode(flat, self._device)

    def masked_input(
        self,
        round_id: int,
        query_id: int,
        members: Sequence[int],
        public_keys: dict[int, bytes],
        coefficient: int = 1,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The client's upload for one query over ``members`` (which must include it).

        ``coefficient`` scales the encoded update in the ring (exact for integers, negative
        ones included), for fused queries. ``out``: a spare buffer to write the upload into.
        """
        if self._encoded is None:
            raise SecAggError(f"client {self.client_id} holds no update this round")
        if self.client_id not in members:
            raise SecAggError(f"client {self.client_id} was asked to join a query it is not in")
        others = [k for k in members if k != self.client_id]
        seeds = []
        for other in others:
            secret = self._secrets.get(other)
            if secret is None:
                peer = X25519PublicKey.from_public_bytes(public_keys[other])
                secret = self._secrets[other] = self._private.exchange(peer)
            seeds.append(pair_seed(secret, round_id, query_id, self.client_id, other))
        signs = [1 if self.client_id < other else -1 for other in others]
        # Integer scaling in the ring: wrapping multiplication by a signed coefficient is
        # multiplication by its residue modulo 2^b.
        return masked(self._encoded, coefficient, seeds, signs, self._prg, out=out)


def _ring_add(total: torch.Tensor, y: torch.Tensor) -> None:
    """``total += y`` in the ring. On the CPU through NumPy (wrapping, single-threaded): a torch
    op here would wake torch's intra-op threads, whose spin-waiting takes the cores the
    members' ciphers run on."""
    if total.device.type == "cpu" and total.is_contiguous() and y.is_contiguous():
        np.add(total.numpy(), y.numpy(), out=total.numpy())
    else:
        total += y


class PairwiseMaskServer:
    """The server's side: public keys and the masked uploads of one query, nothing more."""

    def __init__(self) -> None:
        self.public_keys: dict[int, bytes] = {}

    def run_query(
        self,
        round_id: int,
        query_id: int,
        members: tuple[int, ...],
        collect: Callable[..., torch.Tensor],
        pool: ThreadPoolExecutor | None = None,
        workers: int = 1,
        recycle: Callable[[torch.Tensor], None] | None = None,
    ) -> tuple[torch.Tensor, int]:
        """Announce the query, collect every member's masked upload, return their ring sum.

        Members are separate machines that mask at the same time: ``workers`` threads of
        ``pool`` (or the caller alone) each take the next member's upload and add it into
        the sum as it arrives (one add at a time; the ring sum is exact, so the order does
        not matter): besides the sum, at most one upload per thread is held. ``recycle``
        gets each upload back once it is in the sum. The server never sees coefficients
        applied: each member scales its own input."""
        waiting = iter(members)
        taking, adding = threading.Lock(), threading.Lock()
        failed = threading.Event()  # one thread's error stops the others taking members
        sums: list[torch.Tensor] = []  # the ring sum, once the first upload is in

        def next_member() -> int | None:
            with taking:
                return None if failed.is_set() else next(waiting, None)

        def upload_some() -> int:
            moved = 0
            try:
                while (j := next_member()) is not None:
                    y = collect(j, round_id, query_id, members, self.public_keys)
                    moved += y.numel() * y.element_size()
                    with adding:
                        first = not sums
                        if first:
                            sums.append(y)
                        else:
                            _ring_add(sums[0], y)
                    if not first and recycle is not None:
                        recycle(y)
            except BaseException:
                failed.set()
                raise
            return moved

        workers = 1 if pool is None else max(1, min(workers, len(members)))
        if pool is None or workers == 1:
            moved = upload_some()
        else:
            tasks = [pool.submit(upload_some) for _ in range(workers)]
            wait(tasks)  # every thread is done with this query's buffers before anything else
            moved = sum(task.result() for task in tasks)
        if not sums:
            raise SecAggError("run_query: a query needs at least one member")
        return sums[0], moved


class PairwiseMaskAggregator(SecureAggregator):
    """Pairwise additive masks from X25519 + HKDF + a stream-cipher PRG; masks cancel in S(W)."""

    name = "pairwise-mask"

    def __init__(
        self,
        min_members: int = 2,
        codec: FixedPointCodec | None = None,
        release_budget: float | None = None,
        prg: str = "chacha20",
        dropout: float = 0.0,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(min_members, codec, release_budget)
        self.device = torch.device(device)
        if not 0.0 <= dropout < 1.0:
            raise SecAggError(f"dropout: must be in [0, 1), got {dropout}")
        self.dropout = dropout
        self._dropout_rng = np.random.default_rng([seed, 0xD509])
        if prg not in PRG_NAMES:
            raise SecAggError(f"prg: unknown generator {prg!r}; allowed: {', '.join(PRG_NAMES)}")
        self.prg = prg
        self.server = PairwiseMaskServer()
        self._parties: dict[int, MaskingClient] = {}
        self._client_seconds: list[float] = []
        self._coefs: dict[int, int] = {}
        # Upload buffers handed back after the server summed them: the simulation's transport
        # reuses their memory instead of faulting in fresh pages for every upload.
        self._spare: list[torch.Tensor] = []
        # The release policy lives with the clients: each member consults the same record of
        # what this round has released (a client-side ledger), not the server.
        self._client_policy: SessionLedgers | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pool_workers = 0

    @classmethod
    def _options(cls, config: SecAggConfig) -> dict:
        return {
            "prg": config.resolved_prg(),
            "dropout": config.dropout,
            "seed": config.seed,
            "device": config.torch_device(),
        }

    def _start_round(self, round_id, client_ids) -> None:
        # Fresh key pairs every round (forward secrecy between rounds, as in Bonawitz et al.).
        self._spare = []
        self._parties = {c: MaskingClient(c, self.codec, self.prg, self.device) for c in client_ids}
        self.server.public_keys = {c: p.public_key for c, p in self._parties.items()}
        self._client_policy = self._policy
        self._policy = None  # the server-side object enforces nothing
        if self._client_policy is not None:
            self._client_policy.active = self._session

    def _ledgers(self):
        return [] if self._client_policy is None else [self._client_policy]

    def _authorize(self, members, coefs) -> None:
        if self._client_policy is not None:
            self._client_policy.check(dict(zip(members, coefs, strict=True)))

    def _answered(self, members, coefs) -> None:
        if self._client_policy is not None:
            self._client_policy.record(dict(zip(members, coefs, strict=True)))

    def _receive(self, client_id: int, flat: np.ndarray) -> None:
        self._parties[client_id].hold(flat)

    def _collect(self, client_id, round_id, query_id, members, public_keys) -> torch.Tensor:
        start = time.perf_counter()
        try:
            out = self._spare.pop()  # list.pop is atomic: safe from the server's threads
        except IndexError:
            out = None
        y = self._parties[client_id].masked_input(
            round_id, query_id, members, public_keys, self._coefs.get(client_id, 1), out=out
        )
        if y.device.type == "cuda":
            torch.cuda.synchronize(y.device)  # the client's time includes its kernels
        self._client_seconds.append(time.perf_counter() - start)
        return y

    def _combine(self, members, coefs, query_id):
        # Who fails to answer this query: offline clients, plus transient failures at rate
        # `dropout`. The server has then received some masked uploads, but their sum still
        # carries the missing members' masks: it is useless, so it is discarded, not released.
        transient = self._dropout_rng.random(len(members)) < self.dropout
        missing = tuple(
            j for j, t in zip(members, transient, strict=True) if j in self._offline or t
        )
        if missing:
            raise QueryFailed(
                f"query failed: members {list(missing)} did not answer; no sum was released",
                missing,
            )
        self._client_seconds = []
        self._coefs = dict(zip(members, coefs, strict=True))
        # The cipher releases the GIL, so the members' masking runs on every core torch may use
        # (threads kept between queries: starting them cost about 1 ms a query).
        workers = torch.get_num_threads()
        if workers > 1 and self._pool_workers != workers:
            self._pool = ThreadPoolExecutor(workers, thread_name_prefix="fedattr-sa")
            self._pool_workers = workers
        assert self.round is not None  # _authorize refused a query outside an open round
        ring_sum, moved = self.server.run_query(
            self.round,
            query_id,
            members,
            self._collect,
            pool=self._pool,
            workers=workers,
            recycle=self._spare.append,
        )
        moved += 32 * len(members) * (len(members) - 1)  # public keys relayed to members
        decoded = self.codec.decode(ring_sum)
        self._spare.append(ring_sum)
        return decoded, moved, max(self._client_seconds)

    def _drop_round(self) -> None:
        self._parties = {}
        self._spare = []
        self.server.public_keys = {}
