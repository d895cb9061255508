#!/usr/bin/env bash
# Does an SFT config train to the same losses in two processes on this GPU? Trains it for STEPS steps, logging
# every step, twice in the strict mode and twice in the math mode (trace/sft.py), all four at once on the
# visible GPU, then prints per mode the first step whose losses differ (None: bit for bit the same) and the
# determinism warnings of a strict run (ops without a deterministic variant). A base whose checkpoint is
# rebuilt on another machine (scripts/gpu/profile_chunk.sh) must train in a mode that prints None here.
#   PYTHONPATH=$PWD bash scripts/gpu/sft_determinism_probe.sh results/runs/small/mixtral-small/long_horizon/sft/config.yaml [STEPS]
# OUT (default /tmp/sft-determinism) holds the four run dirs and their logs; DEVICE (default cuda) for a dry try on
# the CPU, where both modes are PyTorch's own choices.
# On an H200 (mixtral-small long-horizon, 100 steps): strict None; math first at step 4, 90 of 100 differ.
set -euo pipefail
cfg=${1:?usage: sft_determinism_probe.sh CONFIG [STEPS]}; steps=${2:-100}
out=${OUT:-/tmp/sft-determinism}
py=${PYTHON:-python3}
rm -rf "$out" && mkdir -p "$out"
for mode in strict math; do
  for run in a b; do
    TRACE_SFT_DETERMINISM=$mode TQDM_DISABLE=1 $py -m trace.sft --config "$cfg" --out "$out/${mode}_$run" \
      --set sft.steps="$steps" --set sft.log_every=1 --set sft.eval_every=0 --set sft.ckpt_every=1000000 \
      --set device="${DEVICE:-cuda}" > "$out/${mode}_$run.log" 2>&1 &
  done
done
wait
$py - "$out" <<'PY'
import json, sys
out = sys.argv[1]
for mode in ("strict", "math"):
    a, b = ([json.loads(line)["loss"] for line in open(f"{out}/{mode}_{r}/metrics.jsonl")] for r in "ab")
    diff = [i + 1 for i, (x, y) in enumerate(zip(a, b)) if x != y]
    print(f"{mode}: {len(a)} and {len(b)} steps, first differing step {diff[0] if diff else None}, {len(diff)} differ")
PY
grep -h "deterministic" "$out/strict_a.log" | sort | uniq -c || echo "strict: no determinism warnings"
