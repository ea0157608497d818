"""The family-wise summary and the Bonferroni combination over owners, against computations
made here from first principles (no scipy, no fedattr helper)."""

import math

import pytest

from fedattr.attribution.stouffer import build_report, combine_reports
from fedattr.experiments.calibration import (
    clopper_pearson,
    level_point,
    summarize,
    wrong_pairs,
)


def _binom_cdf(k: int, n: int, p: float) -> float:
    return sum(math.comb(n, j) * p**j * (1 - p) ** (n - j) for j in range(k + 1))


def _bisect(f, lo: float = 0.0, hi: float = 1.0) -> float:
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) > 0 else (lo, mid)
    return (lo + hi) / 2


@pytest.mark.parametrize(("k", "n"), [(0, 100), (2, 100), (7, 40), (40, 40), (1, 6)])
def test_clopper_pearson_inverts_the_binomial_tails(k, n):
    lo, hi = clopper_pearson(k, n)
    # Upper end: the p at which P(X <= k) = 0.025; lower end: P(X >= k) = 0.025.
    want_hi = 1.0 if k == n else _bisect(lambda p: _binom_cdf(k, n, p) - 0.025)
    want_lo = 0.0 if k == 0 else _bisect(lambda p: 0.025 - (1 - _binom_cdf(k - 1, n, p)))
    assert hi == pytest.approx(want_hi, abs=1e-9) and lo == pytest.approx(want_lo, abs=1e-9)
    if k == 0:
        assert hi == pytest.approx(1 - 0.025 ** (1 / n))


@pytest.mark.parametrize(("runs", "want"), [(100, 3), (40, 2), (6, 1), (1000, 15)])
def test_the_level_point_is_the_binomial_95_percent_point(runs, want):
    # The smallest k with P(X <= k) >= 0.95 at 1%.
    k = next(k for k in range(runs + 1) if _binom_cdf(k, runs, 0.01) >= 0.95)
    assert level_point(runs) == k == want


def _run(flags: dict[tuple[int, str], bool], owner_of: dict[int, str], K: int = 4) -> dict:
    """A run's results.json as the summary reads it: two owners, per-owner rows."""
    owners = sorted({o for _, o in flags} | set(owner_of.values()))
    by = {
        o: {str(c): {"flagged": flags.get((c, o), False), "p": 0.5, "Z": 0.0} for c in range(K)}
        for o in owners
    }
    clients = [
        {
            "id": c,
            "watermarked": c in owner_of,
            "flagged": any(flags.get((c, o), False) for o in owners),
            "p": 0.5,
            "Z": 0.0,
            "statistic": owners[0],
        }
        for c in range(K)
    ]
    return {
        "alpha": 0.01,
        "clients": clients,
        "by_statistic": by,
        "federation": {"watermarked": {str(c): o for c, o in owner_of.items()}},
    }


def test_a_watermarked_client_named_for_another_owner_is_a_wrong_pair_not_a_hit():
    owner_of = {0: "A", 1: "B"}
    runs = [
        _run({(0, "A"): True, (1, "B"): True}, owner_of),  # right
        _run({(0, "B"): True, (1, "B"): True}, owner_of),  # 0 named for B: wrong
        _run({(2, "A"): True, (2, "B"): True, (3, "A"): True}, owner_of),  # clean: wrong
        _run({}, owner_of),
    ]
    assert wrong_pairs(runs[1], runs[1]) == [(0, "B")]
    assert sorted(wrong_pairs(runs[2], runs[2])) == [(2, "A"), (2, "B"), (3, "A")]
    stats = summarize(runs)["statistics"]["calibrated"]
    assert stats["runs_naming_wrong"] == 2  # a run counts once, however many pairs
    assert stats["runs_naming_clean"] == 1
    # Hits: a watermarked client named for its own owner (3 of 8 client-runs).
    assert stats["tpr"] == pytest.approx(3 / 8)
    # Null pairs: every (client, owner) but the watermarked clients' own: 4 x (8 - 2).
    assert stats["null_pairs"] == 24
    assert stats["runs_naming_wrong_ci95"] == pytest.approx(list(clopper_pearson(2, 4)))
    assert stats["within_level"] is (level_point(4) >= 2)


def test_combining_owners_is_bonferroni_over_them():
    truth = {0: True, 1: False, 2: False}
    # Owner A's and B's per-round scores of three clients (Stouffer over two rounds each).
    a = build_report({0: {1: 3.0, 2: 3.2}, 1: {1: 0.1, 2: -0.4}, 2: {1: 2.9, 2: 2.95}}, 4.0, truth)
    b = build_report({0: {1: 0.0, 2: 0.3}, 1: {1: 3.1, 2: 2.6}, 2: {1: 1.0, 2: -1.0}}, 4.0, truth)
    both = combine_reports([a, b])
    for row, ra, rb in zip(both.clients, a.clients, b.clients, strict=True):
        za, zb = sum(ra.z.values()) / math.sqrt(2), sum(rb.z.values()) / math.sqrt(2)
        best = max(za, zb)
        p_best = 0.5 * math.erfc(best / math.sqrt(2))
        assert pytest.approx(best) == row.Z
        assert row.p == pytest.approx(min(1.0, 2 * p_best))
        assert row.log10_p == pytest.approx(min(0.0, math.log10(2 * p_best)))
        assert row.flagged == (za > 4.0 or zb > 4.0)


def test_a_runs_results_list_its_wrong_pairs():
    from fedattr.attribution.stouffer import AttributionReport, ClientAttribution
    from fedattr.pipeline.run import wrong_pairs as run_wrong_pairs

    def part(flags):
        return AttributionReport(
            gamma=4.0,
            clients=[
                ClientAttribution(id=c, z={}, Z=0.0, p=1.0, log10_p=0.0, flagged=f)
                for c, f in enumerate(flags)
            ],
        )

    report = AttributionReport(
        gamma=4.0, components={"A": part([True, True, False]), "B": part([False, True, True])}
    )
    # Client 0 trained on A's documents, client 1 on B's; client 2 on no one's.
    assert run_wrong_pairs(report, {"0": "A", "1": "B"}) == [[1, "A"], [2, "B"]]
