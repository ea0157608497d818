"""What a run's secure-aggregation answers reveal ACROSS rounds (the per-round audit stacked).

The release policy and :mod:`.audit` account per round. A server that keeps every round's
answers can do more: model each client's update as a persistent mean plus round noise,

    Delta_j^t = mu_j + eps_j^t,   eps_j^t independent, mean 0, covariance sigma^2 I,

and solve for ``mu`` from all rounds at once. Round t's answers are ``Y_t = A_t Delta^t`` (the
rows of ``A_t``: the round's released coefficient rows, the public aggregate included). They
are exact linear functions of the same updates, so all the round tells about ``Delta^t`` is its
projection ``P_t Delta^t`` on the row space of ``A_t`` (``P_t = A_t^+ A_t``), with covariance
``sigma^2 P_t``. The best linear unbiased estimate of ``mu`` (generalised least squares, GLS)
solves

    F mu = sum_t A_t^+ Y_t,    F = sum_t P_t,

so, from the query log alone (no answer needed):

- ``mu_j`` is *identifiable across rounds* iff ``e_j`` lies in the range of ``F``, which is the
  row space of the stacked design ``[A_1; ...; A_T]``: possible when no single round's rows
  contain ``e_j`` (the multi-round attack on secure aggregation that differences aggregates);
- its estimate's variance is ``sigma^2 [F^+]_jj``: the *variance factor*. A client exactly
  recoverable in each of its ``T_j`` rounds has ``1/T_j``, so ``1 / [F^+]_jj`` reads as the
  number of plain updates the answers are worth.

A per-round term common to every client (``Delta_j^t = mu_j + c_t + eps_j^t``) costs GLS
nothing when the public aggregate is released every round: the all-ones row lies in every
``P_t``, so ``c_t`` passes into the estimate exactly as into the mean over rounds.

:class:`CrossRoundAttack` runs the attack inside a simulation, on the answers the server
receives (an :attr:`~fedattr.secagg.SecureAggregator.answer_taps` hook), and measures it
against the true mean updates; plain stacked least squares (OLS) is run beside GLS.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from ..fl.server import Observer, RoundContext, RoundEngine
from ..linalg import EXACT_TOL, StackedGLS, in_range, psd_pinv, row_space_basis
from ..secagg.queries import QueryRecord
from .audit import round_designs


@dataclass
class CrossRoundAudit:
    """One SA session over all rounds: what the stacked answers identify, per client."""

    session: str
    rounds: int
    """Rounds with released answers."""
    clients: list[int]
    rank: int
    """Rank of the stacked design (of ``F``)."""
    identifiable: list[int]
    """Clients whose mean update is identifiable from all rounds' answers."""
    recoverable_in_a_round: list[int]
    """Clients exactly recoverable in at least one single round (the per-round audit)."""
    rounds_present: dict[int, int]
    """Rounds in which the client is in some released row."""
    variance_factor: dict[int, float]
    """``[F^+]_jj`` for identifiable clients (GLS variance over ``sigma^2``), else ``inf``."""
    reconstruction: dict[str, Any] | None = None
    """The attack measured in the simulation (``results.json`` ``cross_round``), if any."""

    @property
    def only_across_rounds(self) -> list[int]:
        """Identifiable from the stacked rounds though no single round recovers them."""
        return [c for c in self.identifiable if c not in self.recoverable_in_a_round]

    def to_dict(self) -> dict:
        """JSON-ready form (infinite variance factors written as the string "inf")."""
        d = asdict(self)
        d["variance_factor"] = {
            str(k): (v if math.isfinite(v) else "inf") for k, v in self.variance_factor.items()
        }
        d["rounds_present"] = {str(k): v for k, v in self.rounds_present.items()}
        d["only_across_rounds"] = self.only_across_rounds
        return d


def audit_cross_round(
    queries: Iterable[Mapping], clients: Iterable[int] | None = None
) -> list[CrossRoundAudit]:
    """Stack every round's released rows, per SA session (with the public answers, as the
    per-round audit does): identifiability and GLS variance factor of each mean update.

    ``clients``: the ids of the federation; by default everyone in some released row.
    """
    per_session: dict[str, list[tuple[list[int], np.ndarray]]] = {}
    for _, session, _, ids, rows in round_designs(list(queries)):
        per_session.setdefault(session, []).append((ids, rows))
    if len(per_session) > 1 and "" in per_session:
        # A round where no session asked released only public rows: every session saw them.
        public = per_session.pop("")
        for designs in per_session.values():
            designs.extend(public)
    out = []
    for session, designs in sorted(per_session.items()):
        ids = sorted(set(clients) if clients is not None else {c for i, _ in designs for c in i})
        index = {c: k for k, c in enumerate(ids)}
        f = np.zeros((len(ids), len(ids)))
        present = dict.fromkeys(ids, 0)
        exact: set[int] = set()
        for round_ids, rows in designs:
            basis = row_space_basis(rows)
            cols = [index[c] for c in round_ids]
            f[np.ix_(cols, cols)] += basis.T @ basis
            weights = np.sum(basis**2, axis=0)
            for c, w, used in zip(round_ids, weights, np.any(rows != 0, axis=0), strict=True):
                present[c] += int(used)
                if w >= 1.0 - EXACT_TOL:
                    exact.add(c)
        ok = in_range(f) if ids else np.zeros(0, dtype=bool)
        diag = np.diag(psd_pinv(f))
        out.append(
            CrossRoundAudit(
                session=session,
                rounds=len(designs),
                clients=ids,
                rank=len(row_space_basis(f)) if ids else 0,
                identifiable=[c for c, k in zip(ids, ok, strict=True) if k],
                recoverable_in_a_round=sorted(exact),
                rounds_present=present,
                variance_factor={
                    c: (float(diag[k]) if ok[k] else math.inf) for k, c in enumerate(ids)
                },
            )
        )
    return out


@dataclass
class _Stacked:
    """One session's running sums: GLS ``F`` (:class:`~fedattr.linalg.StackedGLS`) and
    ``sum A_t^+ Y_t``; OLS ``sum A^T A``, ``A^T Y``."""

    stack: StackedGLS
    gls: np.ndarray
    gram: np.ndarray
    ols: np.ndarray
    public_sum: np.ndarray
    """Per client: the sum of the public per-round mean updates of its rounds."""
    public_n: np.ndarray


def _plus(a: _Stacked, b: _Stacked) -> _Stacked:
    """The sums of two sets of rounds (every field is a sum over rounds)."""
    return _Stacked(*(getattr(a, f.name) + getattr(b, f.name) for f in fields(_Stacked)))


@dataclass
class CrossRoundAttack:
    """The server's cross-round reconstruction of every client's mean update, run on what it
    receives (the answers of released queries, the public aggregates included), measured
    against the true mean update over each client's rounds.

    Feed it :meth:`answer` (an ``answer_taps`` hook) and :meth:`close_round`; the plaintext
    updates given to :meth:`close_round` are ground truth only, never used by the attack.
    """

    num_clients: int
    _pending: list[tuple[QueryRecord, np.ndarray]] = field(
        default_factory=list, init=False, repr=False
    )
    _sessions: dict[str, _Stacked] = field(default_factory=dict, init=False, repr=False)
    _truth_sum: np.ndarray | None = field(default=None, init=False, repr=False)
    _truth_n: np.ndarray | None = field(default=None, init=False, repr=False)

    def answer(self, record: QueryRecord, total: np.ndarray) -> None:
        """One answered query: its record and result ``sum_j c_j Delta_j``."""
        self._pending.append((record, np.array(total, dtype=np.float64)))

    def close_round(self, truth: Mapping[int, np.ndarray]) -> None:
        """Fold the round's answers into every session's sums; ``truth``: the flat updates
        of the clients in the round's aggregate (for the error only)."""
        pending, self._pending = self._pending, []
        K = self.num_clients
        if truth:
            d = len(next(iter(truth.values())))
            if self._truth_sum is None:
                self._truth_sum, self._truth_n = np.zeros((K, d)), np.zeros(K)
            assert self._truth_n is not None
            for j, u in truth.items():
                self._truth_sum[j] += u
                self._truth_n[j] += 1
        if not pending:
            return
        d = len(pending[0][1])
        public = [
            (r, y)
            for r, y in pending
            if r.session == "" and set(r.coefficients or (1,)) == {1} and r.denominator == 1
        ]
        for session in {r.session for r, _ in pending} - {""} or {""}:
            rows_y = [(r, y) for r, y in pending if r.session in ("", session)]
            a = np.zeros((len(rows_y), K))
            for i, (r, _) in enumerate(rows_y):
                a[i, list(r.subset)] = r.coefficients or (1,) * len(r.subset)
            y = np.stack([v for _, v in rows_y])
            acc = self._sessions.get(session)
            if acc is None:
                z = np.zeros
                acc = _Stacked(
                    StackedGLS(range(K)), z((K, d)), z((K, K)), z((K, d)), z((K, d)), z(K)
                )
                self._sessions[session] = acc
            acc.gls += acc.stack.add(a) @ y
            acc.gram += a.T @ a
            acc.ols += a.T @ y
            # The reference guess: each client's update is the round's public mean update.
            for r, v in public[:1]:
                members = list(r.subset)
                acc.public_sum[members] += v / len(members)
                acc.public_n[members] += 1

    def results(self) -> dict[str, dict]:
        """Per session: per client whether identifiable, and the relative errors
        ``||mu_hat_j - mu_bar_j|| / ||mu_bar_j||`` of GLS, OLS and the public-mean guess,
        with their medians over clients (``results.json`` ``cross_round``)."""
        if self._truth_sum is None or self._truth_n is None:
            return {}
        seen = self._truth_n > 0
        truth = np.zeros_like(self._truth_sum)
        truth[seen] = self._truth_sum[seen] / self._truth_n[seen, None]
        norms = np.linalg.norm(truth, axis=1)
        sessions = dict(self._sessions)
        if len(sessions) > 1 and "" in sessions:
            # Rounds where no session asked released only public rows, seen by every session.
            public = sessions.pop("")
            sessions = {name: _plus(acc, public) for name, acc in sessions.items()}
        out = {}
        for session, acc in sorted(sessions.items()):
            ok = acc.stack.identifiable()
            gls = acc.stack.inverse() @ acc.gls
            ols = psd_pinv(acc.gram) @ acc.ols
            guess = np.zeros_like(acc.public_sum)
            has = acc.public_n > 0
            guess[has] = acc.public_sum[has] / acc.public_n[has, None]

            def rel(est: np.ndarray, j: int) -> float:
                return float(np.linalg.norm(est[j] - truth[j]) / norms[j])

            clients = {
                str(j): {
                    "identifiable": bool(ok[j]),
                    "rounds": int(self._truth_n[j]),
                    "error_gls": rel(gls, j),
                    "error_ols": rel(ols, j),
                    "error_public_mean": rel(guess, j) if has[j] else None,
                }
                for j in range(self.num_clients)
                if seen[j] and norms[j] > 0
            }

            out[session] = {
                "clients": clients,
                "identifiable": sum(1 for c in clients.values() if c["identifiable"]),
                **{
                    f"median_{key}": _median(clients.values(), key)
                    for key in ("error_gls", "error_ols", "error_public_mean")
                },
            }
        return out


def _median(clients: Iterable[Mapping[str, Any]], key: str) -> float | None:
    """The median of ``key`` over the clients that have it."""
    vals = [c[key] for c in clients if c[key] is not None]
    return float(np.median(vals)) if vals else None


class CrossRoundObserver(Observer):
    """Runs :class:`CrossRoundAttack` beside a simulation: taps the SA answers and, when a
    round closes, hands the attack the round's true updates (``truth(round, clients)``,
    as the clients submitted them) for the error."""

    name = "cross-round"

    def __init__(
        self,
        num_clients: int,
        truth: Callable[[int, Sequence[int]], Mapping[int, np.ndarray]],
    ) -> None:
        self.attack = CrossRoundAttack(num_clients)
        self.truth = truth

    def attach(self, engine: RoundEngine) -> None:
        engine.sa.answer_taps.append(self.attack.answer)

    def round_closed(self, ctx: RoundContext) -> None:
        self.attack.close_round(self.truth(ctx.round, ctx.answered))
