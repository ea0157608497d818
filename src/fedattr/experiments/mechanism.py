"""``fedattr experiment mechanism``: the four panels of the paper's Figure 2 from one run.

Per-round differential scores are modelled as ``z_i^t = eps + m * [i watermarked] + nu * e``:
``eps`` is what a benign client's estimate picks up (cross-talk from other clients' updates
through the alpha weights, and the round's common direction), ``m`` the watermark signal of a
client's own update, ``nu`` the spread. A watermarked client is read under its own owner's
statistic; a benign client under every owner's statistic (each is a sample of the benign
behaviour) for the estimates, and under its strongest statistic for the Stouffer curve (the
flag rule). Under the empirical null (``results.json`` says ``null``) the scores are first
standardised as FedAttr's Stouffer read them.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np

from ..attribution.stouffer import empirical_null
from ..errors import UserError
from ..reporting.run_folder import RunFolder


def _load(run_dir: Path) -> tuple[dict, list[dict]]:
    folder = RunFolder(run_dir)
    return folder.results(), folder.read_rounds()


def scores_by_client(rounds: list[dict]) -> dict[int, dict[str, dict[int, float]]]:
    """client -> statistic -> round -> differential z (from ``rounds.jsonl``)."""
    out: dict[int, dict[str, dict[int, float]]] = {}
    for rec in rounds:
        for t in rec["targets"]:
            for stat, z in t["z"].items():
                out.setdefault(t["target"], {}).setdefault(stat, {})[t["round"]] = z
    return out


def estimate(run_dir: str | Path) -> dict:
    """m-hat, eps-hat, nu-hat and everything the panels draw, from a finished run folder."""
    results, rounds = _load(Path(run_dir))
    owner_of = {int(c): o for c, o in results["federation"]["watermarked"].items()}
    z = scores_by_client(rounds)
    if results.get("null") == "empirical":
        # Read the scores as FedAttr's Stouffer did: standardised per round and statistic.
        stats = {s for per in z.values() for s in per}
        for stat in stats:
            std = empirical_null({c: per[stat] for c, per in z.items() if stat in per})
            for c, per in std.items():
                z[c][stat] = per
    wm_z = [v for c, o in owner_of.items() for v in z.get(c, {}).get(o, {}).values()]
    benign = [c for c in z if c not in owner_of]
    ben_z = [v for c in benign for per in z[c].values() for v in per.values()]
    if not wm_z or not ben_z:
        raise UserError("mechanism: the run needs watermarked and benign clients (watermark.r)")
    eps = statistics.fmean(ben_z)
    m = statistics.fmean(wm_z) - eps
    resid = [v - eps - m for v in wm_z] + [v - eps for v in ben_z]
    nu = statistics.pstdev(resid)
    return {
        "m_hat": m,
        "eps_hat": eps,
        "nu_hat": nu,
        "gamma": results["gamma"],
        "null": results.get("null", "theoretical"),
        "watermarked": {str(c): o for c, o in owner_of.items()},
        "rounds": len(rounds),
        "residuals": resid,
        "wm_per_round": {str(c): z.get(c, {}).get(o, {}) for c, o in owner_of.items()},
        "benign_per_round": {str(c): z[c] for c in benign},
        "direct": next((b for b in results["baselines"] if b["name"] == "Direct (oracle)"), None),
    }


def _series(est: dict, client: str) -> dict[int, float]:
    if client in est["wm_per_round"]:
        return {int(t): v for t, v in est["wm_per_round"][client].items()}
    per = est["benign_per_round"][client]
    best = max(per, key=lambda s: sum(per[s].values()))  # the statistic the flag rule reads
    return {int(t): v for t, v in per[best].items()}


def _finish(fig, ax, title: str, path: Path) -> Path:
    import matplotlib.pyplot as plt

    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_mechanism(est: dict, out: str | Path) -> list[Path]:
    """Write ``fig2a_direct_vs_differential.png`` ... ``fig2d_stouffer_vs_rounds.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    clients = sorted({*est["wm_per_round"], *est["benign_per_round"]}, key=int)
    is_wm = {c: c in est["wm_per_round"] for c in clients}
    colour = {True: "tab:red", False: "tab:blue"}
    last = est["rounds"]
    paths = []

    # (a) direct vs differential at the last round
    fig, ax = plt.subplots(figsize=(7, 3.6))
    diff = [_series(est, c).get(last, math.nan) for c in clients]
    per = (est["direct"] or {}).get("z", {})
    direct = []
    for c in clients:
        # A watermarked client under its owner's statistic, a benign one under its strongest.
        owner = est["watermarked"].get(c)
        stats = [owner] if owner in per else list(per)
        vals = [per[s][c][str(last)] for s in stats if str(last) in per[s].get(c, {})]
        direct.append(max(vals) if vals else math.nan)
    x = np.arange(len(clients))
    ax.bar(x - 0.2, direct, 0.4, label="direct Score(w + Δ_i)", color="0.6")
    ax.bar(
        x + 0.2,
        diff,
        0.4,
        label="differential (FedAttr)",
        color=[colour[is_wm[c]] for c in clients],
    )
    ax.set_xticks(x, [f"{c}{'*' if is_wm[c] else ''}" for c in clients])
    ax.set_xlabel("client (* = watermarked)")
    ax.set_ylabel(f"score at round {last}")
    paths.append(
        _finish(
            fig, ax, "(a) direct vs differential score", out / "fig2a_direct_vs_differential.png"
        )
    )

    # (b) per-round differential scores
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for c in clients:
        s = _series(est, c)
        ax.plot(
            sorted(s),
            [s[t] for t in sorted(s)],
            marker="o",
            color=colour[is_wm[c]],
            alpha=0.8 if is_wm[c] else 0.4,
            lw=1,
        )
    ax.axhline(est["eps_hat"], color="tab:blue", ls="--", label=f"ε̂ = {est['eps_hat']:.2f}")
    ax.axhline(
        est["eps_hat"] + est["m_hat"],
        color="tab:red",
        ls="--",
        label=f"ε̂ + m̂ (m̂ = {est['m_hat']:.2f})",
    )
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("round t")
    ax.set_ylabel("differential z_i^t")
    paths.append(
        _finish(
            fig, ax, "(b) watermarked (red) vs benign (blue)", out / "fig2b_per_round_scores.png"
        )
    )

    # (c) residual histogram with the fitted Gaussian
    fig, ax = plt.subplots(figsize=(5, 3.6))
    r = np.array(est["residuals"])
    ax.hist(r, bins=max(8, len(r) // 6), density=True, color="0.7")
    grid = np.linspace(r.min() - 1, r.max() + 1, 200)
    nu = max(est["nu_hat"], 1e-9)
    ax.plot(
        grid,
        np.exp(-0.5 * (grid / nu) ** 2) / (nu * math.sqrt(2 * math.pi)),
        "k-",
        label=f"N(0, ν̂²), ν̂ = {nu:.2f}",
    )
    ax.set_xlabel("centred residual z − μ̂")
    paths.append(_finish(fig, ax, "(c) residuals", out / "fig2c_residuals.png"))

    # (d) Stouffer Z over the first T' rounds
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for c in clients:
        s = _series(est, c)
        ts = sorted(s)
        Z = [sum(s[t] for t in ts[:k]) / math.sqrt(k) for k in range(1, len(ts) + 1)]
        ax.plot(
            range(1, len(ts) + 1),
            Z,
            marker="o",
            color=colour[is_wm[c]],
            alpha=0.8 if is_wm[c] else 0.4,
            lw=1,
        )
    ax.axhline(est["gamma"], color="k", ls=":", label=f"γ = {est['gamma']}")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("rounds T'")
    ax.set_ylabel("Stouffer Z")
    paths.append(_finish(fig, ax, "(d) Stouffer Z vs rounds", out / "fig2d_stouffer_vs_rounds.png"))
    return paths


def write_mechanism(run_dir: str | Path, out: str | Path) -> dict:
    """Estimates to ``mechanism.json`` and the four panels to ``out``."""
    est = estimate(run_dir)
    plot_mechanism(est, out)
    summary = {k: est[k] for k in ("m_hat", "eps_hat", "nu_hat", "gamma", "rounds", "null")}
    summary["watermarked"] = est["watermarked"]
    summary["run"] = str(run_dir)
    Path(out, "mechanism.json").write_text(json.dumps(summary, indent=2))
    return summary
