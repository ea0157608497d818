"""What a round's released linear combinations reveal, and a policy that bounds it.

Every answer of secure aggregation in a round is a linear combination ``sum_j r_j Delta_j`` of
the same K updates, with a coefficient row ``r`` the answering party knows. Let ``P`` be the
projector onto the span of the answered rows. Client j's update is *exactly recoverable* when
``e_j`` lies in that span (``||P e_j||^2 = 1``); otherwise, modelling the updates as independent
isotropic Gaussians, the answers carry

    L_j = -1/2 log(1 - ||P e_j||^2)   nats per effective dimension

about ``Delta_j``. For one released FedAttr estimate (row ``e_i + alpha``) this is
``1/2 log(1 + 1/c_i)``: the Gaussian term of the paper's Theorem 4, which this generalises to
any set of joint releases. The rank decisions are :mod:`fedattr.linalg`'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..linalg import EXACT_TOL, row_space_basis
from .errors import QueryRefused


def projection_weights(rows: np.ndarray) -> np.ndarray:
    """``||P e_j||^2`` for every column j, with P the projector onto the rows' span."""
    if rows.size == 0:
        return np.zeros(rows.shape[1] if rows.ndim == 2 else 0)
    basis = row_space_basis(rows)
    return np.clip(np.sum(basis**2, axis=0), 0.0, 1.0)


def leakage_nats(weight: float) -> float:
    """``-1/2 log(1 - w)``; infinite at exact recovery."""
    if weight >= 1.0 - EXACT_TOL:
        return math.inf
    return -0.5 * math.log1p(-weight)


def joint_leakage(rows: np.ndarray) -> np.ndarray:
    """``L_j`` (nats per effective dimension) for every client column of ``rows``."""
    return np.array([leakage_nats(w) for w in projection_weights(rows)])


@dataclass
class ReleasePolicy:
    """Refuses a release that would make a client exactly recoverable or exceed ``budget``.

    Held by the party that unmasks (clients in pairwise-mask, each aggregator in two-server),
    which keeps the round's answered rows itself, so the limit does not depend on the server's
    goodwill. ``budget = inf`` forbids exact recovery only.
    """

    budget: float = math.inf
    clients: tuple[int, ...] = ()
    rows: list[np.ndarray] = field(default_factory=list)

    def reset(self, clients: Sequence[int]) -> None:
        """Start a round over ``clients`` with nothing released."""
        self.clients = tuple(clients)
        self.rows = []

    def _row(self, coefficients: Mapping[int, float]) -> np.ndarray:
        index = {c: k for k, c in enumerate(self.clients)}
        row = np.zeros(len(self.clients))
        for c, v in coefficients.items():
            row[index[c]] = v
        return row

    def leakage_if(self, coefficients: Mapping[int, float]) -> dict[int, float]:
        """Every client's ``L_j`` if this combination were released too."""
        rows = np.vstack([*self.rows, self._row(coefficients)])
        return dict(zip(self.clients, joint_leakage(rows).tolist(), strict=True))

    def check(self, coefficients: Mapping[int, float]) -> None:
        """Raise :class:`QueryRefused` if releasing this combination breaks the policy."""
        after = self.leakage_if(coefficients)
        worst = max(after, key=after.__getitem__)
        if math.isinf(after[worst]):
            raise QueryRefused(
                f"query refused by the release policy: with it, client {worst}'s update would be "
                f"exactly recoverable from this round's {len(self.rows) + 1} answers"
            )
        if after[worst] > self.budget + 1e-12:
            raise QueryRefused(
                f"query refused by the release policy: client {worst}'s joint leakage would be "
                f"{after[worst]:.4f} nats per dimension, above the budget {self.budget:.4f}"
            )

    def record(self, coefficients: Mapping[int, float]) -> None:
        """Remember an answered combination."""
        self.rows.append(self._row(coefficients))

    def leakage(self) -> dict[int, float]:
        """Every client's ``L_j`` over what has been released so far."""
        if not self.rows:
            return dict.fromkeys(self.clients, 0.0)
        return dict(zip(self.clients, joint_leakage(np.vstack(self.rows)).tolist(), strict=True))


class SessionLedgers:
    """One :class:`ReleasePolicy` ledger per SA session of a round, held by an unmasking party.

    Queries outside any session (``""``: e.g. the round's training aggregate) are released to
    everyone and count in every session's ledger; each named session (one attribution
    configuration watching the run) adds its own answers to its own ledger only. Several
    sessions on one round are a measurement device (two FedAttr configurations on one training
    run): a deployment runs one session per round, and then this is exactly one ledger. The
    session in force is :attr:`active`, part of the query announcement like the query id.
    """

    def __init__(self, budget: float = math.inf) -> None:
        self.budget = budget
        self.active = ""
        self.clients: tuple[int, ...] = ()
        self._ledgers: dict[str, ReleasePolicy] = {}

    def reset(self, clients: Sequence[int]) -> None:
        """Start a round over ``clients`` with nothing released in any session."""
        self.clients = tuple(clients)
        self._ledgers = {"": self._new()}

    def _new(self) -> ReleasePolicy:
        policy = ReleasePolicy(self.budget)
        policy.reset(self.clients)
        return policy

    def ledger(self) -> ReleasePolicy:
        """The active session's ledger (public releases included)."""
        if self.active not in self._ledgers:
            policy = self._new()
            policy.rows = list(self._ledgers[""].rows)
            self._ledgers[self.active] = policy
        return self._ledgers[self.active]

    def check(self, coefficients: Mapping[int, float]) -> None:
        """:meth:`ReleasePolicy.check` in the active session."""
        self.ledger().check(coefficients)

    def record(self, coefficients: Mapping[int, float]) -> None:
        """Remember an answered combination (outside a session: in every ledger)."""
        if self.active == "":
            for policy in self._ledgers.values():
                policy.record(coefficients)
        else:
            self.ledger().record(coefficients)

    def leakage(self) -> dict[int, float]:
        """:meth:`ReleasePolicy.leakage` in the active session."""
        return self.ledger().leakage()

    def to_dict(self) -> dict:
        """JSON-ready state (a client whose process restarts between messages keeps this)."""
        return {
            "budget": None if math.isinf(self.budget) else self.budget,
            "clients": list(self.clients),
            "ledgers": {name: [r.tolist() for r in p.rows] for name, p in self._ledgers.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> SessionLedgers:
        """Inverse of :meth:`to_dict` (the active session is ``""``)."""
        out = cls(math.inf if d["budget"] is None else float(d["budget"]))
        out.reset([int(c) for c in d["clients"]])
        for name, rows in d["ledgers"].items():
            policy = out._new()
            policy.rows = [np.asarray(r, dtype=float) for r in rows]
            out._ledgers[name] = policy
        return out
