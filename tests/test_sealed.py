"""The sealed mode: shares, Beaver inner products, exact random keys, the owners' rank p, the
first-order reading of shares, each party's view, and the mode's refusals."""

import json

import numpy as np
import pytest
import torch

from conftest import MICRO_TINY, sealed_overrides, small_overrides
from fedattr.attribution.config import AttributionConfig, SealedConfig
from fedattr.attribution.design import DesignError
from fedattr.attribution.sealed import OwnerOpenings, SealedObserver
from fedattr.config import ConfigError
from fedattr.errors import UserError
from fedattr.fl.pool import PlaintextTap
from fedattr.fl.progress import Progress
from fedattr.fl.server import RoundContext
from fedattr.fl.timing import Stopwatch
from fedattr.secagg.beaver import Dealer, decode, encode, shared_inner_products, split
from fedattr.secagg.errors import QueryRefused
from fedattr.secagg.sealed import ShareServer, gaussian, split_update
from fedattr.watermarks.nullkeys import RandomSubsetKeys
from fedattr.watermarks.tail.laws import RowSubsets

# -- shares and the servers' openings ---------------------------------------------------------


def test_reading_shares_add_up_to_the_update_and_each_is_masked():
    flat = np.random.default_rng(0).normal(size=5000) * 1e-3
    a, b = split_update(flat, scale=0.1)
    np.testing.assert_allclose(a + b, flat, rtol=0, atol=1e-15)
    # Each share alone is noise 100x the update: it barely correlates with it.
    assert abs(np.corrcoef(a, flat)[0, 1]) < 0.05
    assert 0.095 < np.std(b) < 0.105
    # Fresh masks each time (a seed never reused), the same for a given seed.
    assert not np.array_equal(split_update(flat, 0.1)[1], b)
    np.testing.assert_array_equal(gaussian(7, 1.0, bytes(32)), gaussian(7, 1.0, bytes(32)))


def test_a_planted_attempt_to_open_one_clients_share_is_refused():
    server = ShareServer("A", min_members=3)
    for c in range(4):
        server.receive(c, np.full(3, float(c)))
    with pytest.raises(QueryRefused, match=r"opening 1 client\(s\) \[2\].*min_members=3"):
        server.total([2])
    with pytest.raises(QueryRefused, match="below min_members=3"):
        server.total([0, 1])
    with pytest.raises(QueryRefused, match="below min_members"):
        server.total([1, 1, 1])  # one client named three times is still one
    np.testing.assert_array_equal(server.total(range(4)), np.full(3, 6.0))
    assert server.opened == [(0, 1, 2, 3)]  # the refused attempts opened nothing
    with pytest.raises(QueryRefused, match="no share of client"):
        server.total([0, 1, 7])


# -- Beaver inner products --------------------------------------------------------------------


def test_beaver_inner_products_are_the_fixed_point_products_to_the_bit():
    gen = torch.Generator().manual_seed(3)
    X = torch.randn(4, 300, generator=gen, dtype=torch.float64) * 5
    y = (torch.rand(300, generator=gen) < 0.25).long()
    Xs, ys = split(encode(X)), split(y)
    (z0, z1), openings = shared_inner_products(Xs, ys, Dealer())
    exact = (encode(X) * y).sum(dim=1)
    assert torch.equal(z0 + z1, exact)  # wrapping int64: exact in the ring
    np.testing.assert_allclose(decode(z0 + z1).numpy(), (X @ y.double()).numpy(), atol=1e-6)
    # What each party publishes is the secret under a one-time pad: it never equals a share
    # of the secret, and a second run on the same secrets publishes something else.
    (_, _), again = shared_inner_products(Xs, ys, Dealer())
    assert not torch.equal(openings[0][0], again[0][0])
    # Each opened D is uniform in the ring: its top bit is set about half the time.
    D = openings[0][0] + openings[1][0]
    assert 0.4 < float((D < 0).double().mean()) < 0.6


# -- random keys and the owners' rank p -------------------------------------------------------


def test_random_subset_keys_are_exact_subsets_the_same_on_every_draw():
    keys = RandomSubsetKeys(40, seed=5, rows=6, cols=20, m=5)
    chunk = keys._chunk(0)
    assert torch.equal(chunk.sum(-1), torch.full((16, 6), 5.0, dtype=torch.float64))
    W = torch.randn(3, 6 * 20, dtype=torch.float64)
    first = keys.values(W)
    assert first.shape == (3, 40)
    torch.testing.assert_close(RandomSubsetKeys(40, 5, 6, 20, 5).values(W), first)
    # A change over fewer rows is read by the keys' first rows.
    short = W[:, : 4 * 20]
    chunks = [keys._chunk(i)[:, :4].reshape(-1, 80) for i in range(3)]  # 16 + 16 + 8 keys
    expected = torch.cat([short @ c.T for c in chunks], dim=1)
    got = keys.values_many([short])[0]
    torch.testing.assert_close(got, expected)
    with pytest.raises(ValueError, match="rows <= 6"):
        keys.values(torch.zeros(1, 7 * 20))


def _owner_p(W_shares, key, n, seed, frac_bits=32):
    """The owners' rank p of each row of ``W = W_A + W_B`` under ``key`` (bool
    ``[rows, cols]``), computed as the sealed mode does: Beaver on the ring shares, random
    keys on each float share."""
    rows, cols = key.shape
    keys = RandomSubsetKeys(n, seed, rows, cols, int(key[0].sum()))
    random = sum(keys.values(w) for w in W_shares)
    ring = tuple(encode(w, frac_bits) for w in W_shares)
    (z0, z1), _ = shared_inner_products(ring, split(key.reshape(-1).long()), Dealer())
    openings = OwnerOpenings(list(range(len(W_shares[0]))), n)
    l1 = sum(w.abs().sum(1).numpy() for w in W_shares)
    openings.add_owner("o", z0 + z1, random, int(key.sum()), frac_bits, l1, rows * cols)
    return openings.p_values("o"), random


def test_the_rank_p_is_exact_under_keys_of_the_owners_own_law():
    from fedattr.watermarks.kgw import KGWScheme

    rows, cols, n, trials = 8, 12, 19, 400
    gen = torch.Generator().manual_seed(11)
    W = torch.randn(1, rows * cols, generator=gen, dtype=torch.float64)
    W[:, :cols] *= 20  # one dominant row: far from a normal tail, still exact
    ps = []
    for trial in range(trials):  # a fresh KGW key (its green lists) each trial, W fixed
        key = KGWScheme(trial, cols, gamma=0.25).green_masks(range(rows))
        p, _ = _owner_p((W, torch.zeros_like(W)), key, n, seed=1000 + trial)
        ps.append(float(p[0]))
    ps = np.array(ps)
    assert set(np.round(ps * (n + 1)).astype(int)) <= set(range(1, n + 2))
    for u in (0.05, 0.25, 0.5):
        sd = np.sqrt(trials * u * (1 - u))  # Binomial(400, u), independent trials
        assert abs(np.sum(ps <= u) - trials * u) < 4 * sd


def test_the_rank_p_tolerance_covers_shares_far_larger_than_the_change():
    rows, cols, n = 6, 16, 63
    gen = torch.Generator().manual_seed(5)
    key = RandomSubsetKeys(1, 77, rows, cols, 4)._chunk(0)[0].bool()
    W = torch.randn(50, rows * cols, generator=gen, dtype=torch.float64)
    W[0] += 3 * (key.reshape(-1).double() - 0.25)  # one client along the key
    noise = 1e4 * torch.randn(W.shape, generator=gen, dtype=torch.float64)
    # Coarse fixed point (16 bits) and shares 10^4 x the change: p never below the exact rank.
    p, _ = _owner_p((W + noise, -noise), key, n, seed=3, frac_bits=16)
    exact, _ = _owner_p((W, torch.zeros_like(W)), key, n, seed=3)
    assert np.all(p >= exact)
    assert p[0] == pytest.approx(1 / (n + 1))  # the client along the key: the smallest p
    assert np.mean(p == exact) > 0.9  # the slack only matters at near-ties


# -- the observer on a linear detector (no language model) ------------------------------------


class _LinearDetector:
    """A detector whose change is a fixed linear map of the update, one part per owner, with
    KGW-like keys (rows of green subsets): the sealed mode's algebra, checked in the clear."""

    def __init__(self, dim: int, rows: int, cols: int, m: int, owners: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.J = {
            f"o{k}": torch.randn(rows * cols, dim, generator=gen, dtype=torch.float64)
            for k in range(owners)
        }
        self.rows, self.cols, self.m = rows, cols, m
        keys = RandomSubsetKeys(owners, seed=99, rows=rows, cols=cols, m=m)
        self.G = {f"o{k}": keys._chunk(0)[k].bool() for k in range(owners)}

    def first_order(self, params, tangents):
        return [
            {p: (J @ t["x.lora_A"].reshape(-1).double()).float() for p, J in self.J.items()}
            for t in tangents
        ]

    def observe(self, params):
        return None

    def key_laws(self):
        return {p: RowSubsets(self.m, self.cols) for p in self.J}

    def owner_keys(self, part):
        return {part: self.G[part]}


def _ctx(round_id, updates, reference, scales=None):
    """Round ``round_id``'s context: the clients of ``updates`` answered; the SA mean as the
    engine takes it (each update times its scale, over the scales' sum)."""
    scales = scales or dict.fromkeys(updates, 1.0)
    total = sum(scales[c] * u["x.lora_A"] for c, u in updates.items())
    mean = {"x.lora_A": total / sum(scales[c] for c in updates)}
    return RoundContext(
        round=round_id,
        rounds=2,
        participants=sorted(updates),
        answered=tuple(sorted(updates)),
        sa=None,
        reference=reference,
        mean_update=mean,
        apply=None,
        losses={},
        timing=Stopwatch(("scoring_s",)),
        progress=Progress(lambda _m: None),
    )


def _sealed(**sealed) -> AttributionConfig:
    """The sealed mode without a taper (the linear detector has no reference probabilities)."""
    config = AttributionConfig()
    config.protocol.mode = "sealed"
    config.calibrated.taper = 0.0
    config.sealed = SealedConfig(**sealed)
    return config


def test_the_owners_values_are_those_of_the_clients_changes_read_in_the_clear(tmp_path):
    det = _LinearDetector(dim=1000, rows=5, cols=16, m=4, owners=2)
    config = _sealed(random_keys=63)
    tap = PlaintextTap()
    # Unequal FedAvg scales; client 3 joins in round 2, client 2 sits it out.
    rounds = [{0: 0.5, 1: 1.5, 2: 1.0}, {0: 2.0, 1: 0.5, 3: 1.5}]

    def scales(ps):
        return {c: rounds[len(obs.records)][c] for c in ps}

    obs = SealedObserver(config, det, tap, scales, 3, folder=tmp_path)
    gen = torch.Generator().manual_seed(1)
    # Masks 100x the reference's factors, 100x the updates: float32 readings of the shares
    # add up to the update's to ~1e-7 x 100 x sqrt(1000 coordinates) (~1e-4 here).
    reference = {"x.lora_A": 1e-2 * torch.randn(20, 50, generator=gen)}
    expected = {c: dict.fromkeys(det.J, 0.0) for c in range(4)}
    law = RowSubsets(4, 16)
    for t, scales in enumerate(rounds, start=1):
        tap.updates = {c: {"x.lora_A": torch.randn(20, 50, generator=gen) * 1e-2} for c in scales}
        ctx = _ctx(t, tap.updates, reference, scales)
        mean = ctx.mean_update["x.lora_A"].reshape(-1).double()
        for part, J in det.J.items():
            centre = law.centre(J @ mean).reshape(-1)  # the aggregate's change, round 1 only
            for c, u in tap.updates.items():
                flat = scales[c] * u["x.lora_A"].reshape(-1).double()
                change = law.centre(J @ flat).reshape(-1)
                expected[c][part] = expected[c][part] + change - (centre if t == 1 else 0.0)
        obs.round_closed(ctx)
        assert obs.records[-1]["sealed"]["aggregate_vs_sa"] < 1e-5
    report = obs.fedattr.report({0: True, 1: False, 2: False, 3: False})
    opened = obs.owner_openings
    for part in sorted(det.J):
        values = [float(expected[c][part] @ det.G[part].reshape(-1).double()) for c in range(4)]
        np.testing.assert_allclose(opened.owner[part], values, rtol=1e-4, atol=1e-4)
    # p-values on the random keys' grid; the report and the parties' record.
    assert {r.tail for r in report.clients} == {"random-keys"}
    assert report.null_keys == 63
    assert obs.fedattr.report(None).clients[0].watermarked is None  # a new truth, a new report
    views = json.loads((tmp_path / "parties.json").read_text())
    assert [r["round"] for r in views["rounds"]] == [1, 2]
    assert views["rounds"][0]["server A"]["opened"] == [[0, 1, 2]]
    assert views["rounds"][1]["server B"]["opened"] == [[0, 1, 3]]
    assert "attack_on_server_A" in views
    assert obs.summary()["share_reads"] == 2 * 3 * 2  # two servers, three shares, two rounds
    # A server's share of a client's mean update is noise: the best scaled guess from it (its
    # scale fitted on the truth) is off by 90% or more. Over 1,000 coordinates a share 100x the
    # update points along it by chance only: cos^2 ~ Beta(1/2, 999/2), above 0.19 about never
    # (over ten coordinates 20% of the time: a median of four clients then fails one run in six).
    attack = obs.attack()
    assert attack["shares_median"] > 0.9


def test_a_sum_too_large_for_the_ring_is_refused_in_the_round_it_appears():
    det = _LinearDetector(dim=10, rows=5, cols=16, m=4, owners=1)
    config = _sealed(mask_scale=1e9, frac_bits=40)
    tap = PlaintextTap()
    obs = SealedObserver(config, det, tap, lambda ps: dict.fromkeys(ps, 1.0), 3)
    tap.updates = {c: {"x.lora_A": torch.full((2, 5), 1e-2)} for c in range(4)}
    with pytest.raises(UserError, match="frac_bits: 40 leaves no room in the ring"):
        obs.round_closed(_ctx(1, tap.updates, {"x.lora_A": torch.ones(2, 5)}))


def test_a_sealed_run_cut_after_a_round_resumes_to_the_same_owner_values(tmp_path):
    import copy

    det = _LinearDetector(dim=10, rows=5, cols=16, m=4, owners=1)
    config = _sealed(random_keys=31)
    scales = lambda ps: dict.fromkeys(ps, 1.0)  # noqa: E731
    gen = torch.Generator().manual_seed(2)
    reference = {"x.lora_A": 1e-2 * torch.randn(2, 5, generator=gen)}
    rounds = [
        {c: {"x.lora_A": torch.randn(2, 5, generator=gen) * 1e-2} for c in range(4)}
        for _ in range(2)
    ]
    whole, first = (SealedObserver(config, det, PlaintextTap(), scales, 3) for _ in range(2))
    for t, updates in enumerate(rounds, start=1):
        whole.tap.updates = updates
        whole.round_closed(_ctx(t, updates, reference))
    first.tap.updates = rounds[0]
    first.round_closed(_ctx(1, rounds[0], reference))
    resumed = SealedObserver(config, det, PlaintextTap(), scales, 3)
    resumed.load(copy.deepcopy(first.state()))
    resumed.tap.updates = rounds[1]
    resumed.round_closed(_ctx(2, rounds[1], reference))
    truth = dict.fromkeys(range(4), False)
    a, b = whole.fedattr.report(truth), resumed.fedattr.report(truth)
    # Fresh masks in every session: the same values up to the shares' float32 rounding.
    np.testing.assert_allclose(
        resumed.owner_openings.owner["o0"], whole.owner_openings.owner["o0"], rtol=1e-4
    )
    assert [r.p for r in a.clients] == [r.p for r in b.clients]
    assert [r["round"] for r in resumed.records] == [1, 2]


# -- the first-order reading of a real model --------------------------------------------------


def test_the_first_order_reading_of_shares_adds_up_to_the_updates(micro):
    from fedattr.data.corpus import generate_corpus
    from fedattr.models.config import LoRAConfig
    from fedattr.models.lora import adapter_state, attach_lora, load_state
    from fedattr.models.text import encode_examples
    from fedattr.watermarks.kgw import KGWScheme
    from fedattr.watermarks.radioactivity import KGWReadingScorer

    _, model, tok = micro
    model = attach_lora(model, LoRAConfig(r=4, alpha=8), seed=0)
    texts = encode_examples(tok, generate_corpus(8, seed=2), 64)
    scorer = KGWReadingScorer(model, texts, {"o": KGWScheme(1, len(tok))}, load_state)
    ref = adapter_state(model)
    gen = torch.Generator().manual_seed(4)
    ref = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in ref.items()}
    u = {k: 1e-3 * torch.randn(v.shape, generator=gen) for k, v in ref.items()}
    R = {k: 0.1 * torch.randn(v.shape, generator=gen) for k, v in ref.items()}
    (Ju,) = scorer.first_order(ref, [u])
    # The limit of small steps: a central difference agrees to its truncation.
    h = 1.0
    plus = scorer.observe({k: ref[k] + h * u[k] for k in ref})
    minus = scorer.observe({k: ref[k] - h * u[k] for k in ref})
    fd = (plus - minus).double() / (2 * h)
    assert float((fd - Ju["probes"]).norm() / Ju["probes"].norm()) < 1e-2
    # Linear: two shares 100x the update read one by one add up to the update's reading.
    a, b = scorer.first_order(ref, [{k: u[k] + R[k] for k in u}, {k: -R[k] for k in u}])
    total = a["probes"].double() + b["probes"].double()
    assert float((total - Ju["probes"]).norm() / Ju["probes"].norm()) < 1e-3
    # Rows of a change of distributions sum to zero.
    assert float(Ju["probes"].sum(1).abs().max()) < 1e-5
    # At a fresh adapter (B = 0: FedIT's first round) an update of B still moves the model.
    fresh = {k: torch.zeros_like(v) if k.endswith("lora_B") else v for k, v in ref.items()}
    (at_zero,) = scorer.first_order(fresh, [u])
    step = scorer.observe({k: fresh[k] + 1e-2 * u[k] for k in fresh})
    fd = (step - scorer.observe(fresh)).double() / 1e-2
    assert float(at_zero["probes"].norm()) > 0
    assert float((fd - at_zero["probes"]).norm() / at_zero["probes"].norm()) < 5e-2


# -- a run, and what the mode refuses ---------------------------------------------------------


def test_a_sealed_run_opens_only_the_aggregate_and_each_owners_values(tiny_cache, tmp_path):
    from fedattr.config import load
    from fedattr.pipeline.config import RunConfig
    from fedattr.pipeline.run import run_experiment
    from fedattr.reporting.run_folder import RunFolder

    cfg = load(RunConfig, None, sealed_overrides(tiny_cache))
    folder = RunFolder(tmp_path / "run")
    result = run_experiment(cfg, progress=lambda _m: None, folder=folder)
    folder.path.mkdir(parents=True, exist_ok=True)
    out = result.to_dict()
    assert out["mode"] == "sealed" and out["sa_queries"] == 2  # the two rounds' aggregates
    assert out["sealed"]["random_keys"] == 31 and out["sealed"]["share_reads"] == 2 * 2 * 4
    assert result.changes == {}  # no change is ever held in the clear
    for c in out["clients"]:
        assert c["tail"] == "random-keys"
        k = c["p_rank"] * 32 / 2  # Bonferroni over two owners of a rank k among 32
        assert c["p_rank"] == 1.0 or abs(k - round(k)) < 1e-9
    views = json.loads((folder.path / "parties.json").read_text())
    assert len(views["rounds"]) == 2
    assert set(views["end"]) >= {"server A", "server B", "dealer", "owner kgw:owner0"}


@pytest.mark.parametrize(
    ("sets", "match"),
    [
        (["fl.strategy=flora"], "needs fl.strategy=fedit"),
        (["watermark.kind=fk", "watermark.r=1"], "watermark.kind=kgw"),
        (["attribution.statistic=paper"], "needs statistic=calibrated"),
        (["attribution.sealed.mask_scale=0"], "mask_scale: must be a number > 0"),
        (["attribution.sealed.frac_bits=50"], "frac_bits: must be an integer in 16..40"),
    ],
)
def test_the_sealed_mode_refuses_what_it_cannot_read_in_one_line(tiny_cache, sets, match):
    from fedattr.config import load
    from fedattr.pipeline.config import RunConfig

    with pytest.raises((ConfigError, DesignError, ValueError), match=match):
        sealed = small_overrides(tiny_cache, "attribution.protocol.mode=sealed", *sets)
        load(RunConfig, None, sealed)


def test_the_sealed_mode_needs_no_subset_design_but_a_quorum_a_round(tiny_cache):
    from fedattr.config import load
    from fedattr.pipeline.config import RunConfig

    sealed = small_overrides(tiny_cache, "attribution.protocol.mode=sealed", "fl.K=6")
    # Three clients a round: no N < 2 design exists, yet the sealed mode asks for none.
    load(RunConfig, None, [*sealed, "fl.participation=0.5", "secagg.min_members=3"])
    with pytest.raises(ValueError, match=r"secagg\.min_members=4 clients or more"):
        load(RunConfig, None, [*sealed, "fl.participation=0.5", "secagg.min_members=4"])


def test_a_remote_runtime_without_the_parties_refuses_the_sealed_mode(tiny_cache):
    from fedattr.config import load
    from fedattr.pipeline.config import RunConfig, require_in_process

    cfg = load(RunConfig, None, small_overrides(tiny_cache, "attribution.protocol.mode=sealed"))
    with pytest.raises(UserError, match="runs it only with its share servers and owners"):
        require_in_process(cfg)


def test_the_synthetic_demo_refuses_the_sealed_mode():
    from fedattr.config import load
    from fedattr.pipeline.config import DemoConfig
    from fedattr.pipeline.run import run_demo

    cfg = load(DemoConfig, None, ["attribution.protocol.mode=sealed"])
    with pytest.raises(UserError, match="synthetic demo has none"):
        run_demo(cfg, progress=lambda _m: None)


def test_sealed_config_sizes_its_random_keys_to_the_level():
    assert SealedConfig().keys_for(0.01 / 30) == 4095
    assert SealedConfig().keys_for(0.01 / 250) == 32767
    assert SealedConfig(random_keys=99).keys_for(1e-9) == 99
    assert MICRO_TINY  # the micro model the run tests use
