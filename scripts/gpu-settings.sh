# Sourced by scripts/gpu-smollm2.sh and scripts/gpu-calibration.sh: what a pair of SmolLM2 runs
# side by side on one GPU shares. Needs $preset; sets FEDATTR_THREADS and
# PYTORCH_CUDA_ALLOC_CONF (unless given) and the array `sets` of --set arguments: 20% of a
# watermarked client's records the owner's documents, two-server SA on the CPU, no rank check
# (attribution.calibrated.null_keys=0: a check of the exact tail, not part of the verdict), and
# for the smollm2 preset the Alpaca subset at FEDATTR_DATA (default
# ../shared/data/alpaca_5000.json), 100 records a client, 128-token documents.

# The two runs share the machine: half its cores each, unless FEDATTR_THREADS says otherwise.
cores=$(nproc)
export FEDATTR_THREADS=${FEDATTR_THREADS:-$((cores > 1 ? cores / 2 : 1))}
# Two runs on one GPU: cached blocks handed back between stages are reusable by the other run.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
sets=(
    --set watermark.ratio=0.2
    --set secagg.backend=two-server
    --set secagg.device=cpu
    --set attribution.calibrated.null_keys=0
)
if [ "$preset" = smollm2 ]; then
    data=${FEDATTR_DATA:-../shared/data/alpaca_5000.json}
    if [ ! -f "$data" ]; then
        echo "FEDATTR_DATA: no such file: $data (the Alpaca subset, alpaca_5000.json)" >&2
        exit 2
    fi
    sets+=(--set "data.path=$data" --set data.records=1000 --set watermark.teacher.max_new_tokens=128)
fi
