#!/usr/bin/env bash
# The GPU test suite: every test file with tests that skip, or take another path, without a CUDA device.
# The scripts that produce GPU numbers (bench_call.sh, remote_call.sh, profile_chunk.sh, openrlhf_small.sh,
# size_profile.sh) run it first and stop when it fails.
#   bash scripts/gpu/gpu_tests.sh [full|fast]   # default full (GPU_SUITE); exit 1 on a failure or no GPU
#   bash scripts/gpu/gpu_tests.sh list [fast]   # print the files (and the fast subset's -k expression)
# full: the files below, whole (about 380 tests, about 7 min on one H200, in one process: under
# pytest-xdist the workers share one GPU and its compiles and were slower). fast: the subset named by
# FAST_K, at least one test of every file (tests/workflow/test_gpu_tests.py checks the coverage).
# A suite that passed on this machine for the same source tree is not run again: GPU_TESTS_PASSED (default
# /tmp/trace-gpu-tests-passed) keeps "TREE SUITE" lines, TREE a hash of the *.py and *.yaml files under
# trace/ kernels/ tests/ benchmarks/ (a copy's .git may be older than its files); full covers fast.
# SKIP_GPU_TESTS=1 skips the suite on purpose. GPU_TESTS_K narrows it further (a pytest -k expression; not
# stamped as passed). TEST_LIMIT bounds the run in seconds (default 540).
# Every outcome is one line on stdout and in RECORD (default $OUT/gpu_tests.txt, or /tmp/gpu_tests.txt without
# OUT), the pytest log in $OUT/gpu_tests.log; the callers put that line in their output (and
# profile_chunk.sh in every run's meta.json, env TRACE_GPU_TESTS).
set -uo pipefail
# Each directory's files stand together: the GPU image's pytest left tests/rl/conftest.py out of force for
# tests/rl/test_exact_arm.py when tests/rl/ came back after other directories ("fixture 'sft_ckpt' not found").
FILES=(tests/kernels tests/fp4/test_kernel_path.py tests/qat/test_patch.py tests/qat/test_experts.py tests/rl/test_steps.py
       tests/rl/test_exact_arm.py tests/rollout/test_gpu.py tests/rollout/test_fast.py
       tests/rollout/test_batch_invariant_engine.py tests/rollout/test_step_record_sinks.py tests/test_sft.py)
FAST_K="gpu or kernel_path or mma or decodes or plain_variant or stable_sort or pads_per_expert or decoded_activation \
or fake_tile or tma or fma or register_cap or dot_order or sampl or self_test or recording or sm90 or routing or gemv \
or ptx or record_rows"
py=${PYTHON:-python3}
if [ "${1:-}" = list ]; then
  printf '%s\n' "${FILES[@]}"
  [ "${2:-}" = fast ] && echo "-k $FAST_K"
  exit 0
fi
suite=${1:-${GPU_SUITE:-full}}
case $suite in full|fast) ;; *) echo "usage: gpu_tests.sh [full|fast] | list [fast]" >&2; exit 2;; esac
logdir=${OUT:-/tmp}
record=${RECORD:-$logdir/gpu_tests.txt}
commit=${TRACE_GIT_COMMIT:-${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}}
say() { echo "$1"; echo "$1" > "$record"; }
if [ "${SKIP_GPU_TESTS:-0}" = 1 ]; then
  say "GPU tests skipped (SKIP_GPU_TESTS=1) at commit $commit"; exit 0
fi
tree=$(find trace kernels tests benchmarks \( -name '*.py' -o -name '*.yaml' \) -type f 2>/dev/null | LC_ALL=C sort \
       | xargs cat 2>/dev/null | sha256sum | cut -c1-16)
passed=${GPU_TESTS_PASSED:-/tmp/trace-gpu-tests-passed}
if [ -z "${GPU_TESTS_K:-}" ] && { grep -qx "$tree full" "$passed" 2>/dev/null || grep -qx "$tree $suite" "$passed" 2>/dev/null; }; then
  say "GPU tests ($suite) passed on this machine already for this tree ($tree, commit $commit)"; exit 0
fi
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "$gpus" -eq 0 ]; then
  say "GPU tests ($suite) not run: no GPU visible (the suite would only skip) at commit $commit"; exit 1
fi
k=()
[ "$suite" = fast ] && k=(-k "$FAST_K")
[ -n "${GPU_TESTS_K:-}" ] && k=(-k "${k[1]:+(${k[1]}) and }(${GPU_TESTS_K})")
limit_s=${TEST_LIMIT:-540}
if [ "$limit_s" -lt 30 ]; then
  say "GPU tests ($suite) not run: $limit_s s left at commit $commit"; exit 1
fi
t0=$(date +%s)
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout "$limit_s" "$py" -m pytest "${FILES[@]}" -q \
  -p no:cacheprovider --durations=15 "${k[@]}" > "$logdir/gpu_tests.log" 2>&1
rc=$?
summary=$(grep -E "^=+ .*(passed|failed|error|skipped|no tests ran).* =+$" "$logdir/gpu_tests.log" | tail -1 | tr -d '=' | xargs)
took=$(( $(date +%s) - t0 ))
if [ $rc -ne 0 ]; then
  tail -40 "$logdir/gpu_tests.log"
  [ $rc -eq 124 ] && summary="ran past $limit_s s; $summary"
  say "GPU tests ($suite${GPU_TESTS_K:+, -k $GPU_TESTS_K}) FAILED at commit $commit in $took s: $summary"; exit 1
fi
say "GPU tests ($suite${GPU_TESTS_K:+, -k $GPU_TESTS_K}) passed at commit $commit in $took s: $summary"
[ -n "${GPU_TESTS_K:-}" ] || echo "$tree $suite" >> "$passed"
