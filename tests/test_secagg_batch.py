"""Batch queries (``run_queries``), the backend registry and shared update validation."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from fedattr.secagg import (
    BACKENDS,
    GroupAnswer,
    Query,
    QueryFailed,
    QueryGroup,
    QueryRefused,
    SecAggConfig,
    SecAggError,
    make_aggregator,
)
from fedattr.secagg import config as config_module

K, D = 6, 8


def _updates():
    gen = torch.Generator().manual_seed(5)
    return [torch.randn(D, generator=gen, dtype=torch.float64) for _ in range(K)]


def _round(backend, min_members=3, **kw):
    sa = make_aggregator(SecAggConfig(backend=backend, min_members=min_members, **kw))
    sa.open_round(2, range(K))
    for j, u in enumerate(_updates()):
        sa.submit(j, u)
    return sa


def _sequential(sa, groups):
    """The specification of ``run_queries``, written with the single-query methods."""
    answers = []
    for group in groups:
        answer = GroupAnswer(results=None, chosen=None)
        for index, alternative in enumerate(group.alternatives):
            results = []
            try:
                for q in alternative:
                    if q.denominator == 1 and all(v == 1 for v in q.coefficients.values()):
                        results.append(sa.subset_sum_flat(list(q.coefficients)))
                    else:
                        results.append(sa.combination_flat(q.coefficients, q.denominator))
            except QueryRefused as exc:
                answer.error = str(exc)
                if results:
                    break
                answer.refusals += 1
                continue
            except QueryFailed as exc:
                answer.error, answer.missing = str(exc), exc.missing
                break
            answer.results, answer.chosen = results, index
            break
        answers.append(answer)
    return answers


def _timeless(log):
    return [dataclasses.replace(r, seconds=0.0, client_seconds_max=0.0) for r in log]


def _assert_same(batch, seq):
    assert len(batch) == len(seq)
    for b, s in zip(batch, seq, strict=True):
        fields = ("chosen", "refusals", "missing", "error")
        assert [getattr(b, f) for f in fields] == [getattr(s, f) for f in fields]
        assert b.seconds >= 0.0
        if s.results is None:
            assert b.results is None
            continue
        assert len(b.results) == len(s.results)
        for x, y in zip(b.results, s.results, strict=True):
            assert x.dtype == np.float64 and x.shape == (D,)
            assert np.array_equal(x, y)  # bit-identical


MIXED = [
    # first alternative below the threshold (refused), second answered: a subset sum + a fused
    QueryGroup(
        [
            [Query.subset([0, 1])],
            [Query.subset([0, 1, 2]), Query({0: 2, 3: -1, 4: 3, 5: 0}, 4)],
        ]
    ),
    # all-1 coefficients given as a mapping: a subset sum, logged as one
    QueryGroup([[Query({1: 1, 2: 1, 3: 1, 5: 1})]]),
    # all-1 coefficients over a denominator: a fused query
    QueryGroup([[Query(dict.fromkeys(range(K), 1), 3)]]),
    # a refusal after the first query ran (non-integer coefficient) stops the group
    QueryGroup([[Query.subset([3, 4, 5]), Query({0: 0.5, 1: 1, 2: 1})], [Query.subset(range(K))]]),
    # every alternative refused
    QueryGroup([[Query.subset([0])], [Query({0: 1, 1: 1, 42: 1})]]),
    QueryGroup([[Query.subset(range(K)), Query({0: -1, 1: 2, 2: 1}, 2)]]),
]


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_batch_equals_single_queries_in_order(backend):
    a, b = _round(backend), _round(backend)
    batch = a.run_queries(MIXED)
    seq = _sequential(b, MIXED)
    _assert_same(batch, seq)
    assert _timeless(a.log) == _timeless(b.log)
    assert [r.query_id for r in a.log] == list(range(len(a.log)))

    first, subset, fused, mid, refused, last = batch
    assert (first.chosen, first.refusals) == (1, 1)
    assert "below the secure-aggregation threshold" in first.error
    assert (subset.chosen, subset.refusals, subset.error) == (0, 0, None)
    assert (mid.results, mid.chosen, mid.refusals) == (None, None, 0)
    assert "coefficients must be integers" in mid.error
    assert (refused.results, refused.chosen, refused.refusals) == (None, None, 2)
    assert "not registered" in refused.error
    assert last.chosen == 0 and len(last.results) == 2
    # the subset query is logged like subset_sum_flat, the all-1 fused one with its denominator
    assert [(r.subset, r.coefficients, r.denominator) for r in a.log] == [
        ((0, 1, 2), (1, 1, 1), 1),
        ((0, 3, 4), (2, -1, 3), 4),
        ((1, 2, 3, 5), (1, 1, 1, 1), 1),
        (tuple(range(K)), (1,) * K, 3),
        ((3, 4, 5), (1, 1, 1), 1),
        (tuple(range(K)), (1,) * K, 1),
        ((0, 1, 2), (-1, 2, 1), 2),
    ]
    # and the numbers are the combinations they stand for
    ups = np.stack([u.numpy() for u in _updates()])
    assert np.allclose(fused.results[0], ups.sum(axis=0) / 3, atol=1e-8)
    assert np.allclose(first.results[1], (2 * ups[0] - ups[3] + 3 * ups[4]) / 4, atol=1e-8)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_batch_results_are_the_combinations_asked_for(backend):
    sa = _round(backend)
    ups = np.stack([u.numpy() for u in _updates()])
    (answer,) = sa.run_queries([QueryGroup([[Query.subset([0, 2, 4]), Query({1: 3, 5: -2}, 4)]])])
    # {1, 5} is below the threshold: refused after the first query ran
    assert answer.results is None and "below the secure-aggregation threshold" in answer.error
    (answer,) = sa.run_queries([QueryGroup([[Query({1: 3, 3: 1, 5: -2}, 4)]])])
    expected = (3 * ups[1] + ups[3] - 2 * ups[5]) / 4
    assert np.allclose(answer.results[0], expected, atol=1e-8)


def test_batch_with_transient_failures_matches_single_queries():
    groups = [
        QueryGroup([[Query.subset(range(k, k + 3))], [Query.subset(range(K))]]) for k in (0, 3)
    ]
    groups = groups * 4
    a, b = (_round("pairwise-mask", dropout=0.2, seed=11) for _ in range(2))
    batch = a.run_queries(groups)
    _assert_same(batch, _sequential(b, groups))
    assert _timeless(a.log) == _timeless(b.log)
    assert any(ans.missing for ans in batch)  # the seeded dropouts did hit some query


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_release_policy_refusal_falls_through_to_the_next_alternative(backend):
    a, b = (_round(backend, release_budget=math.inf) for _ in range(2))
    groups = [
        QueryGroup([[Query.subset(range(K))]]),
        QueryGroup([[Query.subset([0, 1, 2])]]),
        # {0,1,2,3} minus {0,1,2} would expose client 3: refused, then {2,3,4} is answered
        QueryGroup([[Query.subset([0, 1, 2, 3])], [Query.subset([2, 3, 4])]]),
        # admitted first query, then a refused one: the group stops, nothing more runs
        QueryGroup(
            [[Query.subset([3, 4, 5]), Query.subset([2, 3, 4, 5])], [Query.subset([0, 5, 4])]]
        ),
    ]
    batch = a.run_queries(groups)
    _assert_same(batch, _sequential(b, groups))
    assert _timeless(a.log) == _timeless(b.log)
    fall, stop = batch[2], batch[3]
    assert (fall.chosen, fall.refusals) == (1, 1)
    assert "release policy" in fall.error and "exactly recoverable" in fall.error
    assert (stop.results, stop.chosen, stop.refusals) == (None, None, 0)
    assert "release policy" in stop.error
    assert [r.subset for r in a.log] == [tuple(range(K)), (0, 1, 2), (2, 3, 4), (3, 4, 5)]


def test_failed_member_stops_the_group_with_missing():
    a, b = _round("pairwise-mask"), _round("pairwise-mask")
    for sa in (a, b):
        sa.drop(3)
    groups = [
        # first query answered, second fails: the group stops, the next alternative is not tried
        QueryGroup([[Query.subset([0, 1, 2]), Query.subset([2, 3, 4])], [Query.subset([0, 1, 5])]]),
        # failing first query: no fall-through either
        QueryGroup([[Query({3: 2, 4: 1, 5: 1}, 2)], [Query.subset([0, 1, 5])]]),
        # later groups still run
        QueryGroup([[Query.subset([0, 1, 2, 4])]]),
    ]
    batch = a.run_queries(groups)
    _assert_same(batch, _sequential(b, groups))
    assert _timeless(a.log) == _timeless(b.log)
    for ans in batch[:2]:
        assert (ans.results, ans.chosen, ans.refusals, ans.missing) == (None, None, 0, (3,))
        assert "did not answer" in ans.error
    assert batch[2].chosen == 0
    assert [r.subset for r in a.log] == [(0, 1, 2), (0, 1, 2, 4)]


def test_bugs_propagate_and_malformed_batches_are_rejected(monkeypatch):
    sa = _round("plaintext")

    def broken(*_args):
        raise RuntimeError("bug")

    monkeypatch.setattr(sa, "_combine", broken)
    with pytest.raises(RuntimeError, match="bug"):
        sa.run_queries([QueryGroup([[Query.subset([0, 1, 2])], [Query.subset([3, 4, 5])]])])
    monkeypatch.undo()
    with pytest.raises(SecAggError, match="no alternatives"):
        sa.run_queries([QueryGroup([])])
    with pytest.raises(SecAggError, match=r"alternatives\[1\] is empty"):
        sa.run_queries([QueryGroup([[Query.subset([0, 1, 2])], []])])
    with pytest.raises(SecAggError, match="not a QueryGroup"):
        sa.run_queries([[Query.subset([0, 1, 2])]])
    assert sa.log == []  # nothing of a malformed batch ran
    with pytest.raises(SecAggError, match="duplicate"):
        Query.subset([0, 1, 1])
    assert sa.run_queries([]) == []


def test_closed_round_refuses_every_alternative():
    sa = _round("two-server")
    sa.close_round()
    (ans,) = sa.run_queries([QueryGroup([[Query.subset([0, 1, 2])], [Query({0: 1, 1: 2, 2: 1})]])])
    assert (ans.results, ans.chosen, ans.refusals) == (None, None, 2)
    assert "no round is open" in ans.error


def test_query_stores_a_plain_dict():
    src = {0: 1, 1: 1}
    q = Query(src)
    src[2] = 1
    assert type(q.coefficients) is dict and q.coefficients == {0: 1, 1: 1}
    assert Query.subset(np.arange(3)).coefficients == {0: 1, 1: 1, 2: 1}
    assert Query.subset([2, 0]).is_subset and not Query({0: 1, 1: 2}).is_subset
    assert not Query({0: 1, 1: 1}, 2).is_subset


# -- registry -------------------------------------------------------------------------------


def test_registry_builds_each_backend_from_its_config():
    for name, cls in BACKENDS.items():
        cfg = SecAggConfig(backend=name, min_members=4, prg="chacha20", dropout=0.1, seed=3)
        sa = make_aggregator(cfg)
        assert type(sa) is cls and sa.name == name
        assert sa.min_members == 4 and sa.codec == cfg.codec() and sa.release_budget is None
        assert type(cls.from_config(cfg)) is cls
        if name != "plaintext":
            assert sa.prg == "chacha20"
        if name == "pairwise-mask":
            assert sa.dropout == 0.1
    assert make_aggregator(SecAggConfig(release_budget=2.5)).release_budget == 2.5
    assert config_module.SecAggConfig is SecAggConfig
    with pytest.raises(SecAggError, match=r"secagg.backend: unknown 'x'; allowed: "):
        SecAggConfig(backend="x")


# -- one validation of updates for every backend --------------------------------------------


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (float("nan"), "contains NaN or infinite values"),
        (float("inf"), "contains NaN or infinite values"),
        (-float("inf"), "contains NaN or infinite values"),
        (2048.5, "magnitude 2048.5 exceeds the fixed-point clip bound 1024.0"),
    ],
)
def test_every_backend_refuses_the_same_updates(value, match):
    messages = {}
    for name in BACKENDS:
        sa = make_aggregator(SecAggConfig(backend=name, min_members=2))
        sa.open_round(0, range(3))
        bad = torch.zeros(D, dtype=torch.float64)
        bad[3] = value
        with pytest.raises(SecAggError, match=match) as info:
            sa.submit(0, bad)
        messages[name] = str(info.value)
        # the refused update was not taken: the client may still submit a valid one
        sa.submit(0, torch.ones(D, dtype=torch.float64))
        sa.submit(1, torch.ones(D, dtype=torch.float64))
        assert np.allclose(sa.subset_sum_flat([0, 1]), 2.0)
    assert len(set(messages.values())) == 1
    codec = SecAggConfig().codec()
    with pytest.raises(SecAggError) as info:
        codec.check(np.full(2, value))
    assert str(info.value) == messages["plaintext"]
    assert np.array_equal(codec.check([1.0, -2.0]), np.array([1.0, -2.0]))


def _summed(g, chosen, results):
    """A reduction that shows which group and alternative it saw."""
    return sum(results) + 1000.0 * g + 100.0 * chosen


def _assert_one_array(answers, plain, expected):
    """Each answered group is the one array ``expected(g, plain answer)``; all else as plain."""
    for g, (c, p) in enumerate(zip(answers, plain, strict=True)):
        assert (c.chosen, c.refusals, c.missing, c.error) == (
            p.chosen,
            p.refusals,
            p.missing,
            p.error,
        )
        if p.results is None:
            assert c.results is None
            continue
        (only,) = c.results  # one array per answered group, reduced as it was answered
        assert np.array_equal(only, expected(g, p))


def _assert_combined(combined, plain):
    _assert_one_array(combined, plain, lambda g, p: _summed(g, p.chosen, p.results))


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_combine_reduces_each_answered_group(backend):
    a, b = _round(backend), _round(backend)
    _assert_combined(a.run_queries(MIXED, combine=_summed), b.run_queries(MIXED))
    assert _timeless(a.log) == _timeless(b.log)  # the same queries were asked


def _signed(groups):
    """MIXED with a linear reduction on every alternative: signs +1, -1, 3, ... and divisor 2."""
    return [
        QueryGroup(
            g.alternatives,
            reduce=[([(1, -1, 3)[k % 3] for k in range(len(alt))], 2) for alt in g.alternatives],
        )
        for g in groups
    ]


def _assert_reduced(reduced, plain, groups):
    def linear(g, p):
        signs, divisor = groups[g].reduce[p.chosen]
        want = p.results[0] * signs[0]
        for sign, r in zip(signs[1:], p.results[1:], strict=True):
            want = want + sign * r
        return want / divisor

    _assert_one_array(reduced, plain, linear)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_linear_reduction_sums_each_group_as_it_is_answered(backend):
    a, b = _round(backend), _round(backend)
    seen = []
    a.answer_taps.append(lambda record, total: seen.append((total, total.copy())))
    groups = _signed(MIXED)
    _assert_reduced(a.run_queries(groups), b.run_queries(MIXED), groups)
    assert _timeless(a.log) == _timeless(b.log)  # the same queries were asked
    assert seen and all(np.array_equal(x, y) for x, y in seen)  # taps' answers left as given


def test_the_estimate_formed_as_answers_arrive_has_the_bits_of_combine_answers():
    from fedattr.attribution.design import draw_design
    from fedattr.attribution.estimator import combine_answers, design_queries, design_reduction

    design = draw_design(list(range(K)), 2, 2, 2, np.random.default_rng(0), min_members=2)
    for fused in (False, True):
        a, b = _round("pairwise-mask", 2), _round("pairwise-mask", 2)
        queries = design_queries(design, fused)
        group = QueryGroup([queries], reduce=[design_reduction(design, fused)])
        ((estimate,),) = [ans.results for ans in a.run_queries([group])]
        (plain,) = b.run_queries([QueryGroup([queries])])
        assert np.array_equal(estimate, combine_answers(design, plain.results, fused))


def test_a_malformed_reduction_is_refused_before_any_query_runs():
    sa = _round("plaintext")
    alternatives = [[Query.subset([0, 1, 2]), Query.subset([3, 4, 5])]]
    for reduce in ([([1], 1)], [([1, 1], 0)], [([1, 1], 1), ([1], 1)]):
        with pytest.raises(SecAggError, match=r"groups\[0\]\.reduce needs one"):
            sa.run_queries([QueryGroup(alternatives, reduce=reduce)])
    assert sa.log == []
