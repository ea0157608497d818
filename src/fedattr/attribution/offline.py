"""``fedattr attribute RUN_DIR``: the owners' scores of a run's released rounds, combined.

Every round folder of the run (:mod:`fedattr.attribution.export`) must hold its manifest and
at least one owner's ``scores-*.json`` (:mod:`fedattr.owner.score`); every round must have been
scored by the same owners. The scores go through the calibrated statistic exactly as a run that
scores on its own server (:class:`~fedattr.attribution.calibrated.CalibratedNull`), so the
verdicts are the same; the run folder's ``results.json`` and ``report.md`` are rewritten with
them (``attribution.json`` keeps the combined report alone).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import UserError
from .calibrated import CalibratedNull
from .export import design_from_dict
from .stouffer import AttributionReport


def _scores(folder: Path, round_id: int) -> dict[str, dict]:
    from ..owner.score import read_json

    files = sorted(folder.glob("scores-*.json"))
    if not files:
        raise UserError(f"round folder {str(folder)!r} holds no scores-*.json: the owners "
                        "score it first (fedattr owner score --key KEY ROUND_DIR)")  # fmt: skip
    out = {}
    for f in files:
        data = read_json(f)
        if data.get("round") != round_id:
            raise UserError(f"{str(f)!r} scores round {data.get('round')}, not {round_id}")
        out[data["owner"]] = data
    return out


def attribute_run(run_dir: str | Path) -> AttributionReport:
    """Combine the owners' scores of every round of ``run_dir``; write the results."""
    from ..owner.score import read_manifest, run_config_of

    run = Path(run_dir)
    folders = sorted((run / "rounds").glob("round-*"))
    if not folders:
        raise UserError(f"RUN_DIR: {str(run)!r} holds no rounds/round-* folders (a run with "
                        "attribution.scoring=owner exports them)")  # fmt: skip
    cfg = run_config_of(folders[0])
    null = CalibratedNull(
        cfg.attribution.alpha, cfg.attribution.decorrelate,
        remedy="score that owner's rounds again (fedattr owner score) on the kind of machine "
        "that scored the others",
    )  # fmt: skip
    owners: list[str] | None = None
    for folder in folders:
        manifest = read_manifest(folder)
        t = int(manifest["round"])
        scores = _scores(folder, t)
        if owners is None:
            owners = sorted(scores)
        elif sorted(scores) != owners:
            raise UserError(
                f"round folder {str(folder)!r} is scored by {sorted(scores)}, the first round "
                f"by {owners}: every round needs the same owners"
            )
        targets = [int(x) for x in manifest["targets"]]
        stats = [
            {o: (s["targets"][str(x)][0], np.asarray(s["targets"][str(x)][1]))
             for o, s in scores.items()}
            for x in targets
        ]  # fmt: skip
        designs = [design_from_dict(d) for d in manifest["designs"]]
        center = None
        if not null.decorrelates(manifest["participants"], targets, designs):
            missing = sorted(o for o, s in scores.items() if s.get("center") is None)
            if missing:
                raise UserError(
                    f"round folder {str(folder)!r}: the scores of {missing} hold no SA-mean "
                    "statistics, which this round needs (its cross-talk is not undone with "
                    "this run's attribution settings); score the round again"
                )
            center = {o: (s["center"][0], np.asarray(s["center"][1])) for o, s in scores.items()}
        keys = {o: s.get("null_keys") for o, s in scores.items()}
        null.add_round(t, manifest["participants"], targets, designs, stats, center, keys)
    truth = _truth(run)
    report = null.report(truth)
    _write(run, report, owners or [])
    return report


def _truth(run: Path) -> dict[int, bool] | None:
    """The simulation's ground truth, when the run folder's results hold it."""
    path = run / "results.json"
    if not path.is_file():
        return None
    fed = json.loads(path.read_text()).get("federation", {})
    if "watermarked" not in fed or "client_sizes" not in fed:
        return None
    marked = {int(c) for c in fed["watermarked"]}
    return {c: c in marked for c in range(len(fed["client_sizes"]))}


def _write(run: Path, report: AttributionReport, owners: list[str]) -> None:
    from ..reporting.markdown import attribution_table

    data = report.to_dict()
    data["owners"] = owners
    (run / "attribution.json").write_text(json.dumps(data, indent=2))
    results = run / "results.json"
    if results.is_file():
        merged = {**json.loads(results.read_text()), **data, "scoring": "owner"}
        results.write_text(json.dumps(merged, indent=2))
    md = run / "report.md"
    head = md.read_text().split("\n\n")[0] if md.is_file() else "# FedAttr run"
    md.write_text("\n\n".join([
        head, f"Scored by the owners ({', '.join(owners)}), combined by fedattr attribute.",
        attribution_table(report),
    ]) + "\n")  # fmt: skip
