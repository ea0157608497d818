#!/usr/bin/env bash
# A SmolLM2 calibration on one GPU that grows with every session: (r = 3, r = 0) pairs of runs,
# one seed after another (the pair side by side on the GPU), until a time budget; every run's
# record is kept, so the same command on the next GPU session keeps what is done, continues a
# run the budget cut and goes on with the seeds not yet run.
#
#   bash scripts/gpu-calibration.sh OUT SEEDS [--set key=value ...]
#
# SEEDS: "1-40", "1,2,5" or both ("1-10,20"). Seed S writes OUT/r3-seedS and OUT/r0-seedS (run
# folders: config.json, results.json, report.md, ...; their logs beside them), each with
# fl.seed, data.seed, watermark.key_seed and attribution.seed = S (as `fedattr experiment
# calibration` seeds a run: every run its own owner keys).
#
# FEDATTR_BUDGET (seconds, default 540: 9 minutes): the command returns before it. A pair starts
# only while the time left is at least the longest pair recorded in OUT/pairs.jsonl
# (FEDATTR_PAIR_S, default 150, before any); each run is cut at the time left, less
# FEDATTR_MARGIN (default 20) for the summary, and a cut run keeps its checkpoint for the next
# session. Then OUT/calibration.md and OUT/calibration.json: every finished pair so far (who
# was named at r = 3 and at r = 0, seconds), the share of watermarked clients named and of runs
# naming a wrong pair (a clean client, or a watermarked one for another owner), with exact 95%
# intervals.
#
# Settings: FEDATTR_PRESET (default smollm2-cpu: SmolLM2-135M, 500 records, 64-token sequences;
# smollm2: the paper's sizes, with the Alpaca subset at FEDATTR_DATA) with watermark.ratio=0.2,
# two-server SA on the CPU and attribution.calibrated.null_keys=0, as scripts/gpu-smollm2.sh. Needs what
# that script needs; FEDATTR_PRESET=tiny runs the same on the embedded default (the CPU test).
set -euo pipefail
usage="usage: bash scripts/gpu-calibration.sh OUT SEEDS [--set key=value ...]"
out=${1:?$usage}
spec=${2:?$usage}
shift 2
preset=${FEDATTR_PRESET:-smollm2-cpu}
budget=${FEDATTR_BUDGET:-540}
margin=${FEDATTR_MARGIN:-20}
python=${PYTHON:-python3}
start=$(date +%s)
deadline=$((start + budget - margin))

seeds=()
IFS=',' read -ra parts <<<"$spec"
for part in "${parts[@]}"; do
    if [[ $part =~ ^([0-9]+)-([0-9]+)$ ]]; then
        for ((s = BASH_REMATCH[1]; s <= BASH_REMATCH[2]; s++)); do seeds+=("$s"); done
    elif [[ $part =~ ^[0-9]+$ ]]; then
        seeds+=("$part")
    else
        echo "SEEDS: seeds as 1-40 or 1,2,5; got '$spec'" >&2
        exit 2
    fi
done

. "$(dirname "$0")/gpu-settings.sh"
mkdir -p "$out"

# The longest pair recorded so far (seconds), else FEDATTR_PAIR_S.
longest() {
    "$python" - "$out/pairs.jsonl" "${FEDATTR_PAIR_S:-150}" <<'PY'
import json
import sys
from pathlib import Path

log = Path(sys.argv[1])
seconds = [json.loads(line)["seconds"] for line in log.read_text().splitlines() if line.strip()] if log.is_file() else []
print(max([round(s) for s in seconds] or [int(sys.argv[2])]))
PY
}

status=0
for seed in "${seeds[@]}"; do
    todo=()
    for r in 3 0; do
        [ -f "$out/r$r-seed$seed/results.json" ] || todo+=("$r")
    done
    [ ${#todo[@]} -eq 0 ] && continue # finished in an earlier session: kept
    now=$(date +%s)
    left=$((deadline - now))
    need=$(longest)
    if [ "$left" -lt "$need" ]; then
        echo "budget: ${left} s left, a pair takes up to ${need} s: stopping before seed $seed"
        break
    fi
    echo "seed $seed: r = ${todo[*]} (${left} s left)"
    fresh=1
    for r in "${todo[@]}"; do
        [ -e "$out/r$r-seed$seed" ] && fresh=0 # a cut run, continued: not a whole pair's time
    done
    pids=()
    for r in "${todo[@]}"; do
        # The pair's r and seeds last: they win over the same keys given in --set.
        run=(--set "watermark.r=$r" --set "fl.seed=$seed" --set "data.seed=$seed"
            --set "watermark.key_seed=$seed" --set "attribution.seed=$seed")
        timeout "$left" "$python" -m fedattr run --preset "$preset" --continue \
            --out "$out/r$r-seed$seed" "${sets[@]}" "$@" "${run[@]}" \
            >>"$out/r$r-seed$seed.log" 2>&1 &
        pids+=($!)
    done
    cut=0
    for pid in "${pids[@]}"; do
        code=0
        wait "$pid" || code=$?
        if [ "$code" -eq 124 ]; then
            cut=1 # the budget: its checkpoint is kept for the next session
        elif [ "$code" -ne 0 ]; then
            status=$code
        fi
    done
    took=$(($(date +%s) - now))
    if [ "$status" -ne 0 ]; then
        echo "seed $seed: a run failed (see $out/r*-seed$seed.log)" >&2
        break
    fi
    if [ "$cut" -eq 1 ]; then
        echo "seed $seed: cut by the budget after ${took} s; the same command continues it"
        break
    fi
    if [ "$fresh" -eq 1 ] && [ ${#todo[@]} -eq 2 ]; then
        echo "{\"seed\": $seed, \"seconds\": $took}" >>"$out/pairs.jsonl"
    fi
    echo "seed $seed: finished in ${took} s"
done

"$python" - "$out" "$preset" <<'PY'
import json
import sys
from pathlib import Path

from fedattr.experiments.calibration import clopper_pearson, wrong_pairs

out, preset = Path(sys.argv[1]), sys.argv[2]
rows, pairs = [], []
seeds = sorted(
    {int(p.name.split("seed")[1]) for p in out.glob("r3-seed*") if p.is_dir()}
    | {int(p.name.split("seed")[1]) for p in out.glob("r0-seed*") if p.is_dir()}
)
for seed in seeds:
    runs = {r: out / f"r{r}-seed{seed}" / "results.json" for r in (3, 0)}
    if not all(f.is_file() for f in runs.values()):
        continue
    pair = {"seed": seed}
    for r, f in runs.items():
        d = json.loads(f.read_text())
        marked = sorted(c["id"] for c in d["clients"] if c["watermarked"])
        named = sorted(c["id"] for c in d["clients"] if c["flagged"])
        # Every (client, owner) pair named where the client did not train on that owner's
        # documents (a clean client, or a watermarked one named for another owner), by the
        # rule `fedattr experiment calibration` counts with, owner by owner as results.json
        # lists them; it reads records from before results.json listed them too.
        wrong = [[c, o] for c, o in sorted(wrong_pairs(d, d), key=lambda p: (p[1], p[0]))]
        pair[f"r{r}"] = {
            "watermarked": marked,
            "named": named,
            "wrong_pairs": wrong,
            "seconds": d["timing"]["total_s"],
            "train_s": d["timing"]["train_s"],
        }
    pairs.append(pair)
marked = sum(len(p["r3"]["watermarked"]) for p in pairs)
hits = sum(len(set(p["r3"]["named"]) & set(p["r3"]["watermarked"])) for p in pairs)
runs = 2 * len(pairs)
wrong = sum(bool(p[f"r{r}"]["wrong_pairs"]) for p in pairs for r in (3, 0))
summary = {
    "preset": preset,
    "pairs": len(pairs),
    "watermarked_named": [hits, marked, clopper_pearson(hits, marked) if marked else None],
    "runs_naming_a_wrong_pair": [wrong, runs, clopper_pearson(wrong, runs) if runs else None],
    "by_seed": pairs,
}
(out / "calibration.json").write_text(json.dumps(summary, indent=2))
fmt = lambda k, n: f"{k}/{n}" + (  # noqa: E731
    " ({:.0%}; 95% interval {:.0%}-{:.0%})".format(k / n, *clopper_pearson(k, n)) if n else ""
)
lines = [
    f"# SmolLM2 calibration ({preset}): {len(pairs)} finished (r = 3, r = 0) pairs",
    "",
    f"- watermarked clients named at r = 3: {fmt(hits, marked)}",
    f"- runs naming a wrong pair (r = 3 and r = 0): {fmt(wrong, runs)}",
    "",
    "| seed | watermarked (r = 3) | named (r = 3) | named (r = 0) | seconds (r = 3, r = 0) |",
    "|---|---|---|---|---|",
]
for p in pairs:
    a, b = p["r3"], p["r0"]
    lines.append(
        f"| {p['seed']} | {a['watermarked']} | {a['named']} | {b['named']} "
        f"| {a['seconds']:.0f}, {b['seconds']:.0f} |"
    )
(out / "calibration.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines[:4]))
PY
exit "$status"
