"""``fedattr attribute RUN_DIR``: the owners' scores of a run's released rounds, combined.

Every round folder of the run (:mod:`fedattr.attribution.round_folder`) must hold its
manifest and at least one owner's ``scores-*.json`` (written by :mod:`fedattr.owner.score`);
every round must have been scored by the same owners. The scores go through the calibrated
statistic exactly as a run that scores on its own server
(:class:`~fedattr.attribution.calibrated.sums.CalibratedNull`), so the verdicts are the same.
Writing them into the run folder is
:meth:`fedattr.reporting.run_folder.RunFolder.write_owner_scored`'s.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..config import from_dict
from ..errors import UserError
from ..watermarks.tail.laws import law_from_dict
from .calibrated.sums import CalibratedNull
from .config import AttributionConfig
from .round_folder import (
    design_from_dict,
    read_changes,
    read_manifest,
    read_run,
    read_scores,
    round_folders,
)
from .stouffer import AttributionReport


def attribute_run(run_dir: str | Path) -> tuple[AttributionReport, list[str]]:
    """Combine the owners' scores of every round of ``run_dir``: the report and the owners."""
    run = Path(run_dir)
    folders = round_folders(run)
    if not folders:
        raise UserError(
            f"RUN_DIR: {str(run)!r} holds no rounds/round-* folders (a run with "
            "attribution.scoring=owner exports them)"
        )
    att = from_dict(AttributionConfig, read_run(folders[0]).get("attribution", {}), quiet=True)
    null = CalibratedNull.of(att)
    owners: list[str] | None = None
    for folder in folders:
        manifest = read_manifest(folder)
        t = int(manifest["round"])
        scores = read_scores(folder, t)
        if owners is None:
            owners = sorted(scores)
        elif sorted(scores) != owners:
            raise UserError(
                f"round folder {str(folder)!r} is scored by {sorted(scores)}, the first round "
                f"by {owners}: every round needs the same owners"
            )
        null.decorrelated[t] = null.plan(
            t,
            manifest["participants"],
            manifest["targets"],
            [design_from_dict(d) for d in manifest["designs"]],
        ).undone
        if att.calibrated.late_rounds == "skip" and t > 1:
            continue  # round 1 only: the rounds whose reference no update has reached
        for owner, s in scores.items():
            if s.get("decorrelated") != null.decorrelated[t]:
                raise UserError(
                    f"round folder {str(folder)!r}: {owner} scored it with cross-talk "
                    f"{'undone' if s.get('decorrelated') else 'kept'}, the run's attribution "
                    "settings say otherwise; score the round again"
                )
            law = law_from_dict(s["law"])
            changes = read_changes(folder, s)
            for x in manifest["targets"]:
                if str(x) not in s["targets"] or str(x) not in changes:
                    raise UserError(
                        f"round folder {str(folder)!r}: the scores of {owner} miss "
                        f"target {x}; score the round again"
                    )
                # Each owner reads its own texts: its changes are its own part.
                null.add(
                    t,
                    int(x),
                    {owner: changes[str(x)]},
                    {owner: s["targets"][str(x)]},
                    {owner: law},
                    {owner: owner},
                    # Calibrated as the server's own reading (CalibratedNull.calibrated_in):
                    # round 1, or a later round read without the clients' centre, with round
                    # 1's cell weights.
                    valid=t <= 1
                    or (
                        att.calibrated.centre != "every" and att.calibrated.cell_weights == "first"
                    ),
                    decorrelated=null.decorrelated[t],
                )
    return null.report(_truth(run)), owners or []


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
