"""Matplotlib figures of an attribution report (headless: the Agg backend)."""

from __future__ import annotations

import math
from pathlib import Path

from ..attribution.stouffer import AttributionReport


def plot_attribution(report: AttributionReport, path: str | Path) -> Path:
    """Two panels: per-round differential scores, and cumulative Stouffer Z with the γ line.

    Watermarked clients are drawn in red, clean ones in blue, unknown in grey; flagged clients
    get a marker at their final Z.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax_z, ax_s) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    colours = {True: "tab:red", False: "tab:blue", None: "tab:grey"}
    for c in report.clients:
        rounds = sorted(c.z)
        if not rounds:
            continue
        zs = [c.z[t] for t in rounds]
        cumulative = [sum(zs[: k + 1]) / math.sqrt(k + 1) for k in range(len(zs))]
        style = {"color": colours[c.watermarked], "alpha": 0.85, "lw": 1.4}
        ax_z.plot(rounds, zs, marker="o", ms=3, **style)
        ax_s.plot(rounds, cumulative, marker="o", ms=3, **style)
        ax_s.annotate(
            str(c.id),
            (rounds[-1], cumulative[-1]),
            xytext=(4, 0),
            textcoords="offset points",
            fontsize=8,
            va="center",
        )
        if c.flagged:
            ax_s.plot(rounds[-1], cumulative[-1], marker="*", ms=12, color="black")
    ax_z.axhline(0, color="black", lw=0.6)
    ax_z.set(title="per-round differential score $z_i^t$", xlabel="round t", ylabel="z")
    ax_s.axhline(report.gamma, color="black", ls="--", lw=1, label=f"γ = {report.gamma:g}")
    ax_s.set(title="cumulative Stouffer $Z_i$ (★ flagged)", xlabel="rounds so far", ylabel="Z")
    handles = [
        plt.Line2D([], [], color=colours[k], label=lab)
        for k, lab in ((True, "watermarked"), (False, "clean"))
    ]
    handles.append(plt.Line2D([], [], color="black", ls="--", label=f"γ = {report.gamma:g}"))
    ax_s.legend(handles=handles, loc="upper left", fontsize=8)
    for ax in (ax_z, ax_s):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
