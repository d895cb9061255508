#!/usr/bin/env bash
# The SFT recipe search (DESIGN.md §4 "SFT recipe"), the GPU plan's first unit: the candidate SFT bases of
# scripts/gpu/sft_search.py (qwen3_moe-small, small-v2's reasoning task, seed 0) trained side by side on one GPU, each
# evaluated on the VALIDATION split in BF16 and FP4 with the profile's eval settings, then the rule's pick. In $OUT:
# candidate_<name>.json per candidate (validation accuracy BF16 / FP4 with SE, mean response tokens, SFT seconds, the
# gate's verdict), chosen.json (the pick and the keys to set in the profile; exit 1 when no candidate passes the gate),
# the logs, and the run dirs packed without their checkpoints (sft_search_runs.tgz).
#   bash scripts/gpu/sft_search_unit.sh [PROFILE MODEL TASK]   # default: small-v2 qwen3_moe-small reasoning
#   bash scripts/gpu/sft_search_unit.sh --dry-run [PROFILE MODEL TASK]   # CPU: the candidates and their configs
# WHEELS (default .whl-pipe, scripts/gpu/offline_wheels.sh download .whl-pipe pipeline) are installed first: the
# configs need jsonschema. GPU_SUITE / SKIP_GPU_TESTS as in scripts/gpu/gpu_tests.sh (default: fast). THREADS: torch
# threads per candidate (default 2: six candidates on a 16-core machine). SFT_SEARCH_MAX_STEPS=N runs only the candidates of
# at most N SFT steps (one machine's unit; by the rule a passing medium candidate of fewer steps is the pick whatever
# the longer ones give, so those run only when none passes).
set -uo pipefail
if [ "${1:-}" = --dry-run ]; then shift; exec python3 scripts/gpu/sft_search.py dry-run "$@"; fi
profile=${1:-small-v2}; model=${2:-qwen3_moe-small}; task=${3:-reasoning}
out=${OUT:-/tmp/out}; mkdir -p "$out"
. scripts/gpu/env.sh || exit 1
GPU_SUITE=${GPU_SUITE:-fast} bash scripts/gpu/gpu_tests.sh || { echo "GPU tests failed: nothing run"; exit 1; }
work=/tmp/sft_search/$profile/$model/$task; mkdir -p "$work"
mapfile -t names < <(python3 scripts/gpu/sft_search.py prepare "$profile" "$model" "$task" "$work") || exit 1
[ "${#names[@]}" -gt 0 ] || { echo "no candidates"; exit 1; }
t0=$(date +%s); pids=()
for n in "${names[@]}"; do
  # each candidate: its SFT, then its evaluation on the validation split, side by side with the others
  ( s=$(date +%s)
    python3 -m trace.sft --config "$work/$n/sft.yaml" --out "$work/$n/sft" --no-progress --set "threads=${THREADS:-2}" \
      > "$out/sft_$n.log" 2>&1 || exit 1
    echo $(( $(date +%s) - s )) > "$work/$n/sft_seconds"
    python3 -m trace.eval --config "$work/$n/eval.yaml" --ckpt "$work/$n/sft" --out "$work/$n/validation.json" \
      --set "threads=${THREADS:-2}" > "$out/eval_$n.log" 2>&1 ) &
  pids+=($!)
done
for i in "${!names[@]}"; do
  wait "${pids[$i]}" || { echo "${names[$i]} failed:"; tail -5 "$out/sft_${names[$i]}.log" "$out/eval_${names[$i]}.log" 2>/dev/null; }
done
echo "candidates (${#names[@]} side by side): $(( $(date +%s) - t0 )) s"
python3 scripts/gpu/sft_search.py summarise "$work" "$out" "${names[@]}"; rc=$?
tar czf "$out/sft_search_runs.tgz" -C "$work" --exclude=ckpt . && echo "packed $(du -h "$out/sft_search_runs.tgz" | cut -f1)"
echo "total $(( $(date +%s) - t0 )) s"
exit $rc
