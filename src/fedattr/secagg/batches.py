"""Batches of queries: one :class:`QueryGroup` per estimate, with fall-back alternatives.

:meth:`~fedattr.secagg.SecureAggregator.run_queries` answers a batch of groups (the queries
behind one estimate each) with a :class:`GroupAnswer` each. Which alternative a group gets is
decided by validation and the release policy: the first one whose first query is admitted.
:func:`answer_group` is that rule run one query at a time (the default of every backend); a
runtime whose clients live elsewhere plans the same choices and sends each client one message
per round instead (:class:`~fedattr.secagg.remote_server.RemoteMaskingServer`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .errors import QueryFailed, QueryRefused, SecAggError
from .queries import Query


@dataclass
class QueryGroup:
    """The queries behind one estimate.

    ``alternatives`` are tried in order: the SA layer answers the first alternative whose first
    query is admitted (by validation and the release policy) and runs that alternative's queries
    in order.
    """

    alternatives: list[list[Query]]
    reduce: list[tuple[list[int], int]] | None = None
    """Optional linear reduction, one ``(signs, divisor)`` per alternative: the answered
    alternative's results become the one array ``(sum_k signs[k] * result_k) / divisor``,
    summed as the answers arrive (so the group holds its running sum and one answer, not all
    its answers: 2M float64 copies of an update for a FedAttr estimate)."""


class Reduction:
    """The running sum of a :class:`QueryGroup` alternative's answers (see
    :attr:`QueryGroup.reduce`); with no reduction, the answers themselves."""

    def __init__(self, group: QueryGroup, alternative: int) -> None:
        self.spec = None if group.reduce is None else group.reduce[alternative]
        self.results: list[np.ndarray] = []
        self.count = 0

    def add(self, result: np.ndarray) -> None:
        """Take the next answer (in query order)."""
        if self.spec is None:
            self.results.append(result)
        else:
            sign = self.spec[0][self.count]
            if not self.results:
                # A new array: an answer may still be held elsewhere (an answer tap).
                self.results.append(result * sign if sign != 1 else result.copy())
            elif sign == 1:
                self.results[0] += result
            elif sign == -1:
                self.results[0] -= result
            else:
                self.results[0] += sign * result
        self.count += 1

    def done(self) -> list[np.ndarray]:
        """Every answer, or the one reduced array."""
        if self.spec is not None and self.results and self.spec[1] != 1:
            self.results[0] = self.results[0] / self.spec[1]
        return self.results


@dataclass
class GroupAnswer:
    """What :meth:`~fedattr.secagg.SecureAggregator.run_queries` did with one
    :class:`QueryGroup`."""

    results: list[np.ndarray] | None
    """Flat float64 result per query of the answered alternative (with a ``combine``, the one
    array it reduced them to); ``None`` if no alternative was answered in full."""
    chosen: int | None
    """Index of the answered alternative (``None`` when ``results`` is ``None``)."""
    refusals: int = 0
    """Alternatives refused before any of their queries ran."""
    missing: tuple[int, ...] = ()
    """Members that failed to answer (:class:`QueryFailed`); the group stopped there."""
    error: str | None = None
    """Message of the last refusal or failure."""
    seconds: float = 0.0
    """Wall time spent on this group."""


Combine = Callable[[int, int, list[np.ndarray]], np.ndarray]
"""``(group index, chosen alternative, its results) -> one array``: a caller's reduction of a
group's answers, applied by :meth:`~fedattr.secagg.SecureAggregator.run_queries` as each group
is answered."""


def combined(g: int, answer: GroupAnswer, combine: Combine | None) -> GroupAnswer:
    """``answer`` (of group ``g``) with its results reduced by ``combine`` (when given and the
    group was answered)."""
    if combine is not None and answer.results is not None:
        assert answer.chosen is not None  # an answered group says which alternative
        answer.results = [combine(g, answer.chosen, answer.results)]
    return answer


def check_groups(groups: Sequence[QueryGroup]) -> None:
    """Refuse a malformed batch before any of its queries runs (a caller's bug, not a refusal)."""
    for g, group in enumerate(groups):
        if not isinstance(group, QueryGroup):
            raise SecAggError(
                f"run_queries: groups[{g}] is a {type(group).__name__}, not a QueryGroup"
            )
        if not group.alternatives:
            raise SecAggError(f"run_queries: groups[{g}] has no alternatives")
        for a, alternative in enumerate(group.alternatives):
            if not alternative:
                raise SecAggError(f"run_queries: groups[{g}].alternatives[{a}] is empty")
        if group.reduce is not None and (
            len(group.reduce) != len(group.alternatives)
            or any(
                len(signs) != len(alt) or divisor < 1
                for (signs, divisor), alt in zip(group.reduce, group.alternatives, strict=False)
            )
        ):
            raise SecAggError(
                f"run_queries: groups[{g}].reduce needs one (signs, divisor >= 1) per "
                "alternative, one sign per query"
            )


def answer_group(group: QueryGroup, run_query: Callable[[Query], np.ndarray]) -> GroupAnswer:
    """Answer ``group`` one query at a time with ``run_query`` (a single-query SA call).

    :class:`QueryRefused` on an alternative's first query counts a refusal and moves on to the
    next alternative; on a later query it stops the group. :class:`QueryFailed` stops the group
    with ``missing`` set. Anything else propagates.
    """
    start = time.perf_counter()
    answer = GroupAnswer(results=None, chosen=None)
    for index, alternative in enumerate(group.alternatives):
        results = Reduction(group, index)
        try:
            for query in alternative:
                results.add(run_query(query))
        except QueryRefused as exc:
            answer.error = str(exc)
            if results.count:  # refused after part of the alternative ran: stop the group
                break
            answer.refusals += 1
            continue
        except QueryFailed as exc:
            answer.error, answer.missing = str(exc), tuple(exc.missing)
            break
        answer.results, answer.chosen = results.done(), index
        break
    answer.seconds = time.perf_counter() - start
    return answer
