#!/usr/bin/env bash
# One bounded command on a GPU machine (at most 600 s; the working tree is copied there, what it writes under
# $OUT comes back) that checks and times the kernels and the rollout engine: the GPU test suite
# (scripts/gpu/gpu_tests.sh), then benchmarks/bench_kernels.py at the crossover sizes of the Qwen3 and Mixtral
# shapes (every T and M, the MMA tile also where the GEMV is the default), then benchmarks/bench_rollout.py at
# the Qwen3-30B-A3B layer shape. Everything lands in OUT (gpu_tests.txt, k.csv, r.csv, logs); here append
# them with benchmarks/results_table.py. A failing test stops the command before any timing.
#   bash scripts/gpu/bench_call.sh VERSION [PARTS]   # carry .anchors (triton_kernels v3.6.0, the anchor)
# PARTS: bench_kernels --only (default attention,moe,dense; also quantize, sampling, fused); LIMIT (default 570) bounds the call in seconds;
# ENGINE=0 leaves the engine out (its benchmark then gets a call of its own); BREAKDOWN=1 adds the engine's step
# breakdown (bench_rollout.py --breakdown: kernel time by component, graph-busy / graph-idle); NCU="TARGET ..." (names of
# benchmarks/ncu_kernels.py run --list) adds Nsight Compute's counters of those targets after the kernels (ncu.csv,
# ncu.md in OUT; ~60 s);
# GPU_SUITE: full (default; about 7 min, so a fresh machine's first call runs the suite and stops, and the next
# call on that machine, for the same source tree, goes straight to the timings) or fast (gpu_tests.sh's named
# subset, one test or more of every GPU test file); SKIP_GPU_TESTS=1 skips the suite, which OUT/gpu_tests.txt
# and the output say; GPU_TESTS_K narrows it (a pytest -k expression);
# PROVIDERS: the engine's providers (default engine-bf16 engine-w4a4-kv4-triton engine-w4a4-kv4-kernels);
# REPEATS: timed rounds per engine provider (default 3, bench_rollout.py --repeats);
# GIT_COMMIT names the launching commit (the copy's .git may be older than its files). The tests import
# trace.config, which needs jsonschema: carry WHEELS too (default .whl-pipe, from scripts/gpu/offline_wheels.sh
# download .whl-pipe pipeline).
set -uo pipefail
t0=$(date +%s)
version=${1:?usage: bench_call.sh VERSION [PARTS]}; parts=${2:-attention,moe,dense}
out=${OUT:?the device tool sets OUT}
limit=${LIMIT:-570}
. scripts/gpu/env.sh || exit 1
left() { echo $(( limit - ($(date +%s) - t0) )); }
# the GPU suite first; where it ran in this call and left less than 300 s, the timings wait for the next call
suite_start=$(date +%s)
TEST_LIMIT=$(( $(left) - 20 )) bash scripts/gpu/gpu_tests.sh "${GPU_SUITE:-full}" || { echo "nothing timed"; exit 1; }
if [ $(( $(date +%s) - suite_start )) -gt 60 ] && [ "$(left)" -lt 300 ]; then
  echo "the GPU suite took this call's time: call again on this machine for the timings"; exit 0
fi
anchor=.anchors/triton_kernels-v3.6.0
[ -d "$anchor" ] || echo "no $anchor: the anchor's rows are skipped"
engine=${ENGINE:-1}
reserve=5  # seconds kept for what follows the kernels: the engine 170, with its breakdown 250
[ "$engine" = 1 ] && reserve=$(( ${BREAKDOWN:-0} == 1 ? 250 : 170 ))
ncu_targets=${NCU:-}
budget=$(( $(left) - reserve - (${#ncu_targets} ? 90 : 0) ))
[ "$budget" -gt 10 ] || { echo "no time left for the kernels ($budget s)"; budget=10; }
PYTHONPATH=$PYTHONPATH:$anchor timeout $budget python3 benchmarks/bench_kernels.py --quick \
  --T 1 4 16 64 256 --M 1 2 4 8 16 --only "$parts" --version "$version" --out "$out/k.csv" > "$out/k.log" 2>&1
echo "kernels: rc $? after $(( $(date +%s) - t0 )) s, $(grep -c 'CHECK FAIL' "$out/k.log") failed checks"
grep "CHECK FAIL" "$out/k.log" | head -5
ncu_run() {  # ncu_run METRICS: the targets under Nsight Compute into OUT/ncu.csv
  # shellcheck disable=SC2086  # the targets are words
  PYTHONPATH=$PYTHONPATH:$anchor timeout $(( $(left) - reserve )) /usr/local/cuda/bin/ncu --profile-from-start off \
    --clock-control none --csv --page details --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
    --metrics "$1" python3 benchmarks/ncu_kernels.py run --targets $ncu_targets > "$out/ncu.csv" 2> "$out/ncu.err"
}
if [ -n "$ncu_targets" ]; then
  # without the counts if ncu refuses one of their names (it then profiles nothing)
  ncu_run "$(python3 benchmarks/ncu_kernels.py metrics)" || ncu_run "$(python3 benchmarks/ncu_kernels.py metrics --no-counts)"
  echo "ncu: rc $? after $(( $(date +%s) - t0 )) s"
  python3 benchmarks/ncu_kernels.py summarize "$out/ncu.csv" > "$out/ncu.md" 2>&1 && sed -n '/^| target | kernels/,$p' "$out/ncu.md"
fi
[ "$engine" = 1 ] || exit 0
timeout $(( $(left) - 5 )) python3 benchmarks/bench_rollout.py --device cuda --models qwen3_30b_a3b --batch 256 64 \
  --gen 1024 --providers ${PROVIDERS:-engine-bf16 engine-w4a4-kv4-triton engine-w4a4-kv4-kernels} --repeats ${REPEATS:-3} --version "$version" $([ "${BREAKDOWN:-0}" = 1 ] && echo --breakdown) \
  --deadline $(( $(left) - 60 )) --out "$out/r.csv" > "$out/r.log" 2>&1
echo "rollout: rc $? after $(( $(date +%s) - t0 )) s"
grep -h "tokens_per_s" "$out/r.log" | sed -E "s/.*'provider': '([^']*)', 'batch': ([0-9]+).*'tokens_per_s': ([0-9.]+).*'ratio_vs_bf16': ([0-9.]+).*/\1 b\2 \3 tok\/s \4x/"
