"""Auditing what a run's secure-aggregation answers reveal, from its query log alone.

The log holds, per answered query, the round, the members and their integer coefficients (never
the result). Per round, the answered rows span a subspace; client j is exactly recoverable when
``e_j`` lies in it, and its Gaussian-model joint leakage is ``L_j = -1/2 log(1 - ||P e_j||^2)``
nats per effective dimension (see :mod:`fedattr.secagg.policy`).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..secagg.policy import joint_leakage


@dataclass
class RoundAudit:
    """One round: per-client recoverability and leakage."""

    round: int
    queries: int
    rank: int
    clients: list[int]
    leakage: dict[int, float]
    recoverable: list[int] = field(default_factory=list)

    @property
    def max_leakage(self) -> float:
        """Largest ``L_j`` of the round (``inf`` if anyone is recoverable)."""
        return max(self.leakage.values()) if self.leakage else 0.0

    def to_dict(self) -> dict:
        """JSON-ready form (infinite leakage written as the string "inf")."""
        d = asdict(self)
        d["leakage"] = {str(k): (v if math.isfinite(v) else "inf") for k, v in self.leakage.items()}
        return d


def audit_queries(
    queries: Iterable[Mapping], clients: Iterable[int] | None = None
) -> list[RoundAudit]:
    """Audit query-log records (dicts with ``round``, ``subset`` and ``coefficients``).

    ``clients`` lists the round's participants; by default, everyone who appears in a query of
    that round (a participant never queried leaks nothing).
    """
    by_round: dict[int, list[Mapping]] = defaultdict(list)
    for q in queries:
        by_round[int(q["round"])].append(q)
    out = []
    for rnd in sorted(by_round):
        rows_q = by_round[rnd]
        ids = sorted(
            set(clients) if clients is not None else {int(c) for q in rows_q for c in q["subset"]}
        )
        index = {c: k for k, c in enumerate(ids)}
        rows = np.zeros((len(rows_q), len(ids)))
        for r, q in enumerate(rows_q):
            coefs = q.get("coefficients") or [1] * len(q["subset"])
            for c, v in zip(q["subset"], coefs, strict=True):
                rows[r, index[int(c)]] = v
        leak = dict(zip(ids, joint_leakage(rows).tolist(), strict=True))
        out.append(
            RoundAudit(
                round=rnd,
                queries=len(rows_q),
                rank=int(np.linalg.matrix_rank(rows)) if rows.size else 0,
                clients=ids,
                leakage=leak,
                recoverable=[c for c, v in leak.items() if math.isinf(v)],
            )
        )
    return out


def audit_run(run_dir: str | Path) -> list[RoundAudit]:
    """Audit the ``queries.jsonl`` of a run folder."""
    path = Path(run_dir) / "queries.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"RUN_DIR: {str(path)!r} not found; audit a folder written by "
            "'fedattr run --out' or 'fedattr demo-protocol --out'"
        )
    with open(path) as fh:
        return audit_queries(json.loads(line) for line in fh if line.strip())


def format_audit(rounds: list[RoundAudit], budget: float | None = None) -> str:
    """Markdown table: one row per round."""
    lines = [
        "| round | queries | rank | clients | exactly recoverable | max L_j (nats/dim) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rounds:
        rec = ", ".join(map(str, r.recoverable)) or "none"
        m = "∞" if math.isinf(r.max_leakage) else f"{r.max_leakage:.4f}"
        lines.append(f"| {r.round} | {r.queries} | {r.rank} | {len(r.clients)} | {rec} | {m} |")
    if budget is not None:
        lines.append(f"\nbudget (paper's single-estimate bound): {budget:.4f} nats per dimension")
    return "\n".join(lines)
