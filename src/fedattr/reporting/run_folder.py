"""The files of a run folder, written the same way by every experiment."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from ..attribution.stouffer import AttributionReport
from .plots import plot_attribution


def write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    """One JSON object per line."""
    with open(path, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")


def write_run_folder(
    out_dir: str | Path,
    *,
    config: dict,
    rounds: list[dict],
    queries: list[dict],
    results: dict,
    report: AttributionReport,
    report_md: str,
) -> Path:
    """``config.json``, ``rounds.jsonl``, ``queries.jsonl`` (coefficients, never results),
    ``results.json``, ``report.md`` (``report_md`` then a link to the plot), ``attribution.png``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_jsonl(out / "rounds.jsonl", rounds)
    write_jsonl(out / "queries.jsonl", queries)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "report.md").write_text(report_md + "\n\n![attribution](attribution.png)\n")
    plot_attribution(report, out / "attribution.png")
    return out
