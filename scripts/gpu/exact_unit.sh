#!/usr/bin/env bash
# One GPU unit for the exact on-policy arm (DESIGN.md §4 "Exact on-policy arm"): a model's SFT base (seed SEED) of the
# small-v2 profile's reasoning task, then the arms exact, trace, trace-deep and qat-independent from that base side by
# side on the one GPU (the profile's 4 runs per device), STEPS RL steps each (default 40: the profile's 150 do not fit
# ~20 min on one machine) with the profile's settings otherwise, each evaluated in FP4 at its last step; then a check that
# every step of the exact run logged k3 == 0, k1 == 0 and max |dlp| == 0 (exit 1 otherwise) and a summary per arm:
# mismatch, guidance bytes per generated token, trainer and step time, rollout tokens/s, accuracy.
#   bash scripts/gpu/exact_unit.sh MODEL [STEPS] [SEED] [--set key=value ...]   # extra --set go to every RL run
# MODEL e.g. qwen3_moe-small. Everything lands in $OUT: summary.json, the logs, the run dirs packed without their
# checkpoints (exact_runs.tgz, the run dirs to commit). WHEELS (default .whl-pipe, scripts/gpu/offline_wheels.sh
# download .whl-pipe pipeline) are installed first: the configs need jsonschema. GPU_SUITE / SKIP_GPU_TESTS as in
# scripts/gpu/gpu_tests.sh (default: fast, which holds the exact arm's GPU tests).
set -uo pipefail
model=${1:?usage: exact_unit.sh MODEL [STEPS] [SEED] [--set key=value ...]}; steps=${2:-40}; seed=${3:-0}
shift $(( $# < 3 ? $# : 3 ))
profile=small-v2; task=reasoning
arms=(exact trace trace-deep qat-independent)
out=${OUT:-/tmp/out}; mkdir -p "$out"
. scripts/gpu/env.sh || exit 1
GPU_SUITE=${GPU_SUITE:-fast} bash scripts/gpu/gpu_tests.sh || { echo "GPU tests failed: nothing run"; exit 1; }
work=/tmp/exact_unit/$profile/$model/seed$seed; mkdir -p "$work"
python3 - "$profile" "$model" "$task" "$seed" "$steps" "$work" "${arms[@]}" <<'PY' || exit 1
import json, sys, yaml
from workflow.scripts.runplan import Plan
profile, model, task, seed, steps, work, *arms = sys.argv[1:]
seed, steps = int(seed), int(steps)
plan = Plan(yaml.safe_load(open(f"experiments/profiles/{profile}.yaml")))
yaml.safe_dump(json.loads(json.dumps(plan.sft_config(model, task, seed))), open(f"{work}/sft.yaml", "w"))
for arm in arms:
    rl = json.loads(json.dumps(plan.run_config(model, task, arm, seed)))
    rl["rl"].update(init_ckpt=f"{work}/sft/ckpt", steps=steps, eval_every=steps, ckpt_every=steps)
    yaml.safe_dump(rl, open(f"{work}/{arm}.yaml", "w"))
PY
t0=$(date +%s)
if [ ! -f "$work/sft/done" ]; then
  python3 -m trace.sft --config "$work/sft.yaml" --out "$work/sft" > "$out/sft.log" 2>&1 || { tail -20 "$out/sft.log"; exit 1; }
fi
echo "sft: $(( $(date +%s) - t0 )) s; last: $(tail -1 "$work/sft/metrics.jsonl")"
t1=$(date +%s); pids=()
for arm in "${arms[@]}"; do
  sets=(); for s in "$@"; do [ "$s" = --set ] || sets+=(--set "$s"); done
  python3 -m trace.rl --config "$work/$arm.yaml" --out "$work/runs/$arm" --no-progress "${sets[@]}" > "$out/rl_$arm.log" 2>&1 &
  pids+=($!)
done
fail=0
for i in "${!arms[@]}"; do
  wait "${pids[$i]}" || { echo "rl ${arms[$i]} failed:"; tail -20 "$out/rl_${arms[$i]}.log"; fail=1; }
done
echo "rl (${arms[*]} side by side): $(( $(date +%s) - t1 )) s"
python3 - "$work/runs" "$out/summary.json" "${arms[@]}" <<'PY' || fail=1
import json, statistics, sys
from pathlib import Path
runs, dest, *arms = sys.argv[1:]
summary, bad = {}, []
for arm in arms:
    f = Path(runs) / arm / "metrics.jsonl"
    if not f.exists():
        bad.append(f"{arm}: no metrics"); continue
    recs = [json.loads(x) for x in f.read_text().splitlines()]
    steps = [r for r in recs if r.get("step", 0) >= 1 and "k3" in r]
    med = lambda k: statistics.median(r[k] for r in steps) if steps else None  # noqa: E731
    ev = [r["eval_accuracy"] for r in recs if r.get("eval_accuracy") is not None]
    summary[arm] = {"steps": len(steps), "k3_mean": statistics.fmean(r["k3"] for r in steps) if steps else None,
                    "k3_max": max((r["k3"] for r in steps), default=None),
                    "dlp_abs_max": max((r["dlp_abs_max"] for r in steps), default=None),
                    "guidance_bytes_per_gen_token": med("guidance_bytes_per_gen_token"),
                    "time_train_s_median": med("time_train_s"), "time_step_s_median": med("time_step_s"),
                    "rollout_gen_tokens_per_s_median": med("rollout_gen_tokens_per_s"),
                    "eval_accuracy_start": ev[0] if ev else None, "eval_accuracy_end": ev[-1] if len(ev) > 1 else None}
    if arm == "exact":
        off = [r["step"] for r in steps if not (r["k3"] == 0.0 and r["k1"] == 0.0 and r["dlp_abs_max"] == 0.0)]
        if off or not steps:
            bad.append(f"exact: k3 / k1 / max |dlp| not 0 at steps {off[:10]} ({len(off)} of {len(steps)})")
if "exact" in summary and "qat-independent" in summary and summary["qat-independent"]["time_train_s_median"]:
    summary["exact_train_time_over_qat_independent"] = (summary["exact"]["time_train_s_median"]
                                                        / summary["qat-independent"]["time_train_s_median"])
json.dump(summary, open(dest, "w"), indent=1)
for arm, s in summary.items():
    print(arm, s)
for b in bad:
    print("FAIL", b)
sys.exit(1 if bad else 0)
PY
tar czf "$out/exact_runs.tgz" -C "$work" --exclude=ckpt runs sft && echo "packed $(du -h "$out/exact_runs.tgz" | cut -f1)"
echo "total $(( $(date +%s) - t0 )) s"
exit $fail
