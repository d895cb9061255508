#!/usr/bin/env bash
# One GPU unit for a profile's calibration family: its SFT base (seed 0), the base evaluated on the validation
# split (accuracy, response length), then the alignment coefficient's calibration (DESIGN.md §3 rule:
# trace/rl/calibrate.py). Everything lands in $OUT (run dirs packed as a tarball, the calibration JSON, logs).
#   bash scripts/gpu/calibrate_unit.sh PROFILE MODEL TASK [--set key=value ...]   # extra --set go to the SFT
# WHEELS (default .whl-pipe, scripts/gpu/offline_wheels.sh download .whl-pipe pipeline) are installed first:
# the configs need jsonschema. GPU_SUITE / SKIP_GPU_TESTS as in scripts/gpu/gpu_tests.sh (default: fast).
set -uo pipefail
profile=${1:?usage: calibrate_unit.sh PROFILE MODEL TASK}; model=${2:?}; task=${3:?}; shift 3
out=${OUT:-/tmp/out}; mkdir -p "$out"
. scripts/gpu/env.sh || exit 1
GPU_SUITE=${GPU_SUITE:-fast} bash scripts/gpu/gpu_tests.sh || { echo "GPU tests failed: nothing run"; exit 1; }
work=/tmp/unit/$profile; mkdir -p "$work"
python3 - "$profile" "$model" "$task" "$work" <<'PY'
import json, sys, yaml
from workflow.scripts.runplan import Plan
profile, model, task, work = sys.argv[1:]
plan = Plan(yaml.safe_load(open(f"experiments/profiles/{profile}.yaml")))
sft = json.loads(json.dumps(plan.sft_config(model, task, 0)))
rl = json.loads(json.dumps(plan.run_config(model, task, "trace", 0)))
rl["rl"]["init_ckpt"] = f"{work}/sft/ckpt"
rl["eval"]["split"] = "validation"
yaml.safe_dump(sft, open(f"{work}/sft.yaml", "w"))
yaml.safe_dump(rl, open(f"{work}/trace.yaml", "w"))
PY
t0=$(date +%s)
python3 -m trace.sft --config "$work/sft.yaml" --out "$work/sft" "$@" > "$out/sft.log" 2>&1 || { tail -20 "$out/sft.log"; exit 1; }
echo "sft: $(( $(date +%s) - t0 )) s; last: $(tail -1 "$work/sft/metrics.jsonl")"
python3 -m trace.eval --config "$work/trace.yaml" --ckpt "$work/sft" --out "$out/base_eval_validation.json" \
  > "$out/eval.log" 2>&1 || { tail -20 "$out/eval.log"; exit 1; }
echo "base on validation: $(tail -1 "$out/eval.log")"
python3 -m trace.rl.calibrate --config "$work/trace.yaml" --out "$out/align_calibration_$model.json" \
  > "$out/calibrate.log" 2>&1 || { tail -20 "$out/calibrate.log"; exit 1; }
tail -5 "$out/calibrate.log"
tar czf "$out/unit_runs.tgz" -C "$work" --exclude=ckpt . && echo "packed $(du -h "$out/unit_runs.tgz" | cut -f1)"
echo "total $(( $(date +%s) - t0 )) s"
