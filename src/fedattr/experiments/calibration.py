"""``fedattr experiment calibration``: do a statistic's p-values mean what they say?

Null (client, key) pairs are the clean clients under every owner's key and the watermarked ones
under the other owners' keys, from runs with no watermarked client (``r = 0``) and with some.
Every run carries the calibrated statistic and, on the same training run, the paper's
(``variants``), so both are read on the same estimates. Writes ``calibration.json``,
``calibration.md`` (empirical FPR at alpha in {0.05, 0.01, 0.001} with exact binomial 95%
intervals, and the family-wise TPR/FPR) and ``qq.png`` (null p-values against uniform). One
run folder per (r, seed); re-running resumes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy.stats import beta, binom, norm

from ..config import load
from ..errors import UserError
from ..reporting.markdown import table
from ..reporting.run_folder import RunFolder
from .config import PRESET_OVERRIDES, DemoConfig, RunConfig, check_seeds
from .main import run_or_reuse
from .run import run_demo

BEDS: dict[str, list[str]] = {
    "synthetic": ["synthetic.common=1.0", "synthetic.heterogeneity=0.5"],
    **{name: list(sets) for name, sets in PRESET_OVERRIDES.items()},
}
"""Test beds: the synthetic federation made to fail like a real model (a shared direction
with a random projection on the key every round, persistent client drift), or an LLM preset."""

LEVELS = (0.05, 0.01, 0.001)
PAPER = [{"name": "paper", "statistic": "paper"}]


@dataclass
class CalibrationSpec:
    """What ``experiment calibration`` runs."""

    bed: str = "synthetic"
    seeds: Sequence[int] = tuple(range(200))
    r: Sequence[int] = (0, 3)
    config: str | None = None
    overrides: Sequence[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.bed not in BEDS:
            raise UserError(f"--bed: must be one of {', '.join(BEDS)}, got {self.bed!r}")
        check_seeds(self.seeds)
        if not self.r or any(r < 0 for r in self.r):
            raise UserError(f"--r: watermarked clients per run, e.g. 0,3; got {list(self.r)}")

    def run_config(self, r: int, seed: int) -> DemoConfig | RunConfig:
        """The resolved configuration of one run (the paper statistic as a variant)."""
        sets = [*BEDS[self.bed], f"variants={PAPER}".replace("'", '"')]
        if self.bed == "synthetic":
            sets += [f"synthetic.r={r}", f"synthetic.seed={seed}", f"attribution.seed={seed}",
                     f"secagg.seed={seed}", *self.overrides]  # fmt: skip
            return load(DemoConfig, self.config, sets)
        sets += [f"watermark.r={r}", f"fl.seed={seed}", f"data.seed={seed}",
                 f"attribution.seed={seed}", *self.overrides]  # fmt: skip
        return load(RunConfig, self.config, sets)


def run_calibration(
    spec: CalibrationSpec, out: str | Path, progress: Callable[[str], None] | None = None
) -> dict:
    """Run (or keep, or resume) every (r, seed), then write the summary files into ``out``."""
    say = progress or print
    out = Path(out)
    plan = [(r, seed, spec.run_config(r, seed)) for r in spec.r for seed in spec.seeds]
    for i, (r, seed, cfg) in enumerate(plan, 1):
        folder = out / f"r{r}-seed{seed}"
        if isinstance(cfg, DemoConfig):
            run_folder = RunFolder(folder)
            if run_folder.claim(cfg, reuse=True) != "finished":
                run_demo(cfg, progress=lambda _m: None).write(run_folder)
        else:
            run_or_reuse(cfg, folder, lambda m, i=i: say(f"[{i}/{len(plan)}] {m}"))
        if i % 20 == 0 or i == len(plan) or not isinstance(cfg, DemoConfig):
            say(f"[{i}/{len(plan)}] {folder.name}: done")
    summary = summarize([RunFolder(out / f"r{r}-seed{seed}").results() for r, seed, _ in plan])
    summary.update(bed=spec.bed, seeds=list(spec.seeds), r=list(spec.r))
    write_calibration(summary, out)
    return summary


def _null_pvalues(results: dict, view: dict, calibrated: bool) -> list[float]:
    # One statistic only: the report has no per-statistic components, its clients are them.
    by_statistic = view["by_statistic"] or {
        view["clients"][0]["statistic"]: {str(c["id"]): c for c in view["clients"]}
    }
    owner_of = results.get("federation", {}).get("watermarked", {})
    truth = {c["id"]: c["watermarked"] for c in results["clients"]}
    out = []
    for owner, per in by_statistic.items():
        for cid, row in per.items():
            if truth[int(cid)] and owner_of.get(cid, owner) == owner:
                continue  # the watermarked client under its own owner's key: not a null pair
            out.append(row["p"] if calibrated else float(norm.sf(row["Z"])))
    return out


def _rates(clients: list[dict]) -> tuple[int, int, int, int]:
    wm = [c for c in clients if c["watermarked"]]
    clean = [c for c in clients if not c["watermarked"]]
    return (sum(c["flagged"] for c in wm), len(wm), sum(c["flagged"] for c in clean), len(clean))


def summarize(runs: list[dict]) -> dict:
    """Null p-values and family-wise flag counts of both statistics over ``runs``."""
    stats: dict[str, dict] = {}
    for name in ("calibrated", "paper"):
        pvals: list[float] = []
        counts = np.zeros(4, dtype=int)
        for res in runs:
            view = res if name == "calibrated" else res["variants"]["paper"]
            pvals += _null_pvalues(res, view, name == "calibrated")
            counts += np.array(_rates(view["clients"]))
        p = np.array(pvals)
        levels = {}
        for a in LEVELS:
            k, n = int(np.sum(p < a)), max(1, len(p))
            lo = float(beta.ppf(0.025, k, n - k + 1)) if k > 0 else 0.0
            hi = float(beta.ppf(0.975, k + 1, n - k)) if k < n else 1.0
            band = (float(binom.ppf(0.025, n, a)) / n, float(binom.ppf(0.975, n, a)) / n)
            levels[str(a)] = {"fpr": k / n, "ci95": [lo, hi], "expected_band": list(band),
                              "inside": band[0] <= k / n <= band[1]}  # fmt: skip
        tp, n_wm, fp, n_clean = (int(x) for x in counts)
        stats[name] = {
            "null_pairs": len(p),
            "levels": levels,
            "tpr": tp / n_wm if n_wm else None,
            "watermarked": n_wm,
            "fpr_clients": fp / n_clean if n_clean else None,
            "clean": n_clean,
            "null_p": sorted(float(x) for x in p),
        }
    return {"statistics": stats, "runs": len(runs)}


def write_calibration(summary: dict, out: Path) -> None:
    """``calibration.json``, ``calibration.md`` and ``qq.png``."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.json").write_text(json.dumps(summary, indent=2))
    rows = []
    for name, s in summary["statistics"].items():
        cells = []
        for a in LEVELS:
            lv = s["levels"][str(a)]
            mark = "✓" if lv["inside"] else "✗"
            cells.append(f"{100 * lv['fpr']:.2f}% [{100 * lv['ci95'][0]:.2f}, "
                         f"{100 * lv['ci95'][1]:.2f}] {mark}")  # fmt: skip
        tpr = "–" if s["tpr"] is None else f"{100 * s['tpr']:.1f}% of {s['watermarked']}"
        fpr = "–" if s["fpr_clients"] is None else f"{100 * s['fpr_clients']:.2f}% of {s['clean']}"
        rows.append([name, s["null_pairs"], *cells, tpr, fpr])
    head = ["statistic", "null pairs", *[f"FPR at α={a} [95% CI]" for a in LEVELS],
            "named: watermarked", "named: clean"]  # fmt: skip
    text = (
        f"Bed `{summary['bed']}`, r ∈ {summary['r']}, {len(summary['seeds'])} seeds, "
        f"{summary['runs']} runs. FPR: share of null (client, key) pairs with p < α (✓: inside "
        "the binomial 95% interval around α). Named: clients flagged by the statistic's own "
        "rule (calibrated: family-wise α over clients × owners; paper: Z > γ).\n\n"
        + table(head, rows) + "\n\n![QQ plot](qq.png)\n"
    )
    (out / "calibration.md").write_text(text)
    _qq_plot(summary, out / "qq.png")


def _qq_plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 5))
    colours = {"calibrated": "tab:green", "paper": "tab:red"}
    n_max = 1
    for name, s in summary["statistics"].items():
        p = np.clip(np.array(s["null_p"]), 1e-12, 1.0)
        n = len(p)
        if not n:
            continue
        n_max = max(n_max, n)
        expected = (np.arange(1, n + 1) - 0.5) / n
        ax.loglog(expected, p, ".", ms=3, color=colours[name], label=f"{name} ({n} null pairs)")
    grid = (np.arange(1, n_max + 1) - 0.5) / n_max
    k = np.arange(1, n_max + 1)
    ax.fill_between(grid, beta.ppf(0.025, k, n_max - k + 1), beta.ppf(0.975, k, n_max - k + 1),
                    color="0.85", label="95% band (uniform)")  # fmt: skip
    ax.loglog([grid[0], 1], [grid[0], 1], "k--", lw=0.8)
    ax.set(xlabel="expected p (uniform)", ylabel="observed null p",
           title="null p-values against uniform")  # fmt: skip
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
