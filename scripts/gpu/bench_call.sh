#!/usr/bin/env bash
# One GPU call (the device tool's `run`, at most 600 s) that checks and times the kernels and the rollout
# engine: the kernels' GPU tests, then benchmarks/bench_kernels.py at the crossover sizes of the Qwen3 and
# Mixtral shapes (every T and M, the MMA tile also where the GEMV is the default), then
# benchmarks/bench_rollout.py at the Qwen3-30B-A3B layer shape. Everything lands in OUT (k.csv, r.csv, logs);
# here append them with benchmarks/results_table.py. A failing test stops the call before any timing.
#   bash scripts/gpu/bench_call.sh VERSION [PARTS]   # carry .anchors (triton_kernels v3.6.0, the anchor)
# PARTS: bench_kernels --only (default attention,moe,dense; also quantize, sampling, fused); LIMIT (default 570) bounds the call in seconds;
# ENGINE=0 leaves the engine out (its benchmark then gets a call of its own); BREAKDOWN=1 adds the engine's step
# breakdown (bench_rollout.py --breakdown: kernel time by component, graph-busy / graph-idle); NCU="TARGET ..." (names of
# benchmarks/ncu_kernels.py run --list) adds Nsight Compute's counters of those targets after the kernels (ncu.csv,
# ncu.md in OUT; ~60 s);
# TEST_LIMIT: seconds for the GPU tests (default 330); TESTS: the GPU tests' paths (default tests/kernels tests/rl/test_steps.py tests/rollout/test_gpu.py);
# TEST_K: their pytest -k expression (default: the GPU-relevant names below);
# PROVIDERS: the engine's providers (default engine-bf16 engine-w4a4-kv4-triton engine-w4a4-kv4-kernels);
# REPEATS: timed rounds per engine provider (default 3, bench_rollout.py --repeats);
# GIT_COMMIT names the launching commit (the lease's .git is stale). The tests import trace.config, which needs
# jsonschema: carry WHEELS too (default .whl-pipe, from scripts/gpu/offline_wheels.sh download .whl-pipe pipeline).
set -uo pipefail
t0=$(date +%s)
version=${1:?usage: bench_call.sh VERSION [PARTS]}; parts=${2:-attention,moe,dense}
out=${OUT:?the device tool sets OUT}
limit=${LIMIT:-570}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
wheels=${WHEELS:-.whl-pipe}
if [ -d "$wheels" ]; then
  python3 -m pip install -q --no-index --find-links "$wheels" --target /tmp/site-bench jsonschema > "$out/install.log" 2>&1 \
    || { tail -20 "$out/install.log"; exit 1; }
  export PYTHONPATH=$PYTHONPATH:/tmp/site-bench
fi
left() { echo $(( limit - ($(date +%s) - t0) )); }
gpu_tests() {  # gpu_tests SECONDS [pytest options]
  # shellcheck disable=SC2086  # the paths are words
  timeout "$1" python3 -m pytest ${TESTS:-tests/kernels tests/rl/test_steps.py tests/rollout/test_gpu.py} -q -p no:cacheprovider "${@:2}" \
    -k "${TEST_K:-every_gpu_tile or decodes or plain_variant or gpu_step or stable_sort or pads_per_expert or decoded_activation or fake_tile or tma or fma or register_cap or dot_order or sampl}" \
    > "$out/tests.log" 2>&1
}
# one process: in 8 (pytest-xdist) the same tests ran past 200 s on a warm H200 where one process took 221 s (v5h:
# they share one GPU and the compile); --durations names the slow ones in tests.log
if ! gpu_tests "${TEST_LIMIT:-330}" --durations=15; then
  tail -40 "$out/tests.log"; echo "GPU tests failed or ran past ${TEST_LIMIT:-330} s: nothing timed"; exit 1
fi
tail -1 "$out/tests.log"
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
