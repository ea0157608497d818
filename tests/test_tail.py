"""Exact tails of a statistic linear in the key (fedattr.watermarks.tail)."""

import itertools
import math

import numpy as np
import pytest
import torch

from fedattr.watermarks.tail.cgf import BernoulliCells, RowDraws, RowSubsetsBound
from fedattr.watermarks.tail.laws import Directions, RowSubsets, law_from_dict
from fedattr.watermarks.tail.methods import (
    RowPatternsBound,
    chernoff_log10_sf,
    effective_cells,
    saddlepoint_log10_sf,
    shifted_keys_p,
    tilted_monte_carlo,
)


def _centred(W):
    return W - W.mean(axis=1, keepdims=True)


def test_saddlepoint_agrees_with_tilted_monte_carlo_far_in_the_tail():
    rng = np.random.default_rng(1)
    W = _centred(rng.standard_t(3, size=(40, 256)))  # heavy-tailed cells, as a change's are
    sd = math.sqrt(0.25 * 0.75 * (W**2).sum())
    for z in (3.0, 5.0, 8.0):
        sp = 10 ** saddlepoint_log10_sf(BernoulliCells(W.reshape(-1), 0.25), z * sd)
        mc, rel = tilted_monte_carlo(W, 0.25, z * sd, 3000, seed=2)
        assert rel < 0.1
        assert sp == pytest.approx(mc, rel=0.25)


def test_fixed_size_rows_agree_with_their_saddlepoint_in_the_bulk():
    rng = np.random.default_rng(5)
    rows, V, m = 20, 64, 16
    W = _centred(rng.normal(size=(rows, V)))
    law = RowSubsets(m, V)
    idx = torch.rand(40_000, rows, V, generator=torch.Generator().manual_seed(0)).argsort(-1)
    mask = torch.zeros(40_000, rows, V, dtype=torch.float64).scatter_(2, idx[..., :m], 1.0)
    T = (mask * torch.tensor(W)).sum((1, 2)).numpy()
    assert T.std() == pytest.approx(math.sqrt(law.variance(torch.tensor(W))), rel=0.02)
    t = float(np.quantile(T, 0.99))
    tail = law.tail(torch.tensor(W), t)
    assert tail.method == "saddlepoint" and tail.p == pytest.approx(0.01, rel=0.15)


def test_chernoff_bounds_the_fixed_size_tail_from_above():
    rng = np.random.default_rng(6)
    W = _centred(np.zeros((3, 32)))
    W[:, 0], W[:, 1] = 3.0, -1.0  # a change on a handful of cells: few effective cells
    W = _centred(W + 0.01 * rng.normal(size=W.shape))
    assert effective_cells(W) < 30
    law = RowSubsets(8, 32)
    idx = torch.rand(100_000, 3, 32, generator=torch.Generator().manual_seed(1)).argsort(-1)
    mask = torch.zeros(100_000, 3, 32, dtype=torch.float64).scatter_(2, idx[..., :8], 1.0)
    T = (mask * torch.tensor(W)).sum((1, 2)).numpy()
    for t in (2.0, 5.0, 8.0):
        tail = law.tail(torch.tensor(W), t)
        # The patterns' bound is close to the exact tail here: Monte Carlo's own error counts.
        mc = np.mean(t <= T)
        assert tail.method in ("patterns", "chernoff")
        assert tail.p >= mc - 3 * math.sqrt(mc * (1 - mc) / len(T))
    assert chernoff_log10_sf(RowDraws(W, 8), -1.0) == 0.0


def test_one_pick_per_row_is_exact_by_enumeration():
    rng = np.random.default_rng(7)
    W = _centred(rng.normal(size=(4, 6)))
    law = RowSubsets(1, 6)
    sums = np.array(
        [sum(W[r, c] for r, c in enumerate(cs)) for cs in itertools.product(range(6), repeat=4)]
    )
    for t in (W[:, 0].sum(), 1.5, -0.3):
        tail = law.tail(torch.tensor(W), float(t))
        assert tail.method == "exact"
        assert tail.p == pytest.approx(np.mean(sums >= t - 1e-12))


def test_direction_tail_is_the_sphere_marginal():
    d = Directions(30)
    rng = np.random.default_rng(8)
    u = rng.normal(size=(200_000, 30))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    W = torch.tensor(rng.normal(size=30))
    proj = u @ W.numpy()
    t = float(np.quantile(proj, 0.995))
    assert d.tail(W, t).p == pytest.approx(0.005, rel=0.1)
    assert d.variance(W) == pytest.approx(proj.var(), rel=0.02)


def test_log10_p_stays_finite_far_below_1e_300():
    rng = np.random.default_rng(9)
    W = _centred(rng.normal(size=(200, 128)))
    law = RowSubsets(32, 128)
    sd = math.sqrt(law.variance(torch.tensor(W)))
    tail = law.tail(torch.tensor(W), 60 * sd)
    assert tail.p == 0.0 and -2000 < tail.log10_p < -300
    assert Directions(1000).tail(torch.ones(1000), 999.0).log10_p < -300


def test_random_values_and_descriptions():
    rng = np.random.default_rng(10)
    W = torch.tensor(_centred(rng.normal(size=(30, 64))))
    for law in (RowSubsets(16, 64), RowSubsets(1, 64), Directions(30 * 64)):
        vals = law.random_values([W, 2 * W], 400, seed=1)
        assert vals.shape == (2, 400)
        assert vals[1] == pytest.approx(2 * vals[0])  # the same keys read every client
        assert vals[0].var() == pytest.approx(law.variance(W), rel=0.25)
        assert law_from_dict(law.describe()).describe() == law.describe()


def test_edges_of_the_support_are_valid_and_do_not_crash():
    # The owner's value at the very top (every row's largest column), a hair above by rounding.
    rng = np.random.default_rng(12)
    W = _centred(rng.normal(size=(4, 8)))
    W[:, 0] = W.max(axis=1) + 1.0
    W = _centred(W)
    top = float(W[:, 0].sum())
    tail = RowSubsets(1, 8).tail(torch.tensor(W), top * (1 + 1e-7))
    assert tail.method == "exact" and tail.p == pytest.approx(8.0**-4)
    # Too many combinations to enumerate: at the top the saddlepoint may not claim less than
    # the top's own probability.
    W8 = _centred(rng.normal(size=(8, 8)))
    W8[:, 0] = W8.max(axis=1) + 1.0
    W8 = _centred(W8)
    wide = RowSubsets(1, 8).tail(torch.tensor(W8), float(W8[:, 0].sum()))
    assert wide.log10_p >= -8 * math.log10(8) - 1e-9
    # One dominant cell per row (few effective cells): the verdict's tail is not below the
    # fixed-size lists' exact probability gamma^rows of the owner's own value.
    rows, V, m = 12, 64, 32
    Wd = np.zeros((rows, V))
    Wd[:, 0] = 1.0
    Wd = _centred(Wd)
    own = float(sum(Wd[r, 0] + (m - 1) * Wd[r, 1] for r in range(rows)))
    tail = RowSubsets(m, V).tail(torch.tensor(Wd), own)
    assert tail.p >= 0.5**rows
    # No change at all: p = 1.
    assert RowSubsets(4, 16).tail(torch.zeros(3, 16), 0.0).p == 1.0


def test_small_cells_by_their_cumulant_series_give_the_direct_cgf_and_tail():
    from fedattr.watermarks.tail.cgf import BernoulliCells
    from fedattr.watermarks.tail.methods import chernoff_log10_sf, saddlepoint_log10_sf

    rng = np.random.default_rng(3)
    w = rng.standard_normal(50_000) * rng.random(50_000) ** 4 * 0.01
    w[:40] = rng.standard_normal(40) * 0.3  # a few large cells, read directly
    w -= w.mean()
    for gamma in (0.1, 0.25, 0.5):
        cgf = BernoulliCells(w, gamma)
        assert cgf.n_small > 3 * cgf.large.size > 0
        for s in (-40.0, -2.0, 0.3, 5.0, 30.0, 49.9, 60.0):  # 60: beyond the series' range
            series, direct = np.array(cgf(s)), np.array(cgf._cells(cgf.w, s))
            assert series == pytest.approx(direct, rel=1e-10, abs=1e-9)

    class Direct(BernoulliCells):
        def __call__(self, s):
            return self._cells(self.w, s)

    u = w / np.sqrt(0.25 * 0.75 * np.sum(w * w))  # unit null variance
    for t in (2.0, 5.0, 9.0):
        for tail in (saddlepoint_log10_sf, chernoff_log10_sf):
            a, b = tail(BernoulliCells(u, 0.25), t), tail(Direct(u, 0.25), t)
            assert a == pytest.approx(b, rel=1e-9)


def test_tails_of_several_owners_equal_one_tail_each():
    """Owners reading one client's change share its CGF: the same p as one at a time, for
    every method (saddlepoint, Chernoff, exact enumeration, the sphere)."""
    rng = np.random.default_rng(8)
    many = torch.tensor(_centred(rng.normal(size=(30, 64))))
    few = torch.zeros(3, 32, dtype=torch.float64)
    few[:, 0] = 3.0
    few = torch.tensor(_centred(few.numpy() + 0.01 * rng.normal(size=(3, 32))))
    cases = [(RowSubsets(16, 64), many), (RowSubsets(8, 32), few), (RowSubsets(1, 4), many[:3, :4])]
    cases.append((Directions(many.numel()), many.reshape(1, -1)))
    for law, W in cases:
        sd = math.sqrt(law.variance(W))
        values = [0.5 * sd, 2.0 * sd, 4.0 * sd]
        got = law.tails(W, values)
        assert [t.method for t in got] == [law.tail(W, v).method for v in values]
        assert [t.log10_p for t in got] == pytest.approx([law.tail(W, v).log10_p for v in values])


def test_tilted_monte_carlo_draws_keys_with_torch_as_with_numpy():
    """The torch path (``device``, used with cuda on vocabulary-sized changes; here on the
    CPU) estimates the same tail as the numpy path and the saddlepoint."""
    rng = np.random.default_rng(9)
    W = _centred(rng.standard_t(3, size=(40, 256)))
    sd = math.sqrt(0.25 * 0.75 * (W**2).sum())
    cgf = BernoulliCells(W.reshape(-1), 0.25)
    sp = 10 ** saddlepoint_log10_sf(cgf, 5.0 * sd)
    mc_np, rel_np = tilted_monte_carlo(W, 0.25, 5.0 * sd, 3000, seed=3)
    mc_t, rel_t = tilted_monte_carlo(W, 0.25, 5.0 * sd, 3000, seed=3, cgf=cgf, device="cpu")
    assert rel_np < 0.1 and rel_t < 0.1
    assert mc_t == pytest.approx(sp, rel=0.25) and mc_t == pytest.approx(mc_np, rel=0.25)
    assert mc_t != mc_np  # two generators: not the numpy path under another name


def test_tail_check_command_reads_saved_changes_and_checks_every_level(tmp_path, capsys):
    """``fedattr experiment tail-check`` on a run folder's ``changes.safetensors``: one row per
    (client, level), Monte Carlo near the saddlepoint on spread changes, the Chernoff bound
    above it; the torch path (``--device``) is refused in one line where there is no GPU."""
    import json

    from safetensors.torch import save_file

    from fedattr.cli import main

    rng = np.random.default_rng(11)
    run = tmp_path / "run"
    run.mkdir()
    changes = {f"{c}/probes": torch.tensor(rng.standard_t(4, size=(24, 64))) for c in range(3)}
    save_file(changes, str(run / "changes.safetensors"))
    laws = {"probes": RowSubsets(16, 64).describe()}
    (run / "results.json").write_text(json.dumps({"key_laws": laws}))
    out = tmp_path / "tc"
    assert main(["experiment", "tail-check", str(run), "--draws", "2000", "--out", str(out)]) == 0
    rows = json.loads((out / "tail-check.json").read_text())
    assert sorted({(r["client"], r["level"]) for r in rows}) == [
        (c, lv) for c in range(3) for lv in (1e-6, 1e-5, 1e-4, 1e-3)
    ]
    for r in rows:
        assert r["effective_cells"] > 30 and 0.6 < r["ratio"] < 1.6
        assert r["chernoff"] >= r["bound"] >= r["monte_carlo"]
    captured = capsys.readouterr()
    assert "Chernoff bound at or above Monte Carlo: 12 of 12" in captured.out
    assert "the verdict's bound (the smaller of Chernoff's and the patterns' bound): 12 of 12" in (
        captured.out
    )
    # One progress line per change, on standard error (a vocabulary-sized one takes minutes).
    assert captured.err.count("tail-check: run client") == 3 and "3/3 after" in captured.err
    # --pair: only the named change; one that is not saved is one line, before any work.
    args = ["experiment", "tail-check", str(run), "--draws", "2000", "--out", str(out)]
    assert main([*args, "--pair", "1:probes"]) == 0
    assert {r["client"] for r in json.loads((out / "tail-check.json").read_text())} == {1}
    assert "1/1 after" in capsys.readouterr().err
    bad_pairs = (("7:probes", "7:probes is not a saved change"), ("x:probes", "got 'x:probes'"))
    for bad, said in bad_pairs:
        assert main([*args, "--pair", bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("fedattr: error: --pair: ") and said in err and err.count("\n") == 1
    if not torch.cuda.is_available():
        code = main(["experiment", "tail-check", str(run), "--device", "cuda", "--out", str(out)])
        assert code == 2
        assert "--device=cuda: torch sees no CUDA device here" in capsys.readouterr().err


def test_exact_large_cells_bound_the_fixed_size_tail_far_tighter_than_draws_with_replacement():
    """Few dominant cells per row (a real change on few effective cells): the bound that reads
    each row's largest cells exactly stays above the fixed-size tail (100,000 random
    m-subsets per row) at every t, and far below the bound that draws the whole row with
    replacement; with no large cell it is that bound."""
    rng = np.random.default_rng(12)
    rows, V, m = 6, 64, 16
    W = 0.05 * rng.normal(size=(rows, V))
    W[:, 0] += 4.0  # one dominant cell a row, as in a change on ~6 effective cells
    W[:, 1] += rng.normal(size=rows)
    W = _centred(W)
    assert effective_cells(W) < 30
    n = 100_000
    idx = torch.rand(n, rows, V, generator=torch.Generator().manual_seed(3)).argsort(-1)
    mask = torch.zeros(n, rows, V, dtype=torch.float64).scatter_(2, idx[..., :m], 1.0)
    T = (mask * torch.tensor(W)).sum((1, 2)).numpy()
    tight, loose = RowSubsetsBound(W, m), RowDraws(W, m)
    for t in [*np.quantile(T, [0.9, 0.99, 0.999]).tolist(), float(T.max())]:
        p_mc = np.mean(t <= T)
        bound = 10 ** chernoff_log10_sf(tight, t)
        assert bound >= p_mc
        assert bound <= 10 ** chernoff_log10_sf(loose, t)
    # Far in the tail the old bound is orders of magnitude looser (at 0.7 and 0.8 of the
    # largest reachable sum: Monte Carlo ~1e-4 and ~5e-6; the new bound 7.6e-4 and 1.3e-5, the
    # old one 2.4e-2 and 9.7e-3).
    top = float(np.sort(W, axis=1)[:, -m:].sum())
    for f in (0.7, 0.8):
        new, old = chernoff_log10_sf(tight, f * top), chernoff_log10_sf(loose, f * top)
        assert 10**new >= np.mean(f * top <= T) and old - new > 1.4
    t = 0.8 * top
    assert RowSubsetsBound(W, m, k=0)(0.7) == pytest.approx(loose(0.7))
    law = RowSubsets(m, V)
    tail = law.tail(torch.tensor(W), t)
    assert tail.method == "patterns" and tail.log10_p < chernoff_log10_sf(tight, t)
    assert tail.p >= np.mean(t <= T)


def _exact_fixed_size_tail(W: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Every value of ``sum_x <W_x, G_x>`` over all keys (rows uniform m-subsets), sorted, with
    its probability: by enumerating every subset of every row (small W only)."""
    values, probs = np.zeros(1), np.ones(1)
    for row in W:
        subsets = list(itertools.combinations(range(len(row)), m))
        sums = np.array([row[list(c)].sum() for c in subsets])
        values = (values[:, None] + sums[None, :]).reshape(-1)
        probs = (probs[:, None] * np.full(len(sums), 1 / len(sums))[None, :]).reshape(-1)
    order = np.argsort(values)
    return values[order], probs[order]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("rows", "V", "m"), [(2, 12, 3), (4, 6, 1)])
def test_patterns_bound_never_falls_below_the_exact_fixed_size_tail(seed, rows, V, m):
    """Every key enumerated (two rows of 220 subsets; four rows of one pick in six): at every
    value the key can reach, the patterns' bound is at or above the exact tail, and the
    verdict's bound never above Chernoff's."""
    rng = np.random.default_rng(seed)
    W = 0.3 * rng.normal(size=(rows, V))
    W[:, 0] += 2.0 * rng.random(rows)  # a dominant cell a row
    W = _centred(W)
    values, probs = _exact_fixed_size_tail(W, m)
    sf = np.cumsum(probs[::-1])[::-1]
    bound = RowPatternsBound(W, m)
    for i in np.linspace(len(values) // 2, len(values) - 1, 40).astype(int):
        t = float(values[i])
        exact = float(sf[np.searchsorted(values, t - 1e-12)])
        assert 10 ** bound.patterns_log10_sf(t) >= exact * (1 - 1e-9)
        assert bound.tail(t).log10_p <= chernoff_log10_sf(bound.chernoff, t)


def test_patterns_bound_is_near_the_exact_tail_where_few_rows_carry_the_change():
    """Six rows, each with three dominant cells and the rest of the row flat (so nothing is
    left over for Chernoff's bound): the patterns' bound is the exact tail up to its grid,
    where Chernoff's bound is several times above it."""
    rng = np.random.default_rng(3)
    rows, V, m = 6, 256, 64
    W = np.zeros((rows, V))
    W[:, :3] = rng.normal(size=(rows, 3))
    W = _centred(W)
    # Exact: each row's law over which of its three cells are green (hypergeometric), the rest
    # of the row adding its flat value once per other green cell.
    flat = W[:, 3]
    law_values, law_probs = np.zeros(1), np.ones(1)
    for x in range(rows):
        vals, ps = [], []
        for pattern in itertools.product((0, 1), repeat=3):
            j = sum(pattern)
            vals.append(float(np.dot(pattern, W[x, :3])) + (m - j) * flat[x])
            ps.append(math.comb(V - 3, m - j) / math.comb(V, m))
        law_values = (law_values[:, None] + np.array(vals)[None, :]).reshape(-1)
        law_probs = (law_probs[:, None] * np.array(ps)[None, :]).reshape(-1)
    assert law_probs.sum() == pytest.approx(1.0)
    bound = RowPatternsBound(W, m)
    sd = bound.sd
    for z in (2.0, 2.5, 3.0):
        exact = float(law_probs[law_values >= z * sd].sum())
        assert exact > 1e-5
        got = 10 ** bound.patterns_log10_sf(z * sd)
        assert exact <= got <= 1.1 * exact + 1e-9
        assert 10 ** chernoff_log10_sf(bound.chernoff, z * sd) > 3 * got


def _key(rng: np.random.Generator, rows: int, V: int, m: int) -> np.ndarray:
    """A KGW-like key: every row a uniform ``m``-subset of the ``V`` columns."""
    G = np.zeros((rows, V), dtype=bool)
    for x in range(rows):
        G[x, rng.choice(V, m, replace=False)] = True
    return G


def test_shifted_keys_read_the_owner_key_shifted_row_by_row():
    """The test's keys are the owner's rows shifted cyclically: with every other row empty, the
    reachable values are exactly ``<W_x, roll(G_x, s)>`` over the shifts ``s``, each drawn with
    probability ``1 / V``, so a value reached by ``j`` of the ``V`` shifts gets p near ``j / V``."""
    rng = np.random.default_rng(0)
    V, m = 16, 4
    W = np.zeros((3, V))
    W[1] = _centred(rng.normal(size=(1, V)))[0]
    G = _key(rng, 3, V, m)
    shifted = np.array([W[1] @ np.roll(G[1], s) for s in range(V)])
    assert shifted[0] == pytest.approx(float((W * G).sum()))
    reached = int((shifted >= shifted[0] - 1e-9).sum())
    p, drawn = shifted_keys_p(W, G, seed=1, max_keys=200_000, hits=2_000)
    assert drawn < 200_000  # stopped on its hits (Besag and Clifford)
    assert p == pytest.approx(reached / V, rel=0.1)


@pytest.mark.parametrize("dominant", [0.0, 3.0])
def test_shifted_keys_hold_their_level_over_every_key_of_a_small_bed(dominant):
    """Every key of a bed small enough to enumerate (two rows, six columns, two green: 225
    keys), each read with ten seeds: the share of p-values at or below u stays at u or below
    (binomial noise allowed), with and without a dominant cell per row, where independent cells
    misread the fixed-size lists' atom. The change is fixed and drawn without the key: the null."""
    rng = np.random.default_rng(4)
    V, m = 6, 2
    W = 0.3 * rng.normal(size=(2, V))
    W[:, 0] += dominant
    W = _centred(W)
    subsets = list(itertools.combinations(range(V), m))
    ps = []
    for a, b in itertools.product(subsets, subsets):
        G = np.zeros((2, V), dtype=bool)
        G[0, list(a)], G[1, list(b)] = True, True
        ps += [shifted_keys_p(W, G, seed=[s, *a, *b], max_keys=99, hits=100)[0] for s in range(10)]
    ps = np.array(ps)
    for u in (0.05, 0.1, 0.2, 0.5):
        share = float((ps <= u).mean())
        assert share <= u + 3 * math.sqrt(u * (1 - u) / len(ps)), (u, share)
    assert float((ps <= 0.2).mean()) > 0.05  # not a test that never rejects


def test_shifted_keys_find_a_key_aligned_change_and_stop_early_on_an_unrelated_one():
    rng = np.random.default_rng(5)
    rows, V, m = 20, 64, 16
    G = _key(rng, rows, V, m)
    noise = rng.normal(size=(rows, V))
    aligned = _centred(G - m / V + 0.5 * noise)
    p, drawn = shifted_keys_p(aligned, G, seed=0, max_keys=10_000)
    assert p == pytest.approx(1 / 10_001) and drawn == 10_000
    p, drawn = shifted_keys_p(_centred(noise), G, seed=0, max_keys=10_000, hits=20)
    assert p > 0.01 and drawn < 10_000
    assert shifted_keys_p(np.zeros((rows, V)), G, seed=0) == (1.0, 0)
