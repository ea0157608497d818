"""Matplotlib figures of an attribution report (headless: the Agg backend)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..attribution.stouffer import AttributionReport
from .markdown import UPPER_BOUNDS

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

LABEL_FONTSIZE = 8
"""Font size (points) of the client-id labels at the end of each line."""
_LABEL_GAP_PT = 1.25 * LABEL_FONTSIZE
"""Minimum vertical distance (points) between the centres of two labels."""
_LABEL_PAD_PT = 14.0
"""Horizontal distance (points) from the last round to the label column."""
_COLOURS = {True: "tab:red", False: "tab:blue", None: "tab:grey"}


def spread_labels(
    values: Iterable[float],
    min_gap: float,
    lo: float | None = None,
    hi: float | None = None,
) -> list[float]:
    """Label positions near ``values``, at least ``min_gap`` apart, in the same order.

    Moves the positions as little as possible (least squares) subject to keeping their order
    (ties keep their input order) and a distance of at least ``min_gap`` between neighbours;
    positions already that far apart are returned unchanged. With ``lo``/``hi``, every position
    also stays within ``[lo, hi]``; if ``n`` positions cannot fit there ``min_gap`` apart, the gap
    shrinks to ``(hi - lo) / (n - 1)``. The result is in the order of ``values``.

    (Writing ``y_k = u_k + k * min_gap`` for the sorted positions turns the gap constraints into
    ``u`` non-decreasing: an isotonic regression, solved by pool-adjacent-violators, then clipped
    to the bounds, which is optimal for constant bounds.)
    """
    vals = [float(v) for v in values]
    n = len(vals)
    if min_gap < 0 or not math.isfinite(min_gap):
        raise ValueError(f"spread_labels: min_gap must be finite and >= 0, got {min_gap!r}")
    if not all(math.isfinite(v) for v in vals):
        raise ValueError("spread_labels: values must be finite")
    if lo is not None and hi is not None and hi < lo:
        raise ValueError(f"spread_labels: empty range [{lo}, {hi}]")
    if n == 0:
        return []
    gap = min_gap
    if lo is not None and hi is not None and n > 1:
        gap = min(gap, (hi - lo) / (n - 1))
    order = sorted(range(n), key=vals.__getitem__)
    # Pool adjacent violators on u_k = y_k - k * gap; a block is [sum, count, first k].
    blocks: list[list[float]] = []
    for k, i in enumerate(order):
        blocks.append([vals[i] - k * gap, 1, k])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c, _ = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    lo_u = -math.inf if lo is None else lo
    hi_u = math.inf if hi is None else hi - (n - 1) * gap
    out = [0.0] * n
    for s, c, first in blocks:
        mean = s / c
        clipped = min(max(mean, lo_u), hi_u)
        for k in range(int(first), int(first + c)):
            i = order[k]
            # An unmoved position is returned exactly (no round trip through u).
            out[i] = vals[i] if c == 1 and clipped == mean else clipped + k * gap
    return out


def round_series(
    all_rounds: Iterable[int], z: Mapping[int, float]
) -> tuple[list[float], list[float], list[float]]:
    """``(x, z, Z)`` series of one client for plotting, with NaN where its lines must break.

    ``x`` are the rounds the client was scored in, ``z`` its per-round scores and ``Z`` its
    cumulative Stouffer statistic over the rounds it *was* scored in (after its k-th scored
    round: the sum of its first k scores over ``sqrt(k)``), reached at that round. Where a round
    of ``all_rounds`` lies between two consecutive scored rounds (a round it was not scored in,
    e.g. in hardened mode), one point ``(missing round, NaN, NaN)`` is inserted so the lines break
    there instead of joining across it; rounds before its first or after its last scored round
    are not gaps.
    """
    scored = sorted(z)
    known = sorted(set(all_rounds) | set(scored))
    position = {t: k for k, t in enumerate(known)}
    xs: list[float] = []
    zs: list[float] = []
    cum: list[float] = []
    total = 0.0
    for k, t in enumerate(scored):
        if k and position[t] - position[scored[k - 1]] > 1:
            xs.append(float(known[position[scored[k - 1]] + 1]))
            zs.append(math.nan)
            cum.append(math.nan)
        total += z[t]
        xs.append(float(t))
        zs.append(float(z[t]))
        cum.append(total / math.sqrt(k + 1))
    return xs, zs, cum


def _points_per_pixel(fig: Figure) -> float:
    return 72.0 / fig.dpi


def _label_column(
    ax: Axes,
    entries: Sequence[tuple[float, float, str, str]],
    x_min: float,
    x_last: float,
    first: frozenset[str] = frozenset(),
) -> None:
    """Label each line at its last point ``(x, y, text, colour)`` in a column right of ``x_last``.

    Labels are spread vertically ``_LABEL_GAP_PT`` apart (within the y range) and joined to their
    point by a thin leader line; the x range is widened so the column lies inside the axes. The
    figure's layout must already be done (its axes' size is what converts points to data).
    When more labels than fit that far apart are asked for (a hundred clients), the labels
    ``first`` (the named clients) are kept, then those of the lines ending farthest from the
    others; the rest are left out rather than drawn over each other.
    """
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    bbox = ax.get_window_extent(renderer)
    width_pt = bbox.width * _points_per_pixel(fig)
    height_pt = bbox.height * _points_per_pixel(fig)
    texts = [
        ax.text(0, 0, text, fontsize=LABEL_FONTSIZE, color=colour, va="center")
        for _, _, text, colour in entries
    ]
    text_pt = max(
        (t.get_window_extent(renderer).width * _points_per_pixel(fig) for t in texts),
        default=0.0,
    )
    for t in texts:
        t.remove()
    # Data span S with the last round, then pad, label and a margin right of it:
    # S = (x_last - x_min) + extra_pt * S / width_pt.
    extra_pt = min(_LABEL_PAD_PT + text_pt + 6.0, 0.45 * width_pt)
    if x_last <= x_min:  # one round: give its point half a round either side
        x_min = x_last - 0.5
    span = (x_last - x_min) / (1.0 - extra_pt / width_pt)
    ax.set_xlim(x_min, x_min + span)
    x_text = x_last + _LABEL_PAD_PT * span / width_pt
    y0, y1 = ax.get_ylim()
    per_pt = (y1 - y0) / height_pt
    gap = _LABEL_GAP_PT * per_pt
    lo, hi = y0 + gap / 2, y1 - gap / 2
    if hi < lo:  # an axes lower than one label
        lo = hi = (y0 + y1) / 2
    capacity = int((hi - lo) / gap) + 1 if gap > 0 else len(entries)
    if len(entries) > capacity:
        centre = sum(y for _, y, _, _ in entries) / len(entries)
        rank = sorted(
            range(len(entries)),
            key=lambda i: (entries[i][2] not in first, -abs(entries[i][1] - centre)),
        )
        entries = [entries[i] for i in sorted(rank[: max(capacity, 1)])]
    ys = spread_labels([y for _, y, _, _ in entries], gap, lo=lo, hi=hi)
    for (x, y, text, colour), y_text in zip(entries, ys, strict=True):
        ax.annotate(
            text,
            xy=(x, y),
            xytext=(x_text, y_text),
            fontsize=LABEL_FONTSIZE,
            color=colour,
            va="center",
            ha="left",
            zorder=4,
            # Opaque backing: reference lines (z = 0, γ) may run through the label column.
            bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.85},
            arrowprops={
                "arrowstyle": "-",
                "color": colour,
                "lw": 0.6,
                "alpha": 0.6,
                # Dotted when the line ends before the last round, so it does not read as data.
                "linestyle": "-" if x >= x_last else ":",
                "shrinkA": 1.0,
                "shrinkB": 2.0,
                "relpos": (0.0, 0.5),
            },
        )


def build_attribution_figure(report: AttributionReport) -> Figure:
    """The figure :func:`plot_attribution` saves (see there); the caller closes it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, MaxNLocator, StrMethodFormatter

    fig, (ax_z, ax_s) = plt.subplots(1, 2, figsize=(12, 4.6), constrained_layout=True)
    all_rounds = sorted({t for c in report.clients for t in c.z})
    labels_z: list[tuple[float, float, str, str]] = []
    labels_s: list[tuple[float, float, str, str]] = []
    for c in report.clients:
        if not c.z:
            continue
        xs, zs, cumulative = round_series(all_rounds, c.z)
        colour = _COLOURS[c.watermarked]
        style = {"color": colour, "alpha": 0.85, "lw": 1.4}
        ax_z.plot(xs, zs, marker="o", ms=3, label=f"client {c.id}", **style)
        if math.isfinite(zs[-1]):
            labels_z.append((xs[-1], zs[-1], str(c.id), colour))
        if report.statistic == "calibrated":
            continue  # the right panel draws the verdict's own statistic (below)
        ax_s.plot(xs, cumulative, marker="o", ms=3, label=f"client {c.id}", **style)
        if math.isfinite(cumulative[-1]):
            labels_s.append((xs[-1], cumulative[-1], str(c.id), colour))
        if c.flagged:
            ax_s.plot(xs[-1], cumulative[-1], **_STAR)
    ax_z.axhline(0, color="black", lw=0.6)
    ax_z.set(title="per-round differential score $z_i^t$", xlabel="round t", ylabel="z")
    named = frozenset(str(c.id) for c in report.clients if c.flagged)
    if report.statistic == "calibrated":
        _verdict_panel(ax_s, report)
        _label_column(ax_z, labels_z, *_round_axis(ax_z, all_rounds, fig), first=named)
        return fig
    ax_s.axhline(report.gamma, color="black", ls="--", lw=1)
    ax_s.set(title="cumulative Stouffer $Z_i$ (★ flagged)", xlabel="rounds so far", ylabel="Z")
    handles = [
        plt.Line2D([], [], color=_COLOURS[k], label=lab)
        for k, lab in ((True, "watermarked"), (False, "clean"))
    ]
    if any(c.watermarked is None for c in report.clients):
        handles.append(plt.Line2D([], [], color=_COLOURS[None], label="unknown"))
    handles.append(plt.Line2D([], [], color="black", ls="--", label=f"γ = {report.gamma:g}"))
    _legend_below(ax_s, handles)
    if not all_rounds:
        return fig
    x_last = all_rounds[-1]
    x_min = all_rounds[0] - (0.3 if len(all_rounds) > 1 else 1.0)  # one round: off the edge
    # Integer round ticks, none in the label column.
    ticks = (
        sorted(
            {round(t) for t in MaxNLocator(integer=True).tick_values(all_rounds[0], x_last)}
            & set(range(all_rounds[0], x_last + 1))
        )
        or all_rounds
    )
    for ax in (ax_z, ax_s):
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_major_formatter(StrMethodFormatter("{x:.0f}"))
        ax.set_xlim(x_min, x_last + 0.3)
        ax.set_ylim(ax.get_ylim())  # freeze: the labels are placed in this range
    fig.draw_without_rendering()  # lay out, so the axes' size in points is known
    _label_column(ax_z, labels_z, x_min, x_last, first=named)
    _label_column(ax_s, labels_s, x_min, x_last, first=named)
    return fig


def _round_axis(ax, all_rounds: list[int], fig) -> tuple[float, float]:
    """Integer round ticks on ``ax``; returns the x range the label column needs."""
    from matplotlib.ticker import FixedLocator, StrMethodFormatter

    if not all_rounds:
        return 0.0, 0.0
    x_last, x_min = all_rounds[-1], all_rounds[0] - (0.3 if len(all_rounds) > 1 else 1.0)
    ax.xaxis.set_major_locator(FixedLocator(all_rounds))
    ax.xaxis.set_major_formatter(StrMethodFormatter("{x:.0f}"))
    ax.set_xlim(x_min, x_last + 0.3)
    ax.set_ylim(ax.get_ylim())
    fig.draw_without_rendering()
    return x_min, x_last


def _legend_below(ax: Axes, handles: list) -> None:
    """The legend in one row under the axes: outside them, it never covers a bar, a line or a
    star (inside, it hid the tops of the tallest bars and their stars)."""
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.14),
        ncol=len(handles),
        fontsize=8,
        frameon=False,
        handlelength=1.6,
        columnspacing=1.2,
    )


_STAR = {
    "marker": "*",
    "ms": 14,
    "color": "black",
    "mec": "white",
    "mew": 1.0,
    "zorder": 4,
    "clip_on": False,
    "linestyle": "none",
}
"""A named client's star: black with a white edge, seen on a red bar, a blue line or white."""
_MAX_CLIENT_TICKS = 25
"""Above this many clients, only every n-th client id is written under the bars."""


def _verdict_panel(ax, report: AttributionReport) -> None:
    """The calibrated verdict as it is decided: each client's ``-log10 p`` (Bonferroni over
    owners) against the cut ``-log10(alpha / K)``; named clients (★) are above it."""
    K = max(1, len(report.clients))
    cut = -math.log10((report.alpha or 0.01) / K)
    # The chernoff and patterns tails are upper bounds on p: the axis says so when one is drawn.
    bounded = any(c.tail in UPPER_BOUNDS for c in report.clients)
    what = "exact tail or its upper bound" if bounded else "exact tail"
    ids = [c.id for c in report.clients]
    heights = [min(-c.log10_p, 50.0) for c in report.clients]
    colours = [_COLOURS[c.watermarked] for c in report.clients]
    bars = ax.bar(range(K), heights, color=colours, alpha=0.85)
    for bar, c in zip(bars, report.clients, strict=True):
        if not c.calibrated:
            bar.set_hatch("//")
        if c.flagged:
            ax.plot(bar.get_x() + bar.get_width() / 2, bar.get_height(), **_STAR)
    ax.axhline(cut, color="black", ls="--", lw=1)
    # Room above the tallest bar for its star (drawn at the bar's top).
    ax.set_ylim(0, 1.1 * max([cut, *heights]))
    steps = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
    step = next((n for n in steps if K / n <= _MAX_CLIENT_TICKS), K)
    shown = range(0, len(ids), step)  # none before the owners have scored (scoring=owner)
    ax.set_xticks(list(shown), [str(ids[i]) for i in shown])
    ax.set_xlim(-0.7, K - 0.3)
    ax.set(
        title="verdict: $-\\log_{10} p$ of each client (★ named; drawn up to 50)",
        xlabel="client" if step == 1 else f"client (one id in {step} written)",
        ylabel=f"$-\\log_{{10}} p$ ({what}, Bonferroni over owners)",
    )
    import matplotlib.pyplot as plt

    handles = [
        plt.Line2D([], [], color=_COLOURS[k], lw=6, label=lab)
        for k, lab in ((True, "watermarked"), (False, "clean"))
    ]
    handles.append(plt.Line2D([], [], linestyle="none", label="named", **_legend_star()))
    handles.append(
        plt.Line2D(
            [],
            [],
            color="black",
            ls="--",
            label=f"α/K = {10**-cut:.1g} (family-wise α = {report.alpha})",
        )
    )
    _legend_below(ax, handles)


def _legend_star() -> dict:
    """The star's style for a legend handle (no clipping or layering there)."""
    return {k: v for k, v in _STAR.items() if k not in ("zorder", "clip_on", "linestyle")}


def plot_attribution(report: AttributionReport, path: str | Path) -> Path:
    """Two panels: per-round differential scores, and the verdict: under the paper statistic
    cumulative Stouffer Z with the γ line; under the calibrated statistic each client's
    ``-log10 p`` (the exact tail the verdict reads, or its upper bound) with the ``alpha / K``
    line.

    Watermarked clients are drawn in red, clean ones in blue, unknown in grey; flagged clients
    get a ★ at their final Z. Each line is labelled with its client id at its last point (labels
    spread apart, with a leader line, in a column right of the last round), and breaks at rounds
    the client was not scored in.
    """
    fig = build_attribution_figure(report)
    import matplotlib.pyplot as plt

    out = Path(path)
    try:
        fig.savefig(out, dpi=110)
    finally:
        plt.close(fig)
    return out
