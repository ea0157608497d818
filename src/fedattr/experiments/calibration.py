"""``fedattr experiment calibration``: do a statistic's p-values mean what they say?

Null (client, key) pairs are the clean clients under every owner's key and the watermarked ones
under the other owners' keys, from runs with no watermarked client (``r = 0``) and with some.
Every run carries the calibrated statistic and, on the same training run, the paper's
(``variants``), so both are read on the same estimates. Writes ``calibration.json``,
``calibration.md`` (empirical FPR at alpha in {0.05, 0.01, 0.001} with exact binomial 95%
intervals; at the level the product uses, the share of runs that name any wrong pair (a clean
client, or a watermarked client for another owner), with its exact interval; the family-wise
TPR) and ``qq.png`` (null p-values against uniform). One run folder per (r, seed);
re-running resumes; ``jobs`` runs them in parallel processes, one thread each, which leave
when the calibration does.

:func:`tail_check` compares the exact tail the verdict reads with tilted Monte Carlo over
random keys on the change matrices saved by real runs (``changes.safetensors``).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from scipy.stats import beta, binom, norm

from ..attribution.config import AttributionConfig
from ..config import canonical, load, quiet_aliases
from ..errors import UserError
from ..pipeline.config import PRESET_OVERRIDES, DemoConfig, RunConfig, check_seeds
from ..pipeline.run import run_demo
from ..reporting.markdown import table
from ..reporting.run_folder import RunFolder
from ..watermarks.tail.methods import MIN_EFFECTIVE_CELLS
from .main import run_or_reuse

_HALF = ["fl.participation=0.5", "attribution.protocol.N=3", "secagg.min_members=3", "fl.rounds=10"]
"""Half the clients a round (5 of 10): N = 3 is the largest design a 5-client round admits."""

STRESS_BEDS: dict[str, list[str]] = {
    # Partial participation with strong quantity skew: shards of none or a handful of records to
    # about 1,500 (Dirichlet 0.5 over the sizes), five clients a round, ten rounds.
    "partial-skew": [*_HALF, "data.partition=quantity"],
    # Two clean clients that send nothing or a tenth of their update, in rounds with and
    # without a watermarked client (half the clients a round).
    "free-riders": [
        *_HALF,
        'fl.clients=[{"count": 1, "update_scale": 0}, {"count": 1, "update_scale": 0.1}]',
    ],
    # Three clients (drawn among all) that complete half their local steps and drop out of a
    # fifth of their rounds.
    "stragglers": ['fl.clients=[{"count": 3, "among": "any", "steps": 0.5, "drop": 0.2}]'],
    # Five clients (N = 3, the largest a round of five admits).
    "few-clients": [
        "fl.K=5",
        "attribution.protocol.N=3",
        "secagg.min_members=3",
        "data.records=1000",
    ],
    # Fifty clients and five owners, 100 records a client.
    "many-clients": ["fl.K=50", "watermark.owners=5", "data.records=5000"],
}
"""The stress beds of the embedded default (the tiny preset): federations whose clients differ,
where a statistic that leans on who else is in the round fails once the reference has learned
a key. Each is the tiny preset plus these settings."""

BEDS: dict[str, list[str]] = {
    "synthetic": ["synthetic.common=1.0", "synthetic.heterogeneity=0.5"],
    **{name: list(sets) for name, sets in PRESET_OVERRIDES.items()},
    **{name: [*PRESET_OVERRIDES["tiny"], *sets] for name, sets in STRESS_BEDS.items()},
}
"""Test beds: the synthetic federation made to fail like a real model (a shared direction
with a random projection on the key every round, persistent client drift), an LLM preset, or
a stress bed of the tiny preset (:data:`STRESS_BEDS`)."""

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
    jobs: int = 1
    reread: bool = False
    """Read every run's verdicts again from its saved changes with this fedattr's tails."""

    def __post_init__(self) -> None:
        if not isinstance(self.jobs, int) or self.jobs < 1:
            raise UserError(f"--jobs: parallel runs, an integer >= 1; got {self.jobs!r}")
        if self.bed not in BEDS:
            raise UserError(f"--bed: must be one of {', '.join(BEDS)}, got {self.bed!r}")
        check_seeds(self.seeds)
        if not self.r or any(r < 0 for r in self.r):
            raise UserError(f"--r: watermarked clients per run, e.g. 0,3; got {list(self.r)}")

    def run_config(self, r: int, seed: int) -> DemoConfig | RunConfig:
        """The resolved configuration of one run (the paper statistic as a variant)."""
        sets = [*BEDS[self.bed], f"variants={PAPER}".replace("'", '"')]
        if self.bed == "synthetic":
            sets += [
                f"synthetic.r={r}",
                f"synthetic.seed={seed}",
                f"attribution.seed={seed}",
                f"secagg.seed={seed}",
                *self.overrides,
            ]
            return load(DemoConfig, self.config, sets)
        # Each run draws its own owner keys: the family-wise rate is over random keys, and runs
        # that shared one key would all measure that one key's luck.
        sets += [
            f"watermark.r={r}",
            f"fl.seed={seed}",
            f"data.seed={seed}",
            f"watermark.key_seed={seed}",
            f"attribution.seed={seed}",
            *self.overrides,
        ]
        return load(RunConfig, self.config, sets)


def _one_run(
    spec: CalibrationSpec,
    r: int,
    seed: int,
    folder: Path,
    progress: Callable[[str], None] | None = None,
) -> bool:
    """Run (or keep) one (r, seed) in ``folder``; ``progress`` hears an LLM run's steps.
    Returns whether it was a synthetic run (quick: reported every 20)."""
    cfg = spec.run_config(r, seed)
    if isinstance(cfg, DemoConfig):
        run_folder = RunFolder(folder)
        if run_folder.claim(cfg, reuse=True) != "finished":
            run_demo(cfg, progress=lambda _m: None).write(run_folder)
        return True
    run_or_reuse(cfg, folder, progress or (lambda _m: None))
    return False


def _saved_changes(run: Path) -> Path:
    """A run folder's ``changes.safetensors``, or one line saying it has none."""
    file = run / "changes.safetensors"
    if not file.is_file():
        raise UserError(
            f"RUN_DIR: {str(run)!r} holds no changes.safetensors (a run with the calibrated "
            "statistic writes it)"
        )
    return file


def simulated_keys(folder: str | Path, results: dict) -> dict | None:
    """The owners' keys of a finished simulation whose owners fedattr played (KGW reading, keys
    drawn from ``watermark.key_seed``), rebuilt from its ``config.json`` as green masks over its
    probe contexts (each owner's over its own documents' where the run read them: written again
    by the teacher, deterministic in the config), so that reading it again gives the verdicts
    the run gave (the shifted-key test needs the key). ``None`` where the run's keys are not
    the simulation's to rebuild: the synthetic bed, FK, owners' key files, owner scoring,
    ``few_cells = "bound"``."""
    laws = results.get("key_laws") or {}
    if not any(law.get("kind") == "row-subsets" and law.get("m", 1) > 1 for law in laws.values()):
        return None
    try:
        cfg = load(RunConfig, Path(folder) / "config.json", [], quiet=True)
    except UserError:
        return None  # not a run of the LLM pipeline (the synthetic bed's DemoConfig)
    wm, att = cfg.watermark, cfg.attribution
    if (
        wm.kind != "kgw"
        or wm.detector != "reading"
        or wm.kgw.key_files
        or att.scoring != "server"
        or att.calibrated.few_cells != "shifted-keys"
    ):
        return None
    from ..fl.federation import build_federation, detection_records
    from ..models.loading import load_model
    from ..models.lora import load_state
    from ..models.text import encode_examples
    from ..watermarks.documents import KGWDocumentScorer
    from ..watermarks.radioactivity import KGWReadingScorer
    from ..watermarks.registry import WATERMARKS

    def _quiet(_m: str) -> None:
        pass

    model, tokenizer = load_model(cfg.model, _quiet)
    if wm.reads_documents:
        # Each owner's key over its own documents' contexts: the documents are written again
        # (deterministic in the config; the teacher is the run's costliest step after training).
        fed = build_federation(cfg.data, wm, cfg.fl.K, cfg.fl.seed, model, tokenizer, _quiet)
        docs = KGWDocumentScorer(
            model, tokenizer, fed.owner_docs, fed.owners, load_state, max_len=cfg.data.max_len
        )
        return {o: r.green[o].cpu() for o, r in docs.readers.items()}
    examples = encode_examples(tokenizer, detection_records(cfg.data, wm), cfg.data.max_len)
    owners = WATERMARKS["kgw"].owners(wm, len(tokenizer), cfg.fl.K, [])
    scorer = KGWReadingScorer(model, examples, owners, load_state, pad_id=tokenizer.pad_token_id)
    return {name: mask.cpu() for name, mask in scorer.green.items()}


def reread_run(folder: str | Path) -> dict:
    """A finished run's ``results.json`` with its calibrated verdicts read again from its
    ``changes.safetensors`` by this fedattr's tails (the run folder is left as it is); a
    simulation's owners' keys are rebuilt from its config where the tails need them."""
    import copy
    import json

    import torch

    from ..attribution.calibrated.sums import CalibratedNull
    from ..rows import open_changes

    run = RunFolder(folder)
    results = run.results()
    file = _saved_changes(Path(folder))
    saved = json.loads((Path(folder) / "config.json").read_text()).get("attribution", {})
    with quiet_aliases():  # a run written before the sections: its flat keys, read quietly
        attribution = canonical(AttributionConfig, saved)
    null = CalibratedNull.from_results(
        results,
        open_changes(file),  # a large file by row blocks (its rank check: other keys)
        seed=int(attribution.get("seed", 0)),
        name_uncalibrated=bool(attribution.get("calibrated", {}).get("name_uncalibrated", False)),
    )
    null.keys = simulated_keys(folder, results) or {}
    truth = {c["id"]: bool(c["watermarked"]) for c in results["clients"]}
    with torch.no_grad():
        report = null.report(truth)
    out = copy.deepcopy(results)
    out.update(report.to_dict(), reread=True)
    return out


def _reread(folders: Sequence[Path], spec: CalibrationSpec, say: Callable[[str], None]) -> list:
    """:func:`reread_run` over ``folders`` (in ``spec.jobs`` processes), in order, with one
    progress line per run (every 20 on the synthetic bed: a run takes milliseconds there)."""
    every = 20 if spec.bed == "synthetic" else 1

    def tell(i: int, folder: Path) -> None:
        if i % every == 0 or i == len(folders):
            say(f"[{i}/{len(folders)}] {folder.name}: read again")

    if spec.jobs == 1:
        found = []
        for i, folder in enumerate(folders, 1):
            found.append(reread_run(folder))
            tell(i, folder)
        return found
    with _pool(spec.jobs) as pool:
        futures = {pool.submit(reread_run, f): i for i, f in enumerate(folders)}
        out: list = [None] * len(folders)
        for n, fut in enumerate(as_completed(futures), 1):
            out[futures[fut]] = fut.result()
            tell(n, folders[futures[fut]])
        return out


def _pool(jobs: int) -> ProcessPoolExecutor:
    """``jobs`` worker processes, one thread each, that leave when this process does."""
    return ProcessPoolExecutor(
        jobs, mp_context=get_context("spawn"), initializer=_worker, initargs=(os.getpid(),)
    )


def _worker(parent: int) -> None:
    # Each parallel run takes one core: processes that each take all of them slow each other.
    os.environ["FEDATTR_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    # A calibration stopped by ``kill`` (Ctrl-C reaches the whole process group, kill does not)
    # would leave its workers finishing their runs for minutes beside whatever comes next.
    threading.Thread(target=_leave_with, args=(parent,), daemon=True).start()


def _leave_with(parent: int, every: float = 0.5) -> None:
    """Exit this process once ``parent`` is no longer its parent; the run it was in resumes
    from its checkpoint when the calibration is started again."""
    while os.getppid() == parent:
        time.sleep(every)
    os._exit(1)


def run_calibration(
    spec: CalibrationSpec, out: str | Path, progress: Callable[[str], None] | None = None
) -> dict:
    """Run (or keep, or resume) every (r, seed), then write the summary files into ``out``."""
    say = progress or print
    out = Path(out)
    plan = [(r, seed) for r in spec.r for seed in spec.seeds]
    for r, seed in plan[:1]:
        spec.run_config(r, seed)  # bad settings: one line before any run starts
    if spec.jobs == 1:
        for i, (r, seed) in enumerate(plan, 1):
            folder = out / f"r{r}-seed{seed}"
            quick = _one_run(spec, r, seed, folder, lambda m, i=i: say(f"[{i}/{len(plan)}] {m}"))
            if i % 20 == 0 or i == len(plan) or not quick:
                say(f"[{i}/{len(plan)}] {folder.name}: done")
    else:
        out.mkdir(parents=True, exist_ok=True)
        with _pool(spec.jobs) as pool:
            futures = {
                pool.submit(_one_run, spec, r, seed, out / f"r{r}-seed{seed}"): f"r{r}-seed{seed}"
                for r, seed in plan
            }
            for i, fut in enumerate(as_completed(futures), 1):
                fut.result()
                if i % 20 == 0 or i == len(plan):
                    say(f"[{i}/{len(plan)}] {futures[fut]}: done")
    folders = [out / f"r{r}-seed{seed}" for r, seed in plan]
    if spec.reread:
        found = _reread(folders, spec, say)
    else:
        found = [RunFolder(f).results() for f in folders]
    results = dict(zip(plan, found, strict=True))
    summary = summarize(list(results.values()))
    summary.update(bed=spec.bed, seeds=list(spec.seeds), r=list(spec.r), reread=spec.reread)
    if len(spec.r) > 1:  # each r alone: a level held pooled may hide one r above it
        summary["by_r"] = {}
        for r in spec.r:
            part = summarize([res for (rr, _), res in results.items() if rr == r])
            for stats in part["statistics"].values():
                del stats["null_p"]
            summary["by_r"][str(r)] = part
    write_calibration(summary, out)
    return summary


def clopper_pearson(k: int, n: int) -> tuple[float, float]:
    """Exact binomial 95% interval of ``k`` successes in ``n``."""
    lo = float(beta.ppf(0.025, k, n - k + 1)) if k > 0 else 0.0
    hi = float(beta.ppf(0.975, k + 1, n - k)) if k < n else 1.0
    return lo, hi


def _pairs(results: dict, view: dict) -> list[tuple[int, str, dict, bool]]:
    """Every (client, owner) reading of a run's view: ``(client, owner, row, own)``, ``own``
    whether the client trained on that owner's documents. A report of one statistic has no
    per-owner components: its client rows are the pairs."""
    by_statistic = view.get("by_statistic") or {
        view["clients"][0]["statistic"]: {str(c["id"]): c for c in view["clients"]}
    }
    owner_of = results.get("federation", {}).get("watermarked", {})
    truth = {c["id"]: c["watermarked"] for c in results["clients"]}
    out = []
    for owner, per in by_statistic.items():
        for cid, row in per.items():
            # A watermarked client of a run that does not say whose documents it trained on
            # (the synthetic bed: one watermark) is its owner's under every key.
            own = bool(truth[int(cid)]) and owner_of.get(cid, owner) == owner
            out.append((int(cid), owner, row, own))
    return out


def _null_pvalues(results: dict, view: dict, calibrated: bool) -> list[float]:
    """The p-values of the null pairs: every (client, owner) where the client did not train on
    that owner's documents (clean clients, and watermarked clients under another owner's key)."""
    return [
        row["p"] if calibrated else float(norm.sf(row["Z"]))
        for _, _, row, own in _pairs(results, view)
        if not own
    ]


def wrong_pairs(results: dict, view: dict) -> list[tuple[int, str]]:
    """The (client, owner) pairs a run's view names although the client did not train on that
    owner's documents: a clean client named, or a watermarked client named for another owner.
    A run with any of them made a false accusation; the family-wise level bounds how often."""
    return [(c, o) for c, o, row, own in _pairs(results, view) if row["flagged"] and not own]


def _rates(results: dict, view: dict) -> tuple[int, int, int, int]:
    """(watermarked clients named for their own owner, watermarked clients, clean clients
    named, clean clients)."""
    rows = {c["id"]: c for c in view["clients"]}
    own_named = {c for c, _, row, own in _pairs(results, view) if own and row["flagged"]}
    wm = [c for c in rows if rows[c]["watermarked"]]
    clean = [c for c in rows if not rows[c]["watermarked"]]
    return (
        sum(c in own_named for c in wm),
        len(wm),
        sum(bool(rows[c]["flagged"]) for c in clean),
        len(clean),
    )


def level_point(runs: int, alpha: float = 0.01) -> int:
    """The binomial 95% point of the runs naming a wrong pair at family-wise ``alpha``: a count
    above it is evidence (at 5%) that the level does not hold."""
    return int(binom.ppf(0.95, runs, alpha))


def _views(runs: list[dict]) -> list[str]:
    """The readings every run carries: ``calibrated`` (the run's own), then each variant
    (the paper statistic, the ceiling on true updates, any other) in the first run's order."""
    names = ["calibrated"]
    if runs:
        names += [
            v for v in runs[0].get("variants", {}) if all(v in r.get("variants", {}) for r in runs)
        ]
    return names


def _view(res: dict, name: str) -> dict:
    return res if name == "calibrated" else res["variants"][name]


def summarize(runs: list[dict]) -> dict:
    """Null p-values and family-wise flag counts of every reading over ``runs``: the run's own
    (``calibrated``), the paper statistic and, where the runs carry them, the ceiling (the same
    statistic on true updates) and other variants."""
    stats: dict[str, dict] = {}
    for name in _views(runs):
        pvals: list[float] = []
        counts = np.zeros(4, dtype=int)
        calibrated = all(_view(res, name).get("statistic") != "paper" for res in runs)
        for res in runs:
            view = _view(res, name)
            pvals += _null_pvalues(res, view, calibrated)
            counts += np.array(_rates(res, view))
        p = np.array(pvals)
        levels = {}
        for a in LEVELS:
            k, n = int(np.sum(p < a)), max(1, len(p))
            lo, hi = clopper_pearson(k, n)
            band = (float(binom.ppf(0.025, n, a)) / n, float(binom.ppf(0.975, n, a)) / n)
            levels[str(a)] = {
                "fpr": k / n,
                "ci95": [lo, hi],
                "expected_band": list(band),
                "inside": band[0] <= k / n <= band[1],
            }
        tp, n_wm, fp, n_clean = (int(x) for x in counts)
        # Family-wise: the runs in which the statistic's own rule names any (client, owner)
        # pair where the client did not train on that owner's documents.
        wrong = clean = 0
        for res in runs:
            view = _view(res, name)
            pairs = wrong_pairs(res, view)
            wrong += bool(pairs)
            truth = {c["id"]: c["watermarked"] for c in res["clients"]}
            clean += any(not truth[c] for c, _ in pairs)
        alpha = float(runs[0].get("alpha", 0.01)) if runs else 0.01
        stats[name] = {
            "runs_naming_wrong": wrong,
            "runs_naming_wrong_ci95": list(clopper_pearson(wrong, max(1, len(runs)))),
            "level_point": level_point(len(runs), alpha),
            "within_level": wrong <= level_point(len(runs), alpha),
            "runs_naming_clean": clean,
            "runs_naming_clean_ci95": list(clopper_pearson(clean, max(1, len(runs)))),
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
    rows = _rows(summary)
    head = [
        "statistic",
        "null pairs",
        *[f"FPR at α={a} [95% CI]" for a in LEVELS],
        "named: watermarked (own owner)",
        "named: clean",
        "runs naming a wrong pair [95% CI]",
        "of them naming a clean client",
    ]
    by_r = "".join(
        f"\n\n**r = {r}** ({part['runs']} runs)\n\n" + table(head, _rows(part))
        for r, part in summary.get("by_r", {}).items()
    )
    reread = (
        " Calibrated verdicts read again from each run's saved change matrices with this "
        "fedattr's tails (`--reread`)."
        if summary.get("reread")
        else ""
    )
    text = (
        f"Bed `{summary['bed']}`, r ∈ {summary['r']}, {len(summary['seeds'])} seeds, "
        f"{summary['runs']} runs.{reread} FPR: share of null (client, key) pairs with p < α "
        "(✓: inside the binomial 95% interval around α). Named: clients flagged by the "
        "statistic's own rule (calibrated: family-wise α over clients × owners; paper: Z > γ), "
        "a watermarked client counted only when named for its own owner. A wrong pair: a "
        "(client, owner) named although the client did not train on that owner's documents (a "
        "clean client, or a watermarked client named for another owner); the runs naming any "
        "is the family-wise error the rule is meant to hold at α (✓: not above the binomial "
        "95% point of α over the runs).\n\n" + table(head, rows) + by_r + "\n\n![QQ plot](qq.png)\n"
    )
    (out / "calibration.md").write_text(text)
    _qq_plot(summary, out / "qq.png")


def _rows(summary: dict) -> list[list]:
    """One table row per statistic of ``summarize``'s output."""
    rows = []
    for name, s in summary["statistics"].items():
        cells = []
        for a in LEVELS:
            lv = s["levels"][str(a)]
            mark = "✓" if lv["inside"] else "✗"
            cells.append(
                f"{100 * lv['fpr']:.2f}% [{100 * lv['ci95'][0]:.2f}, "
                f"{100 * lv['ci95'][1]:.2f}] {mark}"
            )
        tpr = "–" if s["tpr"] is None else f"{100 * s['tpr']:.1f}% of {s['watermarked']}"
        fpr = "–" if s["fpr_clients"] is None else f"{100 * s['fpr_clients']:.2f}% of {s['clean']}"
        lo, hi = s["runs_naming_wrong_ci95"]
        mark = "✓" if s["within_level"] else "✗"
        fw = (
            f"{s['runs_naming_wrong']} of {summary['runs']} "
            f"({100 * s['runs_naming_wrong'] / max(1, summary['runs']):.2f}% "
            f"[{100 * lo:.2f}, {100 * hi:.2f}]) {mark}"
        )
        rows.append([name, s["null_pairs"], *cells, tpr, fpr, fw, s["runs_naming_clean"]])
    return rows


def _qq_plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 5))
    colours = {"calibrated": "tab:green", "paper": "tab:red", "ceiling": "tab:blue"}
    others = iter(["tab:orange", "tab:purple", "tab:brown", "tab:olive", "tab:cyan"])
    n_max = 1
    for name, s in summary["statistics"].items():
        p = np.clip(np.array(s["null_p"]), 1e-12, 1.0)
        n = len(p)
        if not n:
            continue
        n_max = max(n_max, n)
        expected = (np.arange(1, n + 1) - 0.5) / n
        colour = colours.get(name) or next(others, "tab:gray")
        ax.loglog(expected, p, ".", ms=3, color=colour, label=f"{name} ({n} null pairs)")
    grid = (np.arange(1, n_max + 1) - 0.5) / n_max
    k = np.arange(1, n_max + 1)
    ax.fill_between(
        grid,
        beta.ppf(0.025, k, n_max - k + 1),
        beta.ppf(0.975, k, n_max - k + 1),
        color="0.85",
        label="95% band (uniform)",
    )
    ax.loglog([grid[0], 1], [grid[0], 1], "k--", lw=0.8)
    ax.set(
        xlabel="expected p (uniform)",
        ylabel="observed null p",
        title="null p-values against uniform",
    )
    # Lower right: below the diagonal only an anti-conservative reading would put points there.
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


TAIL_LEVELS = (1e-3, 1e-4, 1e-5, 1e-6)


def tail_check(
    run_dirs: Sequence[str | Path],
    draws: int = 4000,
    seed: int = 0,
    levels: Sequence[float] = TAIL_LEVELS,
    device: str | None = None,
    progress: Callable[[str], None] | None = None,
    pairs: Sequence[tuple[int, str]] = (),
) -> list[dict]:
    """For every green-list change matrix saved by the runs (``changes.safetensors``) and every
    level ``p``: the value ``t`` the saddlepoint puts at ``p``, tilted Monte Carlo's estimate
    of ``P(<W, G> >= t)`` over random keys (``draws`` of them, each cell green with
    probability gamma), and the Chernoff bound at ``t``. ``device``: where torch draws the
    keys (``cuda`` for vocabulary-sized changes); ``None``: numpy on the CPU. ``progress``
    hears one line per change checked (a vocabulary-sized one takes minutes on a CPU).
    ``pairs``: only these (client, statistic) changes, e.g. ``(46, "kgw:owner0")`` for a named
    pair (a run of fifty clients and five owners saves 250); each must be in some run."""
    import itertools
    import json

    import torch
    from safetensors import safe_open
    from scipy.optimize import brentq

    from ..watermarks.tail.cgf import BernoulliCells
    from ..watermarks.tail.laws import RowSubsets, law_from_dict
    from ..watermarks.tail.methods import (
        RowPatternsBound,
        chernoff_log10_sf,
        effective_cells,
        saddlepoint_log10_sf,
        tilted_monte_carlo,
    )

    jobs = []
    for run in map(Path, run_dirs):
        file = _saved_changes(run)
        laws = json.loads((run / "results.json").read_text()).get("key_laws", {})
        # Only the changes checked are read: a fifty-client run saves 250 (190 MB).
        with safe_open(str(file), framework="pt") as saved:
            for name in sorted(saved.keys()):
                client, part = name.split("/", 1)
                if pairs and (int(client), part) not in pairs:
                    continue
                law = law_from_dict(laws[part])
                if isinstance(law, RowSubsets) and law.m > 1:  # exact tails (FK, directions): none
                    jobs.append((run.name, int(client), part, law, saved.get_tensor(name)))
    missing = [f"{c}:{s}" for c, s in pairs if not any(j[1:3] == (c, s) for j in jobs)]
    if missing:
        raise UserError(
            f"--pair: {', '.join(missing)} is not a saved change with a green-list tail in "
            f"{', '.join(Path(r).name for r in run_dirs)}; give CLIENT:STATISTIC as results.json "
            "names it (e.g. 46:kgw:owner0)"
        )

    start, finished = time.perf_counter(), itertools.count(1)

    def check(job: tuple) -> list[dict]:
        out = _check(job)
        if progress is not None:
            name, client, part = job[:3]
            progress(
                f"tail-check: {name} client {client} ({part}, {job[4].numel():,} cells) done, "
                f"{next(finished)}/{len(jobs)} after {time.perf_counter() - start:.0f} s"
            )
        return out

    def _check(job: tuple) -> list[dict]:
        name, client, part, law, W = job
        w = law.centre(W).numpy()
        scale = math.sqrt(law.cols / (law.cols - 1))
        cgf = BernoulliCells(scale * w.reshape(-1), law.gamma)
        sd = math.sqrt(law.variance(torch.from_numpy(w)))
        cells = effective_cells(w)
        bound = RowPatternsBound(w, law.m)  # the bounds the verdict reads below 30 cells
        # The largest value a key can reach is the sum of the positive cells: the search for
        # t stays inside it (beyond, the saddlepoint has no solution and each step is slow).
        top = min(60.0, 0.99 * scale * float(np.maximum(w, 0.0).sum()) / sd)
        out = []
        for level in levels:
            target = math.log10(level)

            def gap(x: float, cgf=cgf, sd=sd, target=target) -> float:
                return saddlepoint_log10_sf(cgf, x * sd) - target

            if gap(top) > 0:
                continue  # the level lies beyond what any key reaches on this change
            t = brentq(gap, 0.1, top) * sd
            mc, rel = tilted_monte_carlo(scale * w, law.gamma, t, draws, seed, cgf, device)
            out.append(
                {
                    "run": name,
                    "client": client,
                    "part": part,
                    "effective_cells": cells,
                    "level": level,
                    "z": t / sd,
                    "saddlepoint": level,
                    "monte_carlo": mc,
                    "mc_rel_se": rel,
                    "ratio": mc / level,
                    "chernoff": 10 ** chernoff_log10_sf(bound.chernoff, t),
                    "bound": bound.tail(t).p,
                }
            )
        return out

    # One change per thread: the work is numpy (and torch) over W, which releases the GIL, and
    # a vocabulary-sized change takes tens of seconds.
    workers = max(1, min(len(jobs), torch.get_num_threads()))
    with ThreadPoolExecutor(workers) as pool:
        rows = [row for found in pool.map(check, jobs) for row in found]
    return rows


def write_tail_check(rows: list[dict], out: Path) -> None:
    """``tail-check.json`` and ``tail-check.md``."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    (out / "tail-check.json").write_text(json.dumps(rows, indent=2))
    table_rows = [
        [
            r["run"],
            r["client"],
            f"{r['effective_cells']:.0f}",
            f"{r['level']:.0e}",
            f"{r['z']:.2f}",
            f"{r['monte_carlo']:.3g} ± {100 * r['mc_rel_se']:.0f}%",
            f"{r['ratio']:.2f}",
            f"{r['chernoff']:.3g}",
            f"{r['bound']:.3g}",
        ]
        for r in rows
    ]
    big = [r for r in rows if r["effective_cells"] >= MIN_EFFECTIVE_CELLS]
    within = sum(0.75 <= r["ratio"] <= 1.25 for r in big)
    above = sum(r["chernoff"] >= r["monte_carlo"] for r in rows)
    bound_above = sum(r["bound"] >= r["monte_carlo"] for r in rows)
    text = (
        "Saddlepoint tail against tilted Monte Carlo over random keys, on each client's summed "
        f"change. Where the change is spread over at least {MIN_EFFECTIVE_CELLS:.0f} effective "
        f"cells (where the verdict reads the saddlepoint): {within} of "
        f"{len(big)} within ±25%. Chernoff bound at or above Monte Carlo: {above} of "
        f"{len(rows)}; the verdict's bound (the smaller of Chernoff's and the patterns' bound): "
        f"{bound_above} of {len(rows)}.\n\n"
        + table(
            [
                "run",
                "client",
                "effective cells",
                "saddlepoint p",
                "z",
                "Monte Carlo p",
                "MC / saddlepoint",
                "Chernoff bound",
                "verdict's bound",
            ],
            table_rows,
        )
        + "\n"
    )
    (out / "tail-check.md").write_text(text)
