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

from ..errors import UserError
from ..watermarks.tail import law_from_dict
from .calibrated import CalibratedNull
from .export import design_from_dict
from .stouffer import AttributionReport


def _scores(folder: Path, round_id: int) -> dict[str, dict]:
    from ..owner.score import SCORES_FORMAT, read_json

    files = sorted(folder.glob("scores-*.json"))
    if not files:
        raise UserError(f"round folder {str(folder)!r} holds no scores-*.json: the owners "
                        "score it first (fedattr owner score --key KEY ROUND_DIR)")  # fmt: skip
    out = {}
    for f in files:
        data = read_json(f)
        if data.get("format") != SCORES_FORMAT:
            raise UserError(f"{str(f)!r} was written by an earlier fedattr (format "
                            f"{data.get('format')!r}); score the round again")  # fmt: skip
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
    att = cfg.attribution
    null = CalibratedNull(att.alpha, att.decorrelate, att.null_keys, att.seed,
                          att.name_uncalibrated, att.token_centring)  # fmt: skip
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
        null.decorrelated[t] = null.decorrelates(
            manifest["participants"], manifest["targets"],
            [design_from_dict(d) for d in manifest["designs"]],
        )  # fmt: skip
        for owner, s in scores.items():
            if s.get("decorrelated") != null.decorrelated[t]:
                raise UserError(
                    f"round folder {str(folder)!r}: {owner} scored it with cross-talk "
                    f"{'undone' if s.get('decorrelated') else 'kept'}, the run's attribution "
                    "settings say otherwise; score the round again"
                )
            law = law_from_dict(s["law"])
            changes = _changes(folder, s)
            for x in manifest["targets"]:
                if str(x) not in s["targets"] or str(x) not in changes:
                    raise UserError(f"round folder {str(folder)!r}: the scores of {owner} miss "
                                    f"target {x}; score the round again")  # fmt: skip
                # Each owner reads its own texts: its changes are its own part.
                null.add(t, int(x), {owner: changes[str(x)]}, {owner: s["targets"][str(x)]},
                         {owner: law}, {owner: owner},
                         decorrelated=null.decorrelated[t])  # fmt: skip
    truth = _truth(run)
    report = null.report(truth)
    _write(run, report, owners or [])
    return report


def _changes(folder: Path, scores: dict) -> dict:
    """The standardised changes an owner's scores file goes with."""
    from safetensors.torch import load_file

    path = folder / f"changes-{scores['fingerprint']}.safetensors"
    if not path.is_file():
        raise UserError(f"round folder {str(folder)!r}: {path.name} is missing (it is written "
                        "with the owner's scores); score the round again")  # fmt: skip
    return load_file(str(path))


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
