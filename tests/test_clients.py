"""Clients that differ from the rest (fl.clients) and quantity-skewed shards."""

import pytest

from conftest import small_overrides as _small
from fedattr.config import ConfigError, load
from fedattr.data.corpus import generate_corpus
from fedattr.data.partition import partition_quantity
from fedattr.fl.clients import ClientGroup, ClientProfile, resolve_profiles
from fedattr.models.training import TrainSettings
from fedattr.pipeline.config import RunConfig
from fedattr.pipeline.run import run_experiment


def test_groups_are_drawn_among_whom_they_name_and_never_twice():
    groups = [
        ClientGroup(count=2, among="clean", update_scale=0.0),
        ClientGroup(count=1, among="watermarked", lr_scale=0.5),
        ClientGroup(ids=[9], steps=0.5),
    ]
    marked = [1, 4, 7]
    p = resolve_profiles(groups, 10, marked, seed=3)
    free = [c for c in range(10) if p[c].group == 0]
    slow = [c for c in range(10) if p[c].group == 1]
    assert len(free) == 2 and not set(free) & set(marked) and 9 not in free
    assert len(slow) == 1 and slow[0] in marked
    assert p[9].steps == 0.5 and p[9].group == 2
    assert all(p[c].update_scale == 0.0 for c in free)
    assert p[0] == ClientProfile() or 0 in free  # a client no group takes keeps the default
    # Deterministic in the seed; another seed may draw others.
    assert resolve_profiles(groups, 10, marked, seed=3).of == p.of
    assert set(p.summary()) == {str(c) for c in [*free, *slow, 9]}


def test_ranges_are_drawn_per_client_within_their_bounds():
    p = resolve_profiles([ClientGroup(count=6, among="any", lr_scale=[0.1, 10.0])], 6, [], 0)
    scales = [p[c].lr_scale for c in range(6)]
    assert all(0.1 <= s <= 10.0 for s in scales) and len(set(scales)) == 6


@pytest.mark.parametrize(
    ("group", "message"),
    [
        ({"count": 9}, "fl.clients[0].count: 9 clean clients asked for, 7 left"),
        ({"ids": [3, 12]}, "fl.clients[0].ids: distinct client ids in 0..9"),
        ({"count": 0}, "fl.clients[0]: give ids (a list of client ids) or count >= 1"),
        ({"count": 1, "steps": 1.5}, "fl.clients[0].steps: a share of the planned steps"),
        ({"count": 1, "lr_scale": [2, 1]}, "fl.clients[0].lr_scale: a number or [lo, hi]"),
        ({"count": 1, "update_scale": -1}, "fl.clients[0].update_scale: must be >= 0"),
        ({"count": 1, "drop": 1.0}, "fl.clients[0].drop: must be in [0, 1)"),
        ({"count": 1, "among": "rich"}, "fl.clients[0].among: unknown 'rich'"),
    ],
)
def test_bad_groups_are_one_line_before_any_work(group, message):
    import json

    with pytest.raises(ConfigError) as err:
        load(RunConfig, None, ["watermark.r=3", f"fl.clients=[{json.dumps(group)}]"])
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


def test_a_profile_sets_learning_rate_and_epochs_and_drops_by_seed():
    prof = ClientProfile(lr_scale=0.5, epochs=3, drop=0.5)
    s = prof.settings(TrainSettings(lr=1e-3, epochs=1))
    assert s.lr == pytest.approx(5e-4) and s.epochs == 3
    p = resolve_profiles([ClientGroup(ids=[0, 1], drop=0.5)], 4, [], seed=1)
    drops = [p.drops(t, [0, 1, 2, 3]) for t in range(1, 201)]
    assert all(set(d) <= {0, 1} for d in drops)
    share = sum(len(d) for d in drops) / 400
    assert 0.4 < share < 0.6
    assert drops == [p.drops(t, [0, 1, 2, 3]) for t in range(1, 201)]


def test_quantity_skew_keeps_every_record_once_and_every_client_one():
    records = generate_corpus(300, seed=0)
    shards = partition_quantity(records, 10, 0.3, seed=4)
    sizes = [len(s) for s in shards]
    assert sum(sizes) == 300 and min(sizes) >= 1
    assert max(sizes) > 5 * min(sizes)  # skewed
    seen = [id(r) for s in shards for r in s]
    assert len(set(seen)) == 300


def test_free_riders_send_zero_stragglers_stop_early_and_dropouts_miss_rounds(tiny_cache):
    groups = (
        '[{"ids": [1], "update_scale": 0}, {"ids": [2], "steps": 0.5}, {"ids": [3], "drop": 0.9}]'
    )
    cfg = load(
        RunConfig,
        None,
        _small(tiny_cache, "watermark.clients=[0]", f"fl.clients={groups}", "ceiling=true"),
    )
    said: list[str] = []
    result = run_experiment(cfg, progress=said.append)
    d = result.to_dict()
    prof = d["federation"]["profiles"]
    assert prof["1"]["update_scale"] == 0.0 and prof["2"]["steps"] == 0.5
    assert prof["3"]["drop"] == 0.9
    # Client 3 dropped out of at least one round (p = 0.99 over two rounds at this seed):
    # it trained but never reached SA, so the round's FedAttr skipped it.
    assert any(3 in r["dropouts"] for r in result.rounds)
    assert any("(dropped out)" in m for m in said)
    ceiling = {c["id"]: c for c in d["variants"]["ceiling"]["clients"]}
    assert not ceiling[1]["flagged"]
