"""De-mixing hardened rounds across rounds (``attribution.calibrated.across_rounds = "demix"``)."""

import numpy as np
import pytest
import torch
from scipy.stats import binom

from fedattr.attribution import LinearScorer
from fedattr.attribution.calibrated.demix import DeMixer
from fedattr.attribution.calibrated.sums import CalibratedNull
from fedattr.attribution.config import AttributionConfig, CalibratedConfig
from fedattr.attribution.scoring import DEFAULT_STATISTIC
from fedattr.config import load
from fedattr.errors import UserError
from fedattr.pipeline.config import DemoConfig
from fedattr.pipeline.run import run_demo
from fedattr.watermarks.tail.laws import Directions

PART = DEFAULT_STATISTIC


class _Row:
    """A fused query's design: weight 1 on the target, ``alpha`` on the others."""

    def __init__(self, target: int, alpha: dict[int, float]) -> None:
        self.target, self.alpha = target, alpha

    def coefficients(self) -> dict[int, float]:
        return {**self.alpha, self.target: 1.0}


def _rows(rng, members, targets, scale=0.5):
    """Hardened-like rows over ``members``: a few targets, each with zero-sum alphas over the
    other members."""
    out = []
    for t in targets:
        others = [j for j in members if j != t]
        a = rng.normal(size=len(others)) * scale
        a -= a.mean()
        out.append(_Row(t, dict(zip(others, a, strict=True))))
    return out


def _changes(rows, X):
    """Each row's estimate ``sum_j coefficient_j X_j``."""
    return [{PART: sum(c * X[j] for j, c in r.coefficients().items()).float()} for r in rows]


def _round(rng, K, X, targets, scale=0.5):
    """One round's designs, the targets' changes ``A X`` and the SA mean's change."""
    rows = _rows(rng, range(K), targets, scale)
    return rows, _changes(rows, X), {PART: X.mean(0).float()}


def test_demixing_recovers_each_persistent_mean_and_cancels_a_persistent_signal():
    rng = np.random.default_rng(0)
    K, dim, T = 6, 8, 6
    m = torch.tensor(rng.normal(size=(K, dim)))
    signal = torch.zeros(K, dim)
    signal[0] = 5.0  # client 0 carries the same key-aligned change every round
    laws = {PART: Directions(dim)}
    runs = {}
    for name, base in (("plain", m), ("marked", m + signal)):
        mixer, r = DeMixer(), np.random.default_rng(1)
        for _ in range(T):
            targets = sorted(r.choice(K, 2, replace=False).tolist())
            rows, changes, mean = _round(r, K, base, targets)
            mixer.add(targets, rows, changes, laws, None, (list(range(K)), mean))
        own, ok = mixer.solve()
        assert ok == list(range(K))  # no round identifies anyone, the stack identifies all
        runs[name] = own[PART]
        for j in range(K):
            assert runs[name][j].numpy() == pytest.approx(base[j].numpy(), abs=1e-4)
    # Every other client's de-mixed change is the same with and without client 0's signal.
    for j in range(1, K):
        assert runs["marked"][j].numpy() == pytest.approx(runs["plain"][j].numpy(), abs=1e-4)


def test_a_client_no_stacked_round_identifies_is_left_out():
    K, dim = 5, 4
    X = torch.tensor(np.random.default_rng(2).normal(size=(K, dim)))
    mixer = DeMixer()
    rows, changes, _ = _round(np.random.default_rng(3), K, X, [0])
    mixer.add([0], rows, changes, {PART: Directions(dim)})
    assert mixer.solve()[1] == []


def _federation(seed, K, T, dim, key, marked, signal, alpha, noise=1.0):
    """A hardened-like federation read by a CalibratedNull per rule: each round two targets,
    one clean target with a large alpha on the watermarked client (the planted cross-talk)."""
    rng = np.random.default_rng(seed)
    common = torch.tensor(rng.normal(size=dim))
    rounds = []
    for _t in range(T):
        X = torch.tensor(rng.normal(size=(K, dim))) * noise + common
        for j in marked:
            X[j] = X[j] + signal * key
        targets = sorted(rng.choice(K, 2, replace=False).tolist())
        rows = _rows(rng, range(K), targets)
        for r in rows:
            if r.target not in marked and marked:
                r.alpha[marked[0]] = alpha
        rounds.append((targets, rows, _changes(rows, X), {PART: X.mean(0).float()}))
    return rounds


def _read(rounds, K, scorer, **kw):
    null = CalibratedNull(alpha=0.01, null_keys=0, decorrelate=False, **kw)
    for t, (targets, rows, changes, mean) in enumerate(rounds, 1):
        null.add_round(null.plan(t, list(range(K)), targets, rows, scorer), changes, mean, scorer)
    return null


def test_a_planted_cross_talk_names_a_clean_client_under_the_old_rule_only():
    """One watermarked client (0) with a large alpha in every clean target's estimate: kept
    and summed, its signal makes clean clients look marked (named under name_uncalibrated);
    de-mixed, it is removed from theirs and only client 0 is named, calibrated."""
    K, T, dim = 6, 12, 64
    key = torch.tensor(np.random.default_rng(9).normal(size=dim))
    key = key / key.norm()
    scorer = LinearScorer(key)
    rounds = _federation(5, K, T, dim, key, [0], signal=4.0, alpha=2.0, noise=0.3)
    truth = {j: j == 0 for j in range(K)}
    old = _read(rounds, K, scorer, across_rounds="keep", name_uncalibrated=True).report(truth)
    assert any(c.flagged and not c.watermarked for c in old.clients)
    new = _read(rounds, K, scorer).report(truth)
    by = {c.id: c for c in new.clients}
    assert by[0].flagged and all(c.calibrated for c in new.clients) and not new.cross_talk
    assert not any(c.flagged for c in new.clients if not c.watermarked)
    # A client only the kept rounds would identify is reported uncalibrated, never named.
    short = _read(rounds[:1], K, scorer).report(truth)
    assert short.cross_talk == list(range(K)) and not short.flagged


def test_demixed_null_p_values_are_uniform_where_the_key_law_is_exact():
    """No watermarked client: each clean client's de-mixed change is a function of updates
    drawn independently of the key, so under a random key its p is uniform. The owner's key
    is drawn afresh per federation (the law the exact tail describes): P(p <= u) = u."""
    K, T, dim, n = 5, 6, 6, 120
    p = []
    for seed in range(n):
        rng = np.random.default_rng([seed, 7])
        key = torch.tensor(rng.normal(size=dim))
        rounds = _federation(seed, K, T, dim, key / key.norm(), [], 0.0, 0.0)
        null = _read(rounds, K, LinearScorer(key))
        p += [c.p for c in null.report({j: False for j in range(K)}).clients]
    p = np.array(p)
    assert len(p) == n * K
    for u in (0.05, 0.2, 0.5):
        lo, hi = binom.ppf([0.0005, 0.9995], len(p), u)
        assert lo <= np.sum(p <= u) <= hi


def test_across_rounds_is_checked():
    with pytest.raises(UserError, match=r"attribution\.calibrated\.across_rounds: unknown 'sum'"):
        AttributionConfig(calibrated=CalibratedConfig(across_rounds="sum"))


def test_hardened_synthetic_run_names_by_the_demixed_statistic_by_default():
    cfg = load(
        DemoConfig,
        None,
        [
            "synthetic.common=1.0",
            "synthetic.heterogeneity=0.5",
            "synthetic.dim=256",
            "secagg.backend=plaintext",
            "synthetic.seed=0",
            "synthetic.r=3",
            "synthetic.signal=6",
            "synthetic.rounds=8",
            "attribution.protocol.mode=hardened",
        ],
    )
    rep = run_demo(cfg, progress=lambda _m: None).report
    assert not rep.cross_talk and all(c.calibrated for c in rep.clients)
    assert rep.flagged and all(c.watermarked for c in rep.clients if c.flagged)


def test_a_checkpoint_keeps_the_stacked_rounds():
    K, T, dim = 6, 8, 32
    key = torch.tensor(np.random.default_rng(4).normal(size=dim))
    scorer = LinearScorer(key)
    rounds = _federation(6, K, T, dim, key / key.norm(), [0], signal=4.0, alpha=1.0, noise=0.3)
    truth = {j: j == 0 for j in range(K)}
    whole = _read(rounds, K, scorer).report(truth)
    first = _read(rounds[:5], K, scorer)
    resumed = CalibratedNull(alpha=0.01, null_keys=0, decorrelate=False)
    resumed.load(first.state())
    for t, (targets, rows, changes, mean) in enumerate(rounds[5:], 6):
        resumed.add_round(
            resumed.plan(t, list(range(K)), targets, rows, scorer), changes, mean, scorer
        )
    again = resumed.report(truth)
    assert [c.log10_p for c in again.clients] == pytest.approx([c.log10_p for c in whole.clients])
    # Loaded after the last round, the stacked rounds are read once the scorer is lent again.
    done = CalibratedNull(alpha=0.01, null_keys=0, decorrelate=False)
    done.load(resumed.state())
    done.read_with(scorer)
    assert [c.log10_p for c in done.report(truth).clients] == pytest.approx(
        [c.log10_p for c in whole.clients]
    )


class _OneGreenScorer:
    """A KGW-like owner over a ``[rows, V]`` change: its key one green column per row (the
    ``RowSubsets(1, V)`` law), so every key of a small bed can be enumerated."""

    exchangeable_rounds = None

    def __init__(self, green: tuple[int, ...], V: int) -> None:
        self.G = torch.zeros(len(green), V, dtype=torch.bool)
        self.G[torch.arange(len(green)), torch.tensor(green)] = True

    def key_laws(self):
        from fedattr.watermarks.tail.laws import RowSubsets

        return {PART: RowSubsets(1, self.G.shape[1])}

    def owner_values(self, part, W):
        return {"owner": float(W.reshape(self.G.shape).double()[self.G].sum())}


def _enumerated_p(marked: list[int], cv: float = 0.0) -> np.ndarray:
    """Every client's de-mixed p under each of the 64 keys of a bed small enough to enumerate
    them (3 rows x 4 columns, one green column a row). Each key in turn is the owner's, and the
    ``marked`` clients add a change on that key's green cells, the same every round (``cv`` =
    0) or scaled by a Gamma draw of mean 1 and coefficient of variation ``cv`` per round;
    everything else is the same federation under every key."""
    import itertools

    K, T, rows, V = 5, 6, 3, 4
    keys = list(itertools.product(range(V), repeat=rows))
    p = np.zeros((len(keys), K))
    for k, green in enumerate(keys):
        scorer = _OneGreenScorer(green, V)
        rng = np.random.default_rng(11)
        base = torch.tensor(rng.normal(size=(K, rows * V)))
        rounds = []
        for _t in range(T):
            X = base + 0.5 * torch.tensor(rng.normal(size=(K, rows * V)))
            strength = rng.gamma(1 / cv**2, cv**2) if cv else 1.0
            for j in marked:
                X[j] = X[j] + 3.0 * strength * scorer.G.reshape(-1).double()
            targets = sorted(rng.choice(K, 2, replace=False).tolist())
            designs = _rows(rng, range(K), targets)
            changes = [
                {PART: sum(c * X[j] for j, c in d.coefficients().items()).reshape(rows, V).float()}
                for d in designs
            ]
            rounds.append((targets, designs, changes, {PART: X.mean(0).reshape(rows, V).float()}))
        report = _read(rounds, K, scorer).report({j: j in marked for j in range(K)})
        p[k] = [c.p for c in sorted(report.clients, key=lambda c: c.id)]
    return p


LEVELS_64 = (1 / 64, 0.05, 0.1, 0.25, 0.5)


@pytest.mark.parametrize("marked", [[], [0]])
def test_demixed_level_holds_for_every_clean_client_over_every_key(marked):
    """For every clean client, the share of the 64 keys under which its de-mixed p is <= u is
    at most u: exactly so without a watermark (a clean client's de-mixed change does not
    depend on the key), conservatively with a persistent one (its contamination cancels
    across rounds; the cell-wise median carries a little of the marked client's key)."""
    p = _enumerated_p(marked)
    for i in set(range(p.shape[1])) - set(marked):
        for u in LEVELS_64:
            assert np.mean(p[:, i] <= u + 1e-12) <= u + 1e-12, (i, u)
    if marked:  # and the marked client's own evidence shows under most keys
        assert np.mean(p[:, 0] <= 0.05) > 0.5


def test_a_signal_that_varies_across_rounds_can_break_the_demixed_level():
    """What de-mixing does not cancel: a marked client whose key-aligned change varies from
    round to round (coefficient of variation 1) leaves a key-aligned residue in the clean
    clients' de-mixed changes, of either sign; on this bed one clean client is named under
    11% of the keys at u = 0.05 (docs/results/calibration.md: the synthetic bed and the
    embedded default measure where that matters)."""
    p = _enumerated_p([0], cv=1.0)
    excess = [np.mean(p[:, i] <= u) - u for i in range(1, p.shape[1]) for u in LEVELS_64]
    assert max(excess) > 0.05


class _LearnedScorer(LinearScorer):
    """A linear owner whose key the reference may have learned from round 2 (as KGW's, FK's)."""

    exchangeable_rounds = 1


def _learned_federation(seed, K=8, T=8, n=4, dim=64):
    """Half the clients a round, two hardened-like targets each: client 0 watermarked (a large
    key-aligned change in round 1, smaller later), every other client forgetting what the
    reference learned in the round before (more after a round with client 0), client 1 a
    free-rider sending nothing."""
    rng = np.random.default_rng(seed)
    key = torch.tensor(rng.normal(size=dim))
    key = key / key.norm()
    base = torch.tensor(rng.normal(size=(K, dim))) * 0.3
    rounds, learned = [], 0.0
    for t in range(T):
        P = sorted(rng.choice(K, n, replace=False).tolist())
        common = torch.tensor(rng.normal(size=dim)) * 0.2
        X = torch.zeros(K, dim, dtype=torch.float64)
        for j in P:
            X[j] = base[j] + common + 0.1 * torch.tensor(rng.normal(size=dim))
            X[j] += (6.0 if t == 0 else 2.0) * key if j == 0 else -learned * key
        X[1] = 0.0
        learned = 3.0 * rng.random() if 0 in P else 0.3 * rng.random()
        targets = sorted(rng.choice(P, 2, replace=False).tolist())
        rows = _rows(rng, P, targets, 0.7)
        rounds.append((P, targets, rows, _changes(rows, X), {PART: X[P].mean(0).float()}))
    return rounds, _LearnedScorer(key)


def _learned_null(seed, **kw):
    """:func:`_learned_federation` read: the sums, the scorer and every round's participants."""
    rounds, scorer = _learned_federation(seed)
    null = CalibratedNull(alpha=0.01, null_keys=0, decorrelate=False, **kw)
    for t, (P, targets, rows, changes, mean) in enumerate(rounds, 1):
        null.add_round(null.plan(t, P, targets, rows, scorer), changes, mean, scorer)
    return null, scorer, sorted({j for r in rounds for j in r[0]})


def _read_learned(seed, **kw):
    null, _, members = _learned_null(seed, **kw)
    return null.report({j: j == 0 for j in range(8)}), members


def test_a_free_rider_de_mixed_past_round_1_is_named_when_read_and_never_by_default():
    """Once the reference has learned the key, a free-rider's de-mixed change is nothing but the
    other clients' round-to-round changes, which depend on the key (forgetting, learning): read
    against the exact tail it is named in many federations; reported uncalibrated (hardened
    mode's default) it is never named, and every client is marked uncalibrated."""
    read = [_read_learned(s, late_demix="read")[0] for s in range(20)]
    assert sum(1 in r.flagged for r in read) >= 5
    for s in range(20):
        rep, members = _read_learned(s, late_demix="uncalibrated")
        assert not rep.flagged and rep.cross_talk == members
        assert not any(c.calibrated for c in rep.clients if c.id in members)
    named, _ = _read_learned(0, late_demix="uncalibrated", name_uncalibrated=True)
    assert 0 in named.flagged  # reported all the same, and named where asked
    from fedattr.reporting.markdown import attribution_table

    assert "late_demix = uncalibrated" in attribution_table(rep)  # the report says why


def test_a_checkpoint_keeps_that_a_late_round_was_de_mixed():
    null, scorer, _ = _learned_null(3, late_demix="uncalibrated")
    truth = {j: j == 0 for j in range(8)}
    resumed = CalibratedNull(alpha=0.01, null_keys=0, decorrelate=False, late_demix="uncalibrated")
    resumed.load(null.state())
    resumed.read_with(scorer)
    assert resumed.report(truth).cross_talk == null.report(truth).cross_talk != []


def test_late_demix_defaults_to_uncalibrated_in_hardened_mode_only():
    def of(mode):
        return CalibratedNull.of(load(AttributionConfig, None, [f"protocol.mode={mode}"]))

    assert of("hardened").late_demix == "uncalibrated"
    assert of("paper").late_demix == "read"
    cfg = load(AttributionConfig, None, ["protocol.mode=hardened", "calibrated.late_demix=read"])
    assert CalibratedNull.of(cfg).late_demix == "read"
    with pytest.raises(UserError, match="late_demix"):
        load(AttributionConfig, None, ["calibrated.late_demix=sometimes"])


def test_a_round_whose_every_answering_client_is_a_target_de_mixes_to_each_ones_own_change():
    """Paper mode's rounds with dropouts: every client that answered is a target with a design
    over the clients that answered, so the round identifies each one's change and the de-mixed
    mean is the mean of its own changes, however the others' vary from round to round (why
    ``late_demix`` reads them as calibrated there)."""
    rng = np.random.default_rng(21)
    K, dim, T = 6, 8, 5
    laws = {PART: Directions(dim)}
    mixer, own_changes = DeMixer(), {j: [] for j in range(K)}
    for _ in range(T):
        answered = sorted(rng.choice(K, 4, replace=False).tolist())
        X = torch.tensor(rng.normal(size=(K, dim))) * torch.tensor(rng.gamma(1.0, 3.0, size=(K, 1)))
        rows = _rows(rng, answered, answered)
        mixer.add(answered, rows, _changes(rows, X), laws)
        for j in answered:
            own_changes[j].append(X[j])
    own, ok = mixer.solve()
    assert sorted(ok) == [j for j in range(K) if own_changes[j]]
    for j in ok:
        expected = torch.stack(own_changes[j]).mean(0)
        assert own[PART][j].numpy() == pytest.approx(expected.numpy(), abs=1e-4)
