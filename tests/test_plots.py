"""The attribution plot: label spreading, lines broken at unscored rounds, the PNG itself."""

import itertools
import math

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.text import Annotation, Text

from fedattr.attribution.stouffer import build_report
from fedattr.reporting.plots import (
    build_attribution_figure,
    plot_attribution,
    round_series,
    spread_labels,
)

# --- spread_labels ------------------------------------------------------------------------


def _gaps_ok(values, out, gap):
    order = sorted(range(len(values)), key=lambda i: (values[i], i))
    ys = [out[i] for i in order]
    return all(b - a >= gap - 1e-9 for a, b in itertools.pairwise(ys))


def test_spread_keeps_order_and_gap():
    values = [1.0, 1.05, 0.98, 1.02, 3.0, 1.01]
    out = spread_labels(values, 0.2)
    assert len(out) == len(values)
    assert _gaps_ok(values, out, 0.2)
    # Same order as the input values (ties keep input order).
    assert sorted(range(6), key=lambda i: (values[i], i)) == sorted(range(6), key=out.__getitem__)
    assert out[4] == 3.0  # far from the cluster: untouched


def test_spread_is_minimal_for_a_symmetric_cluster():
    # Two labels on the same spot move apart symmetrically around it.
    assert spread_labels([5.0, 5.0], 1.0) == pytest.approx([4.5, 5.5])
    # Three: centred on their mean.
    assert spread_labels([0.0, 0.1, 0.2], 1.0) == pytest.approx([-0.9, 0.1, 1.1])


def test_spread_leaves_spread_values_unchanged():
    values = [0.3, -2.0, 1.7, 5.0, 0.9 + 1e-12]
    assert spread_labels(values, 0.6) == values
    assert spread_labels([], 1.0) == []
    assert spread_labels([2.5], 10.0) == [2.5]


def test_spread_ties_keep_input_order():
    out = spread_labels([1.0, 1.0, 1.0], 0.5)
    assert out[0] < out[1] < out[2]


def test_spread_respects_bounds():
    out = spread_labels([9.9, 9.95, 10.0], 1.0, lo=0.0, hi=10.0)
    assert max(out) <= 10.0 + 1e-12
    assert _gaps_ok([9.9, 9.95, 10.0], out, 1.0)
    assert out == pytest.approx([8.0, 9.0, 10.0])
    # Too many to fit the gap: the gap shrinks to fill the range, order kept.
    crowded = spread_labels([0.5] * 5, 1.0, lo=0.0, hi=2.0)
    assert crowded == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0])


def test_spread_random_cases():
    rng = np.random.default_rng(0)
    for _ in range(200):
        values = rng.normal(size=rng.integers(1, 12)).round(1).tolist()
        gap = float(rng.uniform(0.05, 0.5))
        out = spread_labels(values, gap)
        assert _gaps_ok(values, out, gap)
        order_in = sorted(range(len(values)), key=lambda i: (values[i], i))
        assert [out[i] for i in order_in] == sorted(out)
        # The mean position never moves (least squares, unbounded).
        assert np.mean(out) == pytest.approx(np.mean(values))


def test_spread_rejects_bad_input():
    with pytest.raises(ValueError):
        spread_labels([1.0], -1.0)
    with pytest.raises(ValueError):
        spread_labels([math.nan], 1.0)
    with pytest.raises(ValueError):
        spread_labels([1.0], 1.0, lo=2.0, hi=1.0)


# --- round_series ---------------------------------------------------------------------------


def _same(a, b):
    return len(a) == len(b) and all(
        (math.isnan(x) and math.isnan(y)) or x == pytest.approx(y)
        for x, y in zip(a, b, strict=True)
    )


def test_series_without_gaps():
    x, z, cum = round_series([1, 2, 3], {1: 1.0, 2: 2.0, 3: -3.0})
    assert x == [1, 2, 3]
    assert z == [1.0, 2.0, -3.0]
    assert cum == pytest.approx([1.0, 3 / math.sqrt(2), 0.0])


def test_series_breaks_at_gaps():
    # Scored in rounds 1, 3, 4 of 1..5: one break (at round 2); 5 is after its last: no break.
    x, z, cum = round_series([1, 2, 3, 4, 5], {4: 4.0, 1: 1.0, 3: 2.0})
    assert _same(x, [1, 2, 3, 4])
    assert _same(z, [1.0, math.nan, 2.0, 4.0])
    # Cumulative Z over scored rounds only: after the k-th scored round, sum / sqrt(k).
    assert _same(cum, [1.0, math.nan, 3 / math.sqrt(2), 7 / math.sqrt(3)])


def test_series_one_break_per_run_of_missing_rounds():
    x, z, _ = round_series([0, 2, 4, 6, 8], {0: 1.0, 6: 2.0, 8: 3.0})
    assert _same(x, [0, 2, 6, 8])  # rounds 2 and 4 missing: one NaN point
    assert _same(z, [1.0, math.nan, 2.0, 3.0])
    # Non-consecutive round numbers are no gap when no round of the report lies between.
    x, z, _ = round_series([0, 2, 4], {0: 1.0, 2: 2.0, 4: 3.0})
    assert not any(math.isnan(v) for v in z)


# --- the figure -------------------------------------------------------------------------------


def _report():
    rng = np.random.default_rng(3)
    scores = {
        cid: {t: float(rng.normal(3.0 if cid < 3 else 0.0)) for t in range(1, 6)}
        for cid in range(10)
    }
    for cid, target in zip((3, 4, 5, 6), (0.50, 0.55, 0.58, 0.62), strict=True):
        scores[cid][5] = target  # several clients ending within 0.1 of each other
    scores[7] = {t: scores[7][t] for t in (1, 3, 4)}  # hardened mode: not scored in round 2
    return build_report(scores, gamma=2.0, truth={c: c < 3 for c in range(10)})


def _client_lines(ax):
    return {ln.get_label(): ln for ln in ax.get_lines() if ln.get_label().startswith("client ")}


def test_figure_breaks_lines_at_gaps():
    fig = build_attribution_figure(_report())
    try:
        ax_z, ax_s = fig.axes[:2]
        for ax in (ax_z, ax_s):
            lines = _client_lines(ax)
            assert len(lines) == 10
            y7 = np.asarray(lines["client 7"].get_ydata(), dtype=float)
            assert np.isnan(y7).sum() == 1 and np.isnan(y7[1])
            assert list(lines["client 7"].get_xdata()[[0, 2, 3]]) == [1, 3, 4]
            assert lines["client 7"].get_marker() == "o"  # markers of the scored rounds stay
            y0 = np.asarray(lines["client 0"].get_ydata(), dtype=float)
            assert not np.isnan(y0).any()
        z7 = _report().clients[7].z
        y7s = np.asarray(_client_lines(ax_s)["client 7"].get_ydata(), dtype=float)
        assert y7s[-1] == pytest.approx(sum(z7.values()) / math.sqrt(3))
    finally:
        plt.close(fig)


def _annotations(ax):
    return [a for a in ax.texts if isinstance(a, Annotation)]


def _label_boxes(ax):
    renderer = ax.figure.canvas.get_renderer()
    # Text's own extent: an Annotation's would include its leader line.
    return {a.get_text(): Text.get_window_extent(a, renderer) for a in _annotations(ax)}


def test_both_panels_labelled_without_overlap_inside_the_figure():
    fig = build_attribution_figure(_report())
    try:
        fig.canvas.draw()
        fig_box = fig.bbox
        for ax in fig.axes[:2]:
            boxes = _label_boxes(ax)
            assert sorted(boxes, key=int) == [str(i) for i in range(10)]
            ax_box = ax.get_window_extent()
            items = sorted(boxes.values(), key=lambda b: b.y0)
            for a, b in itertools.pairwise(items):
                assert a.y1 <= b.y0 + 0.5, "labels overlap"
            for b in items:
                assert fig_box.x0 <= b.x0 and b.x1 <= fig_box.x1
                assert ax_box.x0 <= b.x0 and b.x1 <= ax_box.x1 + 0.5
                assert ax_box.y0 - 0.5 <= b.y0 and b.y1 <= ax_box.y1 + 0.5
            # Each label has a leader line to its line's last point.
            assert all(a.arrow_patch is not None for a in _annotations(ax))
        # Flagged clients keep their star; the γ line is in the legend.
        ax_s = fig.axes[1]
        assert sum(ln.get_marker() == "*" for ln in ax_s.get_lines()) == 3
        legend = [t.get_text() for t in ax_s.get_legend().get_texts()]
        assert legend == ["watermarked", "clean", "γ = 2"]
    finally:
        plt.close(fig)


def test_colours_by_truth():
    fig = build_attribution_figure(_report())
    try:
        lines = _client_lines(fig.axes[1])
        assert lines["client 0"].get_color() == "tab:red"
        assert lines["client 5"].get_color() == "tab:blue"
    finally:
        plt.close(fig)


def test_png_is_written(tmp_path):
    out = plot_attribution(_report(), tmp_path / "attribution.png")
    assert out == tmp_path / "attribution.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 10_000
    assert not plt.get_fignums()  # the figure was closed


def test_png_for_edge_cases(tmp_path):
    # No truth (grey, "unknown" in the legend), one round, a client never scored, an empty
    # report, and long ids.
    unknown = build_report({1: {1: 0.5}, 2: {1: 0.52}, 3: {}}, gamma=3.0)
    plot_attribution(unknown, tmp_path / "unknown.png")
    fig = build_attribution_figure(unknown)
    try:
        legend = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
        assert "unknown" in legend
    finally:
        plt.close(fig)
    plot_attribution(build_report({}, gamma=3.0), tmp_path / "empty.png")
    long_ids = build_report({10_000 + i: {1: 0.1 * i, 2: 0.01 * i} for i in range(30)}, 2.0)
    plot_attribution(long_ids, tmp_path / "long.png")
    for name in ("unknown", "empty", "long"):
        assert (tmp_path / f"{name}.png").stat().st_size > 0


def test_the_calibrated_plot_draws_the_verdict_that_results_json_states(tmp_path):
    """A named client's bar stands above the drawn cut, an unnamed one's below it: the plot
    shows the statistic that decides (read back from results.json, as a user would)."""
    import json

    import matplotlib.pyplot as plt

    from fedattr.attribution.stouffer import AttributionReport, ClientAttribution
    from fedattr.config import load
    from fedattr.pipeline.config import DemoConfig
    from fedattr.pipeline.run import run_demo
    from fedattr.reporting.plots import build_attribution_figure

    cfg = load(
        DemoConfig,
        None,
        [
            "synthetic.dim=256",
            "secagg.backend=plaintext",
            "synthetic.signal=1.2",
            "synthetic.seed=3",
        ],
    )
    folder = run_demo(cfg, progress=lambda _m: None).write(tmp_path / "run")
    results = json.loads(folder.file("results.json").read_text())
    assert results["statistic"] == "calibrated"
    clients = [
        ClientAttribution(
            id=c["id"],
            z={int(t): v for t, v in c["z"].items()},
            Z=c["Z"],
            p=c["p"],
            log10_p=c["log10_p"],
            flagged=c["flagged"],
            watermarked=c["watermarked"],
            statistic=c["statistic"],
            p_rank=c.get("p_rank"),
            tail=c.get("tail"),
            calibrated=c.get("calibrated", True),
        )
        for c in results["clients"]
    ]
    report = AttributionReport(
        results["gamma"], clients, statistic="calibrated", alpha=results["alpha"]
    )
    fig = build_attribution_figure(report)
    try:
        ax = fig.axes[1]
        cut = next(line.get_ydata()[0] for line in ax.get_lines() if line.get_linestyle() == "--")
        heights = [bar.get_height() for bar in ax.patches]
        assert len(heights) == len(clients)
        for c, h in zip(clients, heights, strict=True):
            assert (h > cut) == c.flagged
        assert any(c.flagged for c in clients) and not all(c.flagged for c in clients)
    finally:
        plt.close(fig)


def _calibrated_report(K):
    """A calibrated report of ``K`` clients: every fifth watermarked, client 0's p far below
    the drawn top (its bar at 50), the others named or not by the alpha / K cut."""
    from fedattr.attribution.stouffer import AttributionReport, ClientAttribution

    rng = np.random.default_rng(K)
    clients = []
    for cid in range(K):
        marked = cid % 5 == 0
        log10_p = -60.0 if cid == 0 else -float(rng.uniform(4, 12) if marked else rng.uniform(0, 1))
        z = {t: float(rng.normal(2.5 if marked else 0.0)) for t in range(1, 6)}
        flagged = log10_p < math.log10(0.01 / K)
        clients.append(
            ClientAttribution(
                id=cid,
                z=z,
                Z=0.0,
                p=10**log10_p,
                log10_p=log10_p,
                flagged=flagged,
                watermarked=marked,
                statistic="calibrated",
            )
        )
    return AttributionReport(1.0, clients, statistic="calibrated", alpha=0.01)


@pytest.mark.parametrize("K", [10, 100])
def test_the_verdict_legend_covers_no_bar_and_the_stars_stand_out(K):
    """Issue 37: the legend sat inside the axes over the tallest bars and client 0's star,
    and the stars read pale. Now the legend is under the axes, each named client has a
    black, white-edged star above its bar, and the written client ids do not overlap."""
    fig = build_attribution_figure(_calibrated_report(K))
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        ax = fig.axes[1]
        legend = ax.get_legend().get_window_extent(renderer)
        assert not legend.overlaps(ax.get_window_extent(renderer)), "legend inside the axes"
        stars = [ln for ln in ax.get_lines() if ln.get_marker() == "*"]
        named = [c for c in _calibrated_report(K).clients if c.flagged]
        assert len(stars) == len(named) and any(c.id == 0 for c in named)
        for star in stars:
            box = star.get_window_extent(renderer)
            assert not box.overlaps(legend)
            assert matplotlib.colors.to_hex(star.get_markerfacecolor()) == "#000000"
            assert matplotlib.colors.to_hex(star.get_markeredgecolor()) == "#ffffff"
            assert star.get_zorder() > max(p.get_zorder() for p in ax.patches)
        for bar in ax.patches:
            assert not bar.get_window_extent(renderer).overlaps(legend)
        # client 0's star (at the drawn top, 50) is inside the figure, not clipped away
        top = max(stars, key=lambda s: s.get_ydata()[0]).get_window_extent(renderer)
        assert top.y1 <= fig.bbox.y1
        ticks = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
        assert len(ticks) <= 25
        for a, b in itertools.pairwise(sorted(ticks, key=lambda b: b.x0)):
            assert a.x1 <= b.x0, "client ids overlap"
    finally:
        plt.close(fig)


def test_a_hundred_lines_keep_readable_labels_and_the_named_ones():
    """At K = 100 the label column cannot hold 100 labels apart: the named clients' labels are
    kept, the others fill what room is left, and none overlap."""
    fig = build_attribution_figure(_calibrated_report(100))
    try:
        fig.canvas.draw()
        ax_z = fig.axes[0]
        boxes = _label_boxes(ax_z)
        named = {str(c.id) for c in _calibrated_report(100).clients if c.flagged}
        assert named <= set(boxes) and len(boxes) < 100
        items = sorted(boxes.values(), key=lambda b: b.y0)
        for a, b in itertools.pairwise(items):
            assert a.y1 <= b.y0 + 0.5, "labels overlap"
    finally:
        plt.close(fig)


def test_a_calibrated_report_without_clients_is_drawn(tmp_path):
    """A run with ``attribution.scoring = "owner"`` writes its plot before any owner scored."""
    from fedattr.attribution.stouffer import AttributionReport

    empty = AttributionReport(1.0, [], statistic="calibrated", alpha=0.01)
    assert plot_attribution(empty, tmp_path / "empty.png").stat().st_size > 0
