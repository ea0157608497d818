"""A round's clients trained together (:mod:`fedattr.models.batched`) against one ``train`` per
client: the same losses and updates up to float reassociation, FedIT and FLoRA, uneven clients.

How equivalence is checked: the in-process pool trains the same round both ways from the same
global state, and what each client would submit (its unscaled update, through the plaintext
tap) and its mean training loss are compared. In float64 the two paths differ only by the
order of float additions, so they agree to 1e-9 (relative, each client's whole update); in
float32, where Adam's normalised steps carry rounding from step to step, to 2e-3 (updates)
and 1e-5 (losses). LoRA dropout is off there: the batched path draws other masks (its module
docstring says why), which is checked statistically below.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from conftest import MICRO_TINY
from fedattr.data.corpus import generate_corpus
from fedattr.fl import FedITClient, FLoRAClient
from fedattr.fl.clients import ClientProfile, Profiles
from fedattr.fl.inprocess import InProcessPool
from fedattr.fl.progress import Progress
from fedattr.models.batched import (
    ClientJob,
    _Masks,
    _passes,
    _Schedule,
    train_clients,
)
from fedattr.models.config import LoRAConfig, ModelConfig, TinyModelConfig
from fedattr.models.loading import load_model
from fedattr.models.lora import adapter_state, attach_lora, base_state, load_state
from fedattr.models.text import encode_examples
from fedattr.models.training import TrainSettings, train
from fedattr.secagg import SecAggConfig, make_aggregator

SIZES = (3, 9, 17, 6)
"""Uneven shards: 1, 3, 5 and 2 steps an epoch at batches of 4 (a last batch short of 4)."""


@pytest.fixture(scope="module")
def micro_lm(tiny_cache):
    cfg = ModelConfig(preset="tiny", cache_dir=str(tiny_cache), tiny=TinyModelConfig(**MICRO_TINY))
    model, tok = load_model(cfg)
    records = generate_corpus(sum(SIZES), seed=3)
    examples, start = [], 0
    for n in SIZES:
        examples.append(encode_examples(tok, records[start : start + n], 64))
        start += n
    return model, tok, examples


def _adapted(micro_lm, dropout=0.0, dtype=torch.float32):
    import copy

    model, tok, examples = micro_lm
    peft = attach_lora(copy.deepcopy(model), LoRAConfig(r=4, alpha=8, dropout=dropout), seed=1)
    return peft.to(dtype), tok, examples


PROFILES = Profiles(
    {
        1: ClientProfile(lr_scale=2.5, epochs=3),
        2: ClientProfile(steps=0.4, update_scale=0.5),
        3: ClientProfile(lr_scale=0.3),
    }
)
SETTINGS = TrainSettings(epochs=2, batch_size=4, micro_batch_size=2, lr=3e-3, warmup_ratio=0.2)


def _round(model, tok, examples, strategy, batched: bool, round_id: int = 1):
    """One round of the in-process pool: each client's loss and unscaled update."""
    pool = InProcessPool(
        model, examples, strategy, SETTINGS, tok.pad_token_id, seed=5,
        profiles=PROFILES, batched=batched,
    )  # fmt: skip
    assert pool.batched == batched
    server_state = base_state(model) if isinstance(strategy, FLoRAClient) else adapter_state(model)
    sa = make_aggregator(SecAggConfig(backend="plaintext", min_members=2))
    participants = list(range(len(examples)))
    sa.open_round(round_id, participants)
    tap = pool.open_tap()
    losses = pool.train_round(
        round_id,
        participants,
        server_state,
        sa,
        pool.scales(participants),
        Progress(lambda _m: None),
    )
    sa.close_round()
    return losses, {c: dict(u) for c, u in tap.updates.items()}


def _relative(a: dict, b: dict) -> float:
    diff = torch.cat([(a[k] - b[k]).double().flatten() for k in a]).norm()
    return float(diff / torch.cat([b[k].double().flatten() for k in b]).norm())


@pytest.mark.parametrize("strategy", ["fedit", "flora"])
@pytest.mark.parametrize(
    ("dtype", "update_tol", "loss_tol"),
    [(torch.float64, 1e-9, 1e-6), (torch.float32, 2e-3, 1e-5)],
    ids=["float64", "float32"],
)
def test_clients_trained_together_match_one_after_another(
    micro_lm, strategy, dtype, update_tol, loss_tol
):
    model, tok, examples = _adapted(micro_lm, dtype=dtype)
    client = FedITClient() if strategy == "fedit" else FLoRAClient(scaling=2.0, seed=5)
    start = adapter_state(model)
    one, one_updates = _round(model, tok, examples, client, batched=False)
    load_state(model, start)
    together, together_updates = _round(model, tok, examples, client, batched=True)
    assert one.keys() == together.keys() == {0, 1, 2, 3}
    for c in one:
        assert together[c] == pytest.approx(one[c], rel=loss_tol), c
        assert together_updates[c].keys() == one_updates[c].keys()
        assert _relative(together_updates[c], one_updates[c]) < update_tol, c
    # Every client learned something, the free-rider half of it (update_scale=0.5) included.
    assert all(
        _relative(u, {k: torch.zeros_like(v) for k, v in u.items()}) > 0
        for u in one_updates.values()
    )


def test_steps_tokens_and_early_finishers_match_train(micro_lm):
    model, tok, examples = _adapted(micro_lm, dtype=torch.float64)
    start = adapter_state(model)
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    jobs, expected = [], []
    for c, shard in enumerate(examples):
        settings = PROFILES[c].settings(SETTINGS)
        load_state(model, start)
        expected.append(
            train(
                model,
                params,
                shard,
                settings,
                tok.pad_token_id,
                seed=c,
                stop_after=PROFILES[c].steps,
            )
        )
        jobs.append(ClientJob(dict(start), shard, settings, c, PROFILES[c].steps))
    load_state(model, start)
    finished = []
    results = train_clients(
        model, jobs, tok.pad_token_id, on_done=lambda i, r: finished.append((i, r.steps))
    )
    assert [r.stats()["steps"] for r in results] == [e["steps"] for e in expected]
    assert [r.stats()["tokens"] for r in results] == [e["tokens"] for e in expected]
    # Clients leave as they finish: the shortest first (client 2 stops at 40% of its steps).
    assert [s for _, s in finished] == sorted(s for _, s in finished)
    assert all(j.adapters == {} for j in jobs)  # copied into the stack, not held twice
    assert adapter_state(model).keys() == start.keys()
    assert all(torch.equal(adapter_state(model)[k], start[k]) for k in start)  # untouched


def test_passes_hold_every_row_once_and_keep_to_the_cap(micro_lm):
    _, _, examples = micro_lm
    jobs = [ClientJob({}, shard, SETTINGS, c) for c, shard in enumerate(examples)]
    plans = [_Schedule(j) for j in jobs]
    batches = {c: plans[c].next_batch() for c in range(len(jobs))}
    for cap in (1, 40, 100, 10_000):
        passes = _passes(batches, plans, cap, "cpu")
        seen = {c: [] for c in batches}
        for p in passes:
            for c, members, first in zip(p.clients, p.members, p.first, strict=True):
                assert members == batches[c][first : first + len(members)]  # a run of its order
                seen[c] += members
                assert len(members) <= p.rows
            rows = len(p.clients) * p.rows
            longest = max(plans[c].lengths[m[0]] for c, m in zip(p.clients, p.members, strict=True))
            assert p.width == longest
            assert rows * p.width <= cap or (p.rows == 1 and len(p.clients) == 1)
        assert seen == batches  # every row of the step exactly once, in its client's order
    assert len(_passes(batches, plans, 10_000, "cpu")) == 1


def test_a_clients_masks_keep_the_rate_and_depend_on_its_seed_alone():
    p = 0.05
    masks = _Masks([11, 12, 11], p, torch.device("cpu"))
    first = masks.draw(0, 200_000)
    other = masks.draw(1, 200_000)
    same_seed = masks.draw(2, 200_000)
    assert torch.equal(first, same_seed) and not torch.equal(first, other)
    for m in (first, other):
        rate = 1 - m.double().mean().item()
        assert abs(rate - p) < 4 * (p * (1 - p) / m.numel()) ** 0.5  # within 4 standard errors
    # Drawn in two calls or one: the same stream (a pass may take part of a client's batch).
    again = _Masks([11], p, torch.device("cpu"))
    assert torch.equal(
        torch.cat([again.draw(0, 1000), again.draw(0, 3000)]),
        _Masks([11], p, torch.device("cpu")).draw(0, 4000),
    )
    # Independent across elements: neighbours are dropped together at the rate squared.
    both = (~first[:-1] & ~first[1:]).double().mean().item()
    assert abs(both - p * p) < 4 * (p * p / first.numel()) ** 0.5


def test_with_dropout_the_batched_path_is_the_sequential_one_with_other_masks(
    micro_lm, monkeypatch
):
    """With LoRA dropout the two paths draw different masks. What they train must then differ
    by no more than the sequential path differs from itself when its masks are redrawn (the
    same data order, another dropout seed)."""
    model, tok, examples = _adapted(micro_lm, dropout=0.1, dtype=torch.float64)
    client = FedITClient()
    start = adapter_state(model)
    one, one_updates = _round(model, tok, examples, client, batched=False)
    load_state(model, start)
    together, together_updates = _round(model, tok, examples, client, batched=True)
    load_state(model, start)
    seed = torch.manual_seed
    monkeypatch.setattr(torch, "manual_seed", lambda s: seed(s + 7919))  # other masks only
    redrawn, redrawn_updates = _round(model, tok, examples, client, batched=False)
    monkeypatch.undo()
    spread = max(_relative(redrawn_updates[c], one_updates[c]) for c in one)
    assert 0 < spread < 1
    for c in one:
        assert _relative(together_updates[c], one_updates[c]) < 3 * spread, c
        assert together[c] == pytest.approx(
            one[c], abs=3 * max(abs(redrawn[k] - one[k]) for k in one) + 1e-3
        )
    # Deterministic: the same round again draws the same masks.
    load_state(model, start)
    again, again_updates = _round(model, tok, examples, client, batched=True)
    assert again == together
    assert all(
        torch.equal(again_updates[c][k], together_updates[c][k])
        for c in again
        for k in again_updates[c]
    )


def test_a_strategy_that_cannot_be_stacked_trains_one_client_after_another(micro_lm):
    model, tok, examples = _adapted(micro_lm)

    class Own(FedITClient):
        trains_together = False

    pool = InProcessPool(model, examples, Own(), SETTINGS, tok.pad_token_id, batched=True)
    assert not pool.batched
    assert InProcessPool(
        model, examples, FedITClient(), SETTINGS, tok.pad_token_id, batched=True
    ).batched


def test_a_client_that_drops_out_trains_but_sends_nothing_either_way(micro_lm):
    model, tok, examples = _adapted(micro_lm)
    start = adapter_state(model)
    dropping = Profiles({0: ClientProfile(drop=0.999)}, seed=5)
    assert dropping.drops(1, [0, 1, 2, 3]) == [0]
    seen = []
    for batched in (False, True):
        load_state(model, start)
        pool = InProcessPool(
            model, examples, FedITClient(), SETTINGS, tok.pad_token_id, seed=5,
            profiles=dropping, batched=batched,
        )  # fmt: skip
        sa = make_aggregator(SecAggConfig(backend="plaintext", min_members=2))
        sa.open_round(1, [0, 1, 2, 3])
        tap = pool.open_tap()
        losses = pool.train_round(
            1, [0, 1, 2, 3], adapter_state(model), sa, pool.scales([0, 1, 2, 3]),
            Progress(lambda _m: None),
        )  # fmt: skip
        assert set(losses) == {0, 1, 2, 3} and set(tap.updates) == {1, 2, 3}
        seen.append(losses)
    assert seen[1] == pytest.approx(seen[0], rel=1e-5)


def test_clients_are_trained_together_only_where_it_pays(micro_lm, monkeypatch):
    import fedattr.models.batched as batched

    model, tok, examples = _adapted(micro_lm)
    assert batched.worth_training_together(model, 2, examples)
    assert not batched.worth_training_together(model, 2, examples[:1])  # one client
    # A pass that holds one client's micro-batch only (SmolLM2 on a CPU): one after another.
    longest = max(len(e.input_ids) for shard in examples for e in shard)
    monkeypatch.setattr(batched, "_pass_tokens", lambda m: 2 * longest)
    assert not batched.worth_training_together(model, 2, examples)
    pool = InProcessPool(model, examples, FedITClient(), SETTINGS, tok.pad_token_id, batched=True)
    assert not pool.batched
    monkeypatch.setattr(batched, "_pass_tokens", lambda m: 4 * longest)
    assert batched.worth_training_together(model, 2, examples)
    monkeypatch.setattr(batched, "clients_at_once", lambda m: 1)  # one optimizer state fits
    assert not batched.worth_training_together(model, 2, examples)


def test_jobs_need_every_factor(micro_lm):
    model, tok, examples = _adapted(micro_lm)
    start = adapter_state(model)
    partial = dict(list(start.items())[:-1])
    with pytest.raises(KeyError, match="a job has no"):
        train_clients(model, [ClientJob(partial, examples[0], SETTINGS, 0)], tok.pad_token_id)
    assert train_clients(model, [], tok.pad_token_id) == []
    settings = dataclasses.replace(SETTINGS, max_steps=1)
    (result,) = train_clients(
        model, [ClientJob(dict(start), examples[0], settings, 0)], tok.pad_token_id
    )
    assert result.steps == 1 and np.isfinite(result.loss)


@pytest.mark.parametrize("strategy", ["fedit", "flora"])
def test_a_client_with_no_usable_example_sends_a_zero_update_with_weight_zero(micro_lm, strategy):
    """A shard whose every record is unusable (no token left to learn) no longer refuses the
    run: its client takes part, learns nothing and weighs nothing, on either path."""
    model, tok, examples = _adapted(micro_lm)
    examples = [examples[0], [], examples[2], examples[3]]
    start = adapter_state(model)
    seen = []
    for batched in (False, True):
        load_state(model, start)
        client = FedITClient() if strategy == "fedit" else FLoRAClient(scaling=2.0, seed=5)
        pool = InProcessPool(
            model, examples, client, SETTINGS, tok.pad_token_id, seed=5, batched=batched
        )
        assert pool.data_sizes()[1] == 0 and pool.scales([0, 1, 2, 3])[1] == 0.0
        said: list[str] = []
        sa = make_aggregator(SecAggConfig(backend="plaintext", min_members=2))
        sa.open_round(1, [0, 1, 2, 3])
        tap = pool.open_tap()
        server = base_state(model) if strategy == "flora" else adapter_state(model)
        losses = pool.train_round(
            1, [0, 1, 2, 3], server, sa, pool.scales([0, 1, 2, 3]), Progress(said.append)
        )
        sa.close_round()
        assert set(losses) == {0, 2, 3} and set(tap.updates) == {0, 1, 2, 3}
        idle = tap.updates[1]  # FedIT: its factors' change; FLoRA: its merged B A (B is 0)
        assert idle and all(torch.count_nonzero(v) == 0 for v in idle.values())
        assert any("client 1: no usable example, sends a zero update" in m for m in said)
        seen.append(losses)
    assert seen[1] == pytest.approx(seen[0], rel=1e-5)


def test_a_federation_where_no_client_has_a_usable_example_is_refused_in_one_line(micro_lm):
    from fedattr.errors import UserError
    from fedattr.flower.pool import FlowerPool

    model, tok, _ = _adapted(micro_lm)
    with pytest.raises(UserError, match=r"^data: no client has a usable training example"):
        InProcessPool(model, [[], []], FedITClient(), SETTINGS, tok.pad_token_id)
    with pytest.raises(UserError, match=r"^data: no client has a usable training example"):
        FlowerPool(None, [0, 0])  # type: ignore[arg-type]
