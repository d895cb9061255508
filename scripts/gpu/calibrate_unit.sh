#!/usr/bin/env bash
# One GPU unit for a profile's calibration family (DESIGN.md §3 rule, trace/rl/calibrate.py): its SFT bases of seeds
# 0, 1, 2 side by side, each evaluated on the validation split, the SFT base gate on all three (trace/gate.py: one
# line per refused base, exit 1, no calibration), then the alignment coefficient of every guided depth the profile's
# arms with the term use (Plan.calibration_rhos: trace at rho 1, trace-deep at rho 0.5 in small-v2), the median over
# the three seeds each from its own base, side by side. Everything lands in $OUT: align_calibration_<model>_rho<rho>.json
# (the files the pipeline reads from results/guidance/), the bases' validation evaluations, the logs, and the run dirs
# packed without their checkpoints (unit_runs.tgz).
#   bash scripts/gpu/calibrate_unit.sh PROFILE MODEL TASK [--set key=value ...]   # extra --set go to the SFT
# WHEELS (default .whl-pipe, scripts/gpu/offline_wheels.sh download .whl-pipe pipeline) are installed first: the
# configs need jsonschema. GPU_SUITE / SKIP_GPU_TESTS as in scripts/gpu/gpu_tests.sh (default: fast).
set -uo pipefail
profile=${1:?usage: calibrate_unit.sh PROFILE MODEL TASK}; model=${2:?}; task=${3:?}; shift 3
seeds=(0 1 2)
out=${OUT:-/tmp/out}; mkdir -p "$out"
. scripts/gpu/env.sh || exit 1
GPU_SUITE=${GPU_SUITE:-fast} bash scripts/gpu/gpu_tests.sh || { echo "GPU tests failed: nothing run"; exit 1; }
work=/tmp/unit/$profile; mkdir -p "$work"
mapfile -t rhos < <(python3 - "$profile" "$model" "$task" "$work" "${seeds[@]}" <<'PY'
import json, sys, yaml
from trace.arms import ARMS
from workflow.scripts.runplan import Plan
profile, model, task, work, *seeds = sys.argv[1:]
plan = Plan(yaml.safe_load(open(f"experiments/profiles/{profile}.yaml")))
plain = lambda d: json.loads(json.dumps(d))  # noqa: E731
for k in map(int, seeds):
    yaml.safe_dump(plain(plan.sft_config(model, task, k)), open(f"{work}/sft{k}.yaml", "w"))
    ev = plain(plan.run_config(model, task, plan.gate_arm(), k, calibrated=False))
    ev["eval"]["split"] = "validation"
    yaml.safe_dump(ev, open(f"{work}/eval{k}.yaml", "w"))
arms = [a for a in {**plan.arms, **plan.ablation_arms} if ARMS[plan.arm_spec(a)["method"]].align]
rhos = plan.calibration_rhos() or [Plan.rho(plan.run_config(model, task, "trace", 0, calibrated=False))]
for rho in rhos:  # the arm with the term at that depth (trace, or trace-deep), the profile's RL settings
    arm = next(a for a in arms if Plan.rho(plan.run_config(model, task, a, 0, calibrated=False)) == rho)
    rl = plain(plan.run_config(model, task, arm, 0, calibrated=False))
    rl["rl"]["method"] = "trace"
    yaml.safe_dump(rl, open(f"{work}/trace_rho{rho:g}.yaml", "w"))
    print(f"{rho:g}")
PY
) || exit 1
[ "${#rhos[@]}" -gt 0 ] || { echo "no guided depth to calibrate"; exit 1; }
t0=$(date +%s); pids=()
for k in "${seeds[@]}"; do
  ( python3 -m trace.sft --config "$work/sft$k.yaml" --out "$work/sft$k" --no-progress "$@" > "$out/sft$k.log" 2>&1 || exit 1
    python3 -m trace.eval --config "$work/eval$k.yaml" --ckpt "$work/sft$k" --out "$out/base${k}_validation.json" \
      > "$out/eval$k.log" 2>&1 ) &
  pids+=($!)
done
fail=0
for i in "${!seeds[@]}"; do
  wait "${pids[$i]}" || { echo "base of seed ${seeds[$i]} failed:"; tail -5 "$out/sft${seeds[$i]}.log" "$out/eval${seeds[$i]}.log"; fail=1; }
done
[ $fail = 0 ] || exit 1
echo "sft + validation (seeds ${seeds[*]} side by side): $(( $(date +%s) - t0 )) s"
files=(); for k in "${seeds[@]}"; do files+=("$out/base${k}_validation.json"); done
python3 -m trace.gate "${files[@]}" || { echo "SFT base gate refused: no calibration"; exit 1; }
bases=(); for k in "${seeds[@]}"; do bases+=("$work/sft$k"); done
t1=$(date +%s); pids=()
for rho in "${rhos[@]}"; do
  python3 -m trace.rl.calibrate --config "$work/trace_rho$rho.yaml" --seeds "${seeds[@]}" --bases "${bases[@]}" \
    --out "$out/align_calibration_${model}_rho$rho.json" > "$out/calibrate_rho$rho.log" 2>&1 &
  pids+=($!)
done
for i in "${!rhos[@]}"; do
  wait "${pids[$i]}" || { echo "calibration at rho ${rhos[$i]} failed:"; tail -20 "$out/calibrate_rho${rhos[$i]}.log"; fail=1; }
done
for rho in "${rhos[@]}"; do
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('rho', r['rho'], 'align_coef', r['align_coef'], \
'median ratio at it', round(r['ratio_at_align_coef_predicted'], 3))" "$out/align_calibration_${model}_rho$rho.json" 2>/dev/null
done
echo "calibration (rho ${rhos[*]} side by side): $(( $(date +%s) - t1 )) s"
tar czf "$out/unit_runs.tgz" -C "$work" --exclude=ckpt . && echo "packed $(du -h "$out/unit_runs.tgz" | cut -f1)"
echo "total $(( $(date +%s) - t0 )) s"
exit $fail
