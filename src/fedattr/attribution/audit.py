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
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..errors import UserError
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
    session: str = ""
    """The SA session audited (its own answers plus the public ones, e.g. the aggregate)."""

    @property
    def max_leakage(self) -> float:
        """Largest ``L_j`` of the round (``inf`` if anyone is recoverable)."""
        return max(self.leakage.values()) if self.leakage else 0.0

    def to_dict(self) -> dict:
        """JSON-ready form (infinite leakage written as the string "inf")."""
        d = asdict(self)
        d["leakage"] = {str(k): (v if math.isfinite(v) else "inf") for k, v in self.leakage.items()}
        return d


def round_designs(
    queries: Iterable[Mapping], clients: Iterable[int] | None = None
) -> Iterator[tuple[int, str, list[Mapping], list[int], np.ndarray]]:
    """Per (round, SA session), in order: ``(round, session, records, client ids, rows)``.

    ``rows[r, k]`` is the coefficient of client ``ids[k]`` in record ``r``. A named session's
    records come with the round's records outside any session (the public aggregate, which
    every party sees); a round with no named session is audited as session ``""``. ``clients``
    as in :func:`audit_queries`.
    """
    by_round: dict[int, list[Mapping]] = defaultdict(list)
    sessions: dict[int, set[str]] = defaultdict(set)
    for q in queries:
        by_round[int(q["round"])].append(q)
        sessions[int(q["round"])].add(q.get("session", ""))
    fixed = sorted(set(clients)) if clients is not None else None
    for rnd, session in sorted((r, s) for r in by_round for s in sessions[r] - {""} or {""}):
        rows_q = [q for q in by_round[rnd] if q.get("session", "") in ("", session)]
        ids = fixed if fixed is not None else sorted({int(c) for q in rows_q for c in q["subset"]})
        index = {c: k for k, c in enumerate(ids)}
        rows = np.zeros((len(rows_q), len(ids)))
        for r, q in enumerate(rows_q):
            coefs = q.get("coefficients") or [1] * len(q["subset"])
            for c, v in zip(q["subset"], coefs, strict=True):
                rows[r, index[int(c)]] = v
        yield rnd, session, rows_q, ids, rows


def audit_queries(
    queries: Iterable[Mapping], clients: Iterable[int] | None = None
) -> list[RoundAudit]:
    """Audit query-log records (dicts with ``round``, ``subset`` and ``coefficients``).

    ``clients`` lists the round's participants; by default, everyone who appears in a query of
    that round (a participant never queried leaks nothing). Queries of a named SA session (one
    attribution configuration of a run with several) are audited per session, each together
    with the queries outside any session, which every party sees.
    """
    out = []
    for rnd, session, rows_q, ids, rows in round_designs(queries, clients):
        leak = dict(zip(ids, joint_leakage(rows).tolist(), strict=True))
        out.append(
            RoundAudit(
                round=rnd,
                queries=len(rows_q),
                rank=int(np.linalg.matrix_rank(rows)) if rows.size else 0,
                clients=ids,
                leakage=leak,
                recoverable=[c for c, v in leak.items() if math.isinf(v)],
                session=session,
            )
        )
    return out


def audit_file(path: str | Path) -> list[RoundAudit]:
    """Audit a query log (``queries.jsonl``); a damaged line is one error naming the line."""
    return audit_queries(read_query_log(path))


def read_query_log(path: str | Path) -> list[dict]:
    """The records of a query log (``queries.jsonl``), each line checked as
    :func:`audit_file` checks it."""
    path = Path(path)
    if not path.is_file():
        raise UserError(
            f"RUN_DIR: {str(path)!r} not found; audit a folder written by "
            "'fedattr run --out' or 'fedattr demo-protocol --out'"
        )
    with open(path, "rb") as fh:
        return [
            _query_record(path, lineno, line)
            for lineno, line in enumerate(fh, start=1)
            if line.strip()
        ]


def _query_record(path: Path, lineno: int, line: bytes) -> dict:
    """Parse line ``lineno`` (1-based) of ``queries.jsonl``.

    Raises a ``ValueError`` naming the file and the line when it is not a query record: not
    UTF-8 JSON, not an object, lacking ``round``/``subset``, or with mistyped fields.
    """
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as exc:
        problem = f"not UTF-8 text: byte {exc.start + 1} is {line[exc.start : exc.start + 1]!r}"
    except json.JSONDecodeError as exc:
        problem = f"{exc.msg} at column {exc.colno}"
    else:
        if not isinstance(record, dict):
            problem = f"a JSON {type(record).__name__}, not an object"
        elif missing := [k for k in ("round", "subset") if k not in record]:
            problem = "missing key(s) " + ", ".join(repr(k) for k in missing)
        elif isinstance(record["round"], bool) or not isinstance(record["round"], int):
            problem = f"'round' is {record['round']!r}, not an integer"
        elif not isinstance(record["subset"], list):
            problem = f"'subset' is {record['subset']!r}, not a list of client ids"
        elif record.get("coefficients") and (
            not isinstance(record["coefficients"], list)
            or len(record["coefficients"]) != len(record["subset"])
        ):
            problem = "'coefficients' does not match 'subset' (one integer per member)"
        else:
            return record
    raise UserError(
        f"RUN_DIR: {str(path)!r} line {lineno} is not a query record ({problem}); "
        "the file is corrupt — re-run or restore it"
    )
