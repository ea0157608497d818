"""``fedattr experiment sweep``: any configuration keys, their cross product, one table.

Points are grouped by what they train: points that differ only in attribution settings (N, M,
alpha, gamma, statistic, null, ...) are one training run with one FedAttr observer per point
(``variants``), so an attribution-only sweep trains once per seed. One run folder per training
run and seed; a finished folder is kept, an interrupted one resumes, a folder of another
configuration is refused, so the command can be re-run after an interruption.
"""

from __future__ import annotations

import csv
import itertools
import json
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import canonical_key, load, parse_scalar, quiet_aliases
from ..errors import UserError
from ..fl.timing import ATTRIBUTION_STAGES
from ..pipeline.config import RunConfig, check_seeds, preset_overrides
from ..reporting.markdown import percent, table
from ..reporting.run_folder import RunFolder
from .main import run_or_reuse

# Attribution keys a FedAttr observer can vary on one training run (its SA release policy, the
# mode, is one per run).
_TRAINING_ATTRIBUTION_KEYS = {"attribution.protocol.mode"}


@dataclass(frozen=True)
class Axis:
    """One swept dimension: a column label and, per value, its display text and the
    configuration keys it sets (several keys move together, e.g. LoRA rank and alpha)."""

    label: str
    values: tuple[tuple[str, dict[str, str]], ...]

    @classmethod
    def of_key(cls, key: str, values: Sequence[str]) -> Axis:
        """The axis of one key (``--grid KEY=v1,v2``)."""
        return cls(key, tuple((v, {key: v}) for v in values))


def parse_grid(specs: Sequence[str]) -> list[Axis]:
    """``["attribution.protocol.M=2,5,10", ...]`` -> one :class:`Axis` per ``--grid``."""
    if not specs:
        raise UserError(
            "--grid: give at least one KEY=v1,v2,..., e.g. --grid attribution.protocol.M=2,5"
        )
    out: list[Axis] = []
    for spec in specs:
        key, sep, raw = spec.partition("=")
        values = [v.strip() for v in raw.split(",") if v.strip()]
        if not sep or not key.strip() or not values:
            raise UserError(
                f"--grid {spec!r}: expected KEY=v1,v2,..., e.g. attribution.protocol.M=2,5,10"
            )
        key = key.strip()
        if any(key == a.label for a in out):
            raise UserError(f"--grid: {key} is given twice; list all its values in one --grid")
        if len(set(values)) != len(values):
            raise UserError(f"--grid {spec!r}: a value is repeated")
        out.append(Axis.of_key(key, values))
    return out


def _canonical(key: str) -> str:
    """``key`` as the configuration spells it now (an old name's note comes with the run's
    own configuration)."""
    with quiet_aliases():
        return canonical_key(RunConfig, key)


def _is_attribution_only(key: str) -> bool:
    key = _canonical(key)
    return key.startswith("attribution.") and key not in _TRAINING_ATTRIBUTION_KEYS


def _slug(assignments: Sequence[tuple[str, str]]) -> str:
    text = "_".join(f"{k}={v}" for k, v in assignments) or "base"
    return re.sub(r"[^A-Za-z0-9._=-]", "-", text)


@dataclass
class SweepSpec:
    """What ``experiment sweep`` runs: the axes (their cross product), seeds, preset and fixed
    overrides; ``extra`` adds computed columns (label -> function of a point's settings and its
    training run's resolved configuration)."""

    axes: list[Axis]
    seeds: Sequence[int] = (0,)
    preset: str = "tiny"
    config: str | None = None
    overrides: Sequence[str] = ()
    name: str = "sweep"
    caption: str = ""
    layout: str = "attribution"
    """``attribution`` (TPR, FPR, z̄, p) or ``overhead`` (the paper's Tables 12-13: time and
    work per stage)."""
    extra: dict[str, Callable[[dict[str, str], RunConfig], str]] = field(default_factory=dict)
    points: list[dict[str, str]] = field(init=False)
    """Per point: every configuration key it sets -> its value text."""
    labels: list[dict[str, str]] = field(init=False)
    """Per point: every axis label -> the value shown in the table."""

    def __post_init__(self) -> None:
        preset_overrides(self.preset)  # validates the name before any work
        check_seeds(self.seeds)
        self.points, self.labels = [], []
        for combo in itertools.product(*(a.values for a in self.axes)):
            settings: dict[str, str] = {}
            for _, keys in combo:
                settings.update(keys)
            self.points.append(settings)
            self.labels.append(
                {a.label: shown for a, (shown, _) in zip(self.axes, combo, strict=True)}
            )

    @property
    def keys(self) -> list[str]:
        """The axis labels, in order."""
        return [a.label for a in self.axes]

    def groups(self) -> dict[str, list[int]]:
        """Training-run name -> indices of the points it carries (first one the primary)."""
        out: dict[str, list[int]] = {}
        for i, point in enumerate(self.points):
            training = [(k, v) for k, v in point.items() if not _is_attribution_only(k)]
            out.setdefault(_slug(training), []).append(i)
        return out

    def point_name(self, index: int) -> str:
        """SA-session / variant name of a point: its attribution assignments."""
        # by the key's last part (``M=10``), whichever name it was given by: runs keep their names
        attr = [
            (k.rsplit(".", 1)[1], v)
            for k, v in self.points[index].items()
            if _is_attribution_only(k)
        ]
        return " ".join(f"{k}={v}" for k, v in attr) or "fedattr"

    def run_config(self, group: Sequence[int], seed: int) -> RunConfig:
        """The training run of ``group`` at ``seed``: the first point's settings, the other
        points as attribution variants."""
        first = self.points[group[0]]
        variants = []
        for i in group[1:]:
            keys: dict[str, Any] = {"name": self.point_name(i)}
            for k, v in self.points[i].items():
                if _is_attribution_only(k):
                    *sections, leaf = _canonical(k).split(".")[1:]
                    node = keys
                    for part in sections:
                        node = node.setdefault(part, {})
                    node[leaf] = parse_scalar(v)
            variants.append(keys)
        sets = [
            *preset_overrides(self.preset),
            f"fl.seed={seed}",
            f"data.seed={seed}",
            f"attribution.seed={seed}",
            *self.overrides,
            *(f"{k}={v}" for k, v in first.items()),
        ]
        if variants:
            sets.append("variants=" + json.dumps(variants))
        return load(RunConfig, self.config, sets)


def _point_metrics(results: dict, variant: str | None) -> dict[str, Any]:
    """One point's figures from its training run's ``results.json``."""
    part = results if variant is None else results["variants"][variant]
    clients = part["clients"]
    pos = [c for c in clients if c.get("watermarked")]
    neg = [c for c in clients if not c.get("watermarked")]

    timing = part["timing"]
    # A variant's timing holds its rounds' SA and scoring only; older runs have no verdict_s.
    attribution_s = sum(timing.get(stage, 0.0) for stage in ATTRIBUTION_STAGES)
    work = results.get("work", {}) if variant is None else {}
    return {
        "sa_s": timing["sa_s"],
        "scoring_s": timing["scoring_s"],
        "verdict_s": timing.get("verdict_s"),
        "models_scored": work.get("models_scored"),
        "tpr": part["tpr"],
        "fpr": part["fpr"],
        "z_pos": _mean([c.get("Z") for c in pos]),
        "z_neg": _mean([c.get("Z") for c in neg]),
        "weakest_p": max((c["p"] for c in pos if c.get("p") is not None), default=None),
        "sa_queries": part["sa_queries"],
        "attribution_s": attribution_s,
        "run_s": results["timing"]["total_s"],
        "train_s": results["timing"]["train_s"],
    }


def run_sweep(
    spec: SweepSpec, out: str | Path, progress: Callable[[str], None] | None = None
) -> dict:
    """Run (or keep, or resume) every training run, then write ``table.md``, ``table.csv``,
    ``results.json`` and one ``plot-<key>.png`` per swept key into ``out``."""
    say = progress or print
    out = Path(out)
    groups = spec.groups()
    # Every configuration first: bad input fails before any training or folder.
    plan = [
        (name, seed, members, spec.run_config(members, seed))
        for name, members in groups.items()
        for seed in spec.seeds
    ]
    if out.exists() and not out.is_dir():
        raise UserError(f"--out: {str(out)!r} is a file; choose a new or existing folder")
    out.mkdir(parents=True, exist_ok=True)
    for i, (name, seed, members, cfg) in enumerate(plan, 1):
        label = f"[{i}/{len(plan)}] {len(members)} point(s)"
        run_or_reuse(cfg, out / f"{name}_seed{seed}", lambda m, label=label: say(f"{label} {m}"))
    rows = []
    for name, members in groups.items():
        for seed in spec.seeds:
            results = RunFolder(out / f"{name}_seed{seed}").results()
            for k, i in enumerate(members):
                metrics = _point_metrics(results, None if k == 0 else spec.point_name(i))
                rows.append(
                    {
                        "point": i,
                        "seed": seed,
                        "run": f"{name}_seed{seed}",
                        **spec.labels[i],
                        **metrics,
                    }
                )
    configs = {i: cfg for _, seed, members, cfg in plan if seed == spec.seeds[0] for i in members}
    summary = summarize(spec, rows, configs)
    _write(spec, summary, rows, out)
    return summary


def _mean(values: list[Any]) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.fmean(xs) if xs else None


def summarize(spec: SweepSpec, rows: list[dict], configs: dict[int, RunConfig]) -> dict:
    """Per point: means over seeds (median for the weakest p), and the runs it came from."""
    points = []
    for i, values in enumerate(spec.labels):
        mine = [r for r in rows if r["point"] == i]
        weakest = [r["weakest_p"] for r in mine if r["weakest_p"] is not None]
        points.append(
            {
                "values": values,
                "settings": spec.points[i],
                **{label: fn(spec.points[i], configs[i]) for label, fn in spec.extra.items()},
                "runs": sorted({r["run"] for r in mine}),
                "seeds": len(mine),
                **{
                    m: _mean([r[m] for r in mine])
                    for m in (
                        "tpr",
                        "fpr",
                        "z_pos",
                        "z_neg",
                        "sa_queries",
                        "attribution_s",
                        "run_s",
                        "train_s",
                        "sa_s",
                        "scoring_s",
                        "verdict_s",
                        "models_scored",
                    )
                },
                "weakest_p": statistics.median(weakest) if weakest else None,
            }
        )
    trainings = len({r["run"] for r in rows})
    return {
        "name": spec.name,
        "caption": spec.caption,
        "layout": spec.layout,
        "axes": {a.label: [shown for shown, _ in a.values] for a in spec.axes},
        "extra": list(spec.extra),
        "seeds": list(spec.seeds),
        "preset": spec.preset,
        "overrides": list(spec.overrides),
        "training_runs": trainings,
        "points": points,
    }


def _num(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def format_table(summary: dict) -> str:
    """``table.md``: one row per point."""
    if summary.get("layout") == "overhead":
        return format_overhead(summary)
    keys = list(summary["axes"])
    extra = summary.get("extra", [])
    head = [
        *keys,
        *extra,
        "TPR",
        "FPR",
        "z̄ watermarked",
        "z̄ clean",
        "weakest watermarked p",
        "SA queries",
        "attribution s",
        "run wall s",
        "training run",
    ]
    rows = []
    for p in summary["points"]:
        run = p["runs"][0].rsplit("_seed", 1)[0] if p["runs"] else ""
        rows.append(
            [
                *(p["values"][k] for k in keys),
                *(p[e] for e in extra),
                percent(p["tpr"]),
                percent(p["fpr"]),
                _num(p["z_pos"], "+.2f"),
                _num(p["z_neg"], "+.2f"),
                _num(p["weakest_p"], ".2g"),
                _num(p["sa_queries"], ".0f"),
                _num(p["attribution_s"], ".1f"),
                _num(p["run_s"], ".0f"),
                f"`{run}`",
            ]
        )
    caption = (
        (summary.get("caption") or "")
        + f"Sweep over {', '.join(keys)} (preset {summary['preset']}; seeds "
        f"{summary['seeds']}; {summary['training_runs']} training run(s) for "
        f"{len(summary['points'])} point(s) × {len(summary['seeds'])} seed(s)). Means over "
        "seeds; weakest watermarked p: the median over seeds of the largest p among watermarked "
        "clients. Points with the same training run were attributed on one run (its wall time "
        "counts it once).\n\n"
    )
    return caption + table(head, rows) + "\n"


def format_overhead(summary: dict) -> str:
    """``table.md`` in the layout of the paper's Tables 12-13: training, SA queries and
    scoring evaluations (count, total, per unit) and FedAttr's share of training time."""
    keys = list(summary["axes"])
    extra = summary.get("extra", [])
    head = [
        *keys,
        *extra,
        "training s",
        "SA queries",
        "SA total s",
        "per query ms",
        "scoring evaluations",
        "scoring total s",
        "per evaluation s",
        "verdict s",
        "% of training",
    ]
    rows = []
    for p in summary["points"]:
        q, n = p["sa_queries"], p["models_scored"]
        share = p["attribution_s"] / p["train_s"] if p["train_s"] else None
        rows.append(
            [
                *(p["values"][k] for k in keys),
                *(p[e] for e in extra),
                _num(p["train_s"], ".1f"),
                _num(q, ".0f"),
                _num(p["sa_s"], ".1f"),
                _num(1000 * p["sa_s"] / q if q else None, ".1f"),
                _num(n, ".0f"),
                _num(p["scoring_s"], ".1f"),
                _num(p["scoring_s"] / n if n else None, ".3f"),
                _num(p.get("verdict_s"), ".1f"),
                percent(share),
            ]
        )
    caption = (
        (summary.get("caption") or "")
        + f"Preset {summary['preset']}; seeds {summary['seeds']} (means). SA queries include "
        "each round's aggregate; scoring evaluations are the models the detector read "
        "(reference, every candidate, the SA mean); the verdict reads every client's summed "
        "change with each owner's key at the end (exact tails, rank check).\n\n"
    )
    return caption + table(head, rows) + "\n"


def _write(spec: SweepSpec, summary: dict, rows: list[dict], out: Path) -> None:
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    (out / "table.md").write_text(format_table(summary))
    with (out / "table.csv").open("w", newline="") as f:
        fields = [
            "point",
            "seed",
            "run",
            *spec.keys,
            "tpr",
            "fpr",
            "z_pos",
            "z_neg",
            "weakest_p",
            "sa_queries",
            "attribution_s",
            "run_s",
            "train_s",
        ]
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: r.get(k) for k in fields})
    for key in spec.keys:
        _plot_key(summary, key, out / f"plot-{re.sub(r'[^A-Za-z0-9._-]', '-', key)}.png")


def _plot_key(summary: dict, key: str, path: Path) -> None:
    """TPR/FPR (left) and z̄ (right) against ``key``'s values, averaged over the other keys."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = summary["axes"][key]
    numeric = all(isinstance(parse_scalar(v), (int, float)) for v in values)
    xs = [float(parse_scalar(v)) for v in values] if numeric else list(range(len(values)))

    def series(metric: str) -> list[float]:
        out = []
        for v in values:
            m = _mean([p[metric] for p in summary["points"] if p["values"][key] == v])
            out.append(float("nan") if m is None else m)
        return out

    fig, left = plt.subplots(figsize=(6, 3.6))
    left.plot(xs, [100 * x for x in series("tpr")], "o-", color="tab:red", label="TPR")
    left.plot(xs, [100 * x for x in series("fpr")], "s-", color="tab:blue", label="FPR")
    left.set_ylabel("rate (%)")
    left.set_ylim(-5, 105)
    right = left.twinx()
    right.plot(xs, series("z_pos"), "o--", color="tab:red", alpha=0.6, label="z̄ watermarked")
    right.plot(xs, series("z_neg"), "s--", color="tab:blue", alpha=0.6, label="z̄ clean")
    right.set_ylabel("mean Z")
    left.set_xlabel(key)
    if not numeric:
        left.set_xticks(xs, values)
    lines = left.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    labels = left.get_legend_handles_labels()[1] + right.get_legend_handles_labels()[1]
    left.legend(lines, labels, fontsize=8, loc="best")
    left.set_title(f"{key} (mean over the other swept keys and seeds)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
