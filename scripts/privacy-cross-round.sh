#!/usr/bin/env bash
# What the SA answers reveal across rounds (docs/results/privacy-cross-round.md): the synthetic
# bed in paper and hardened mode, T = 5 and 10, the default bed and one with persistent
# per-client directions (synthetic.heterogeneity=1), over SEEDS; each run audited with
# `fedattr audit --json --cross-round`, then summarised.
# Usage: scripts/privacy-cross-round.sh OUT_DIR [SEEDS...]   (default seeds 0-9)
set -euo pipefail
out=${1:?usage: scripts/privacy-cross-round.sh OUT_DIR [SEEDS...]}
shift
seeds=("$@")
[ ${#seeds[@]} -gt 0 ] || seeds=(0 1 2 3 4 5 6 7 8 9)
py=${PYTHON:-python}
export FEDATTR_THREADS=${FEDATTR_THREADS:-1}
mkdir -p "$out"
for bed in default heterogeneous; do
  extra=()
  [ "$bed" = heterogeneous ] && extra=(--set synthetic.heterogeneity=1.0)
  for mode in paper hardened; do
    for T in 5 10; do
      for s in "${seeds[@]}"; do
        run="$out/$bed-$mode-T$T-s$s"
        [ -f "$run/results.json" ] || "$py" -m fedattr demo-protocol --quiet --out "$run" \
          --set attribution.protocol.mode="$mode" --set synthetic.rounds="$T" \
          --set synthetic.seed="$s" --set attribution.seed="$s" "${extra[@]}" >/dev/null
        "$py" -m fedattr audit "$run" --json --cross-round >"$run/audit.json"
      done
    done
  done
done
"$py" - "$out" <<'EOF'
import json, math, statistics, sys
from collections import defaultdict
from pathlib import Path

from fedattr.attribution.audit import read_query_log
from fedattr.attribution.crossround import audit_cross_round


def rounds_to_identify(run):
    """The first t at which rounds 1..t identify every client's mean update (None: never)."""
    log = read_query_log(run / "queries.jsonl")
    for t in range(1, max(q["round"] for q in log) + 1):
        (a,) = audit_cross_round([q for q in log if q["round"] <= t])
        if len(a.identifiable) == len(a.clients):
            return t
    return None


groups, first = defaultdict(list), defaultdict(list)
for f in sorted(Path(sys.argv[1]).glob("*/audit.json")):
    bed, mode, T, _ = f.parent.name.split("-")
    groups[(bed, mode, int(T[1:]))].append(json.loads(f.read_text()))
    first[(bed, mode, int(T[1:]))].append(rounds_to_identify(f.parent))
print("| bed | mode | T | runs | recoverable client-rounds / run | max L_j | identifiable "
      "across rounds | of them in no single round | median variance factor | median rel. "
      "error GLS | OLS | public mean | GLS beats public mean | rounds until all identifiable |")
print("|" + "---|" * 14)
for key, runs in sorted(groups.items()):
    bed, mode, T = key
    rec = [sum(len(r["recoverable"]) for r in a["rounds"]) for a in runs]
    leak = [v for a in runs for r in a["rounds"] for v in r["leakage"].values()]
    mx = max(math.inf if v == "inf" else v for v in leak)
    cr = [c for a in runs for c in a["cross_round"]]
    n = sum(len(c["clients"]) for c in cr)
    ident = sum(len(c["identifiable"]) for c in cr)
    only = sum(len(c["only_across_rounds"]) for c in cr)
    vf = [v for c in cr for v in c["variance_factor"].values() if v != "inf"]
    per = [m for c in cr for m in c["reconstruction"]["clients"].values()]
    med = lambda k: statistics.median(m[k] for m in per)
    beats = sum(m["error_gls"] < m["error_public_mean"] for m in per)
    print(f"| {bed} | {mode} | {T} | {len(runs)} | {statistics.mean(rec):.1f} | "
          f"{'∞' if math.isinf(mx) else f'{mx:.4f}'} | {ident}/{n} | {only}/{n} | "
          f"{statistics.median(vf):.3f} | {med('error_gls'):.3g} | {med('error_ols'):.3g} | "
          f"{med('error_public_mean'):.3g} | {beats}/{len(per)} | "
          f"{'never' if None in first[key] else f'{min(first[key])}-{max(first[key])}'} |")
EOF
