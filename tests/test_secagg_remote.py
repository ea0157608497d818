"""Pairwise masking with remote parties: the server holds keys and masked sums only, clients
check every query themselves, a batch costs one exchange, a silent client fails its queries."""

import dataclasses

import numpy as np
import pytest
import torch

from fedattr.secagg import (
    FixedPointCodec,
    Query,
    QueryFailed,
    QueryGroup,
    QueryRefused,
    SecAggConfig,
    SecAggError,
    make_aggregator,
)
from fedattr.secagg.party import MaskingParty
from fedattr.secagg.remote_server import RemoteMaskingServer
from fedattr.secagg.transport import LocalTransport
from fedattr.secagg.wire import QueryBatch
from fedattr.updates import UpdateLayout
from test_secagg_batch import MIXED, _assert_same, _sequential, _updates

K = 6


def _remote(min_members=3, budget=None, party_min=None, party_budget="same"):
    codec = FixedPointCodec()
    parties = {
        c: MaskingParty(
            c,
            codec,
            min_members=party_min or min_members,
            release_budget=budget if party_budget == "same" else party_budget,
        )
        for c in range(K)
    }
    transport = LocalTransport(parties)
    sa = RemoteMaskingServer(transport, min_members, codec, release_budget=budget)
    sa.open_round(2, range(K))
    for c, u in enumerate(_updates()):
        layout = UpdateLayout.of(u)
        key = parties[c].start_round(2, range(K), layout.flatten(u))
        sa.register(c, key, layout.to_dict())
    return sa, transport


def _reference(min_members=3, budget=None):
    sa = make_aggregator(
        SecAggConfig(backend="pairwise-mask", min_members=min_members, release_budget=budget or 0)
    )
    sa.open_round(2, range(K))
    for c, u in enumerate(_updates()):
        sa.submit(c, u)
    return sa


def _timeless(log):
    return [dataclasses.replace(r, seconds=0.0, client_seconds_max=0.0, bytes_moved=0) for r in log]


def test_batch_matches_in_process_pairwise_masking_in_one_exchange():
    remote, transport = _remote()
    answers = remote.run_queries(MIXED)
    _assert_same(answers, _sequential(_reference(), MIXED))
    assert remote.exchanges == 1
    # every client with a query to answer got exactly one message
    assert transport.messages == K
    reference = _reference()
    _sequential(reference, MIXED)
    assert _timeless(remote.log) == _timeless(reference.log)
    assert [r.query_id for r in remote.log] == list(range(len(remote.log)))


def test_single_queries_and_the_round_aggregate_are_exact():
    remote, _ = _remote()
    ref = _reference()
    total, answered = remote.sum_of_available(range(K))
    expected, _ = ref.sum_of_available(range(K))
    assert answered == tuple(range(K))
    assert torch.equal(total, expected)
    assert np.array_equal(remote.subset_sum_flat([1, 2, 4]), ref.subset_sum_flat([1, 2, 4]))
    fused = {0: 3, 2: -2, 5: 1}
    assert np.array_equal(remote.combination_flat(fused, 5), ref.combination_flat(fused, 5))


def test_a_silent_client_fails_its_queries_and_the_aggregate_goes_on_without_it():
    remote, transport = _remote()
    transport.silent.add(4)
    with pytest.raises(QueryFailed) as info:
        remote.subset_sum_flat([2, 3, 4])
    assert info.value.missing == (4,) and remote.offline == {4}
    assert remote.log == []  # nothing released
    total, answered = remote.sum_of_available(range(K))
    assert answered == (0, 1, 2, 3, 5)
    ups = _updates()
    assert torch.allclose(total, sum(ups[c] for c in answered), atol=1e-8)
    (answer,) = remote.run_queries([QueryGroup([[Query.subset([1, 4, 5])]])])
    assert answer.results is None and answer.missing == (4,)


def test_clients_enforce_their_own_threshold_whatever_the_server_allows():
    remote, _ = _remote(min_members=2, party_min=4)
    with pytest.raises(QueryRefused, match="below this client's threshold min_members=4"):
        remote.subset_sum_flat([0, 1, 2])
    assert remote.log == []
    (answer,) = remote.run_queries([QueryGroup([[Query.subset([0, 1])]])])
    assert answer.results is None and "threshold" in answer.error


def test_a_client_refuses_a_query_that_lists_a_member_twice():
    # Members (0, 1, 1) pass a count of 3 but sum two clients: the repeated member is refused.
    from fedattr.secagg.wire import PlannedQuery, QueryBatch

    remote, transport = _remote(min_members=2, party_min=3)
    party = transport.parties[0]
    batch = QueryBatch(party.round, [PlannedQuery(9, (0, 1, 1), (1, 1, 1))], remote.public_keys)
    assert "listed twice" in party.answer(batch).refused[9]


def test_clients_hold_the_release_policy_even_when_the_server_keeps_none():
    # A server that does not enforce the policy (no budget) asks for S(all) then S(all - {0}):
    # the second would expose client 0. Its members refuse; nothing is released.
    remote, _ = _remote(min_members=3, budget=None, party_budget=float("inf"))
    remote.subset_sum_flat(range(K))
    with pytest.raises(QueryRefused, match="exactly recoverable"):
        remote.subset_sum_flat(range(1, K))
    assert len(remote.log) == 1


def test_with_a_policy_the_server_plans_what_clients_admit():
    budget = 0.8
    remote, _ = _remote(budget=budget)
    ref = _reference(budget=budget)
    groups = [
        QueryGroup([[Query.subset(range(K))]]),
        QueryGroup([[Query.subset(range(1, K))], [Query.subset([0, 1, 2, 3])]]),
        QueryGroup([[Query.subset([2, 3, 4])]]),
    ]
    got, want = remote.run_queries(groups), ref.run_queries(groups)
    assert [(g.chosen, g.refusals) for g in got] == [(w.chosen, w.refusals) for w in want]
    assert [g.chosen for g in got][:2] == [0, 1]  # S(all - {0}) exposes client 0: never planned
    for g, w in zip(got, want, strict=True):
        if w.results is None:
            assert g.results is None
        else:
            assert np.array_equal(g.results[0], w.results[0])


def test_party_state_survives_a_process_restart():
    codec = FixedPointCodec()
    party = MaskingParty(1, codec, min_members=2)
    flat = np.linspace(-1, 1, 16)
    party.start_round(3, [0, 1, 2], flat)
    other = MaskingParty(0, codec, min_members=2)
    keys = {0: other.start_round(3, [0, 1, 2], flat), 1: b""}
    meta, private, saved = party.state()
    again = MaskingParty(1, codec, min_members=2)
    again.restore(meta, private, saved)
    from fedattr.secagg.wire import PlannedQuery

    keys[1] = b"\x00" * 32  # unused by client 1 itself
    batch = QueryBatch(3, [PlannedQuery(0, (0, 1), (1, 2))], keys)
    a, b = party.answer(batch), again.answer(batch)
    assert np.array_equal(a.masked[0], b.masked[0])
    # a batch for another round is refused, not answered
    assert 0 in again.answer(QueryBatch(4, batch.queries, keys)).refused


def test_register_checks_keys_and_layouts():
    codec = FixedPointCodec()
    sa = RemoteMaskingServer(LocalTransport({}), 2, codec)
    sa.open_round(1, [0, 1, 2])
    with pytest.raises(SecAggError, match="32 bytes"):
        sa.register(0, b"short", UpdateLayout.of(torch.zeros(3)))
    sa.register(0, b"k" * 32, UpdateLayout.of(torch.zeros(3)))
    with pytest.raises(SecAggError, match="does not match"):
        sa.register(1, b"k" * 32, UpdateLayout.of(torch.zeros(4)))
    with pytest.raises(SecAggError, match="already submitted"):
        sa.register(0, b"k" * 32, UpdateLayout.of(torch.zeros(3)))
    with pytest.raises(SecAggError, match="register"):
        sa.submit(2, torch.zeros(3))


def test_layout_round_trips_through_json():
    update = {"b": torch.zeros(2, 3, dtype=torch.bfloat16), "a": torch.ones(4)}
    layout = UpdateLayout.of(update)
    assert UpdateLayout.from_dict(layout.to_dict()) == layout
    with pytest.raises(ValueError, match=r"layout\.dtypes"):
        UpdateLayout.from_dict({**layout.to_dict(), "dtypes": ["float32", "nonsense"]})


def test_combine_reduces_each_answered_group_remotely():
    from test_secagg_batch import _assert_combined, _summed

    remote, _ = _remote()
    _assert_combined(remote.run_queries(MIXED, combine=_summed), _sequential(_reference(), MIXED))


def test_a_linear_reduction_sums_each_group_remotely():
    from test_secagg_batch import _assert_reduced, _signed

    remote, _ = _remote()
    groups = _signed(MIXED)
    _assert_reduced(remote.run_queries(groups), _sequential(_reference(), MIXED), groups)
