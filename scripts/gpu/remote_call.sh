#!/usr/bin/env bash
# One bounded command on a GPU machine without package-registry access (the working tree, with the wheel
# files, is copied there; what the command writes under $OUT comes back) that goes on with a profile chunk,
# whatever state the machine is in: installs the carried wheel files when the machine is fresh (a no-op
# when they are installed already), runs the GPU test suite (scripts/gpu/gpu_tests.sh; a failure stops
# here), starts the chunk if none is running, and waits for it until the command's time is nearly spent,
# then packs what is done.
#   bash scripts/gpu/remote_call.sh WHEELS PROFILE MODEL[,MODEL...] [TASK[,TASK...]]   # e.g. .whl-pipe experiments/profiles/small.yaml qwen3_moe-small reasoning
# WHEELS: scripts/gpu/offline_wheels.sh download WHEELS pipeline (`all` adds Ray, 51 MB). OUT/chunk.tgz holds
# the run dirs without checkpoints (unpack in the repository root with unpack_chunk.sh); call again until it
# prints "finished".
# LIMIT (default 575) is the command's own budget in seconds, counted from its start. TRACE_GIT_COMMIT (the
# launching commit, `git rev-parse HEAD` with a clean tree) goes into every run's meta.json: the copy's .git
# may be older than the files it holds.
# GPU_SUITE (default full; fast: gpu_tests.sh's named subset) picks the suite; it runs once per machine and
# source tree, SKIP_GPU_TESTS=1 skips it (said in the output and in every run's meta.json), GPU_TESTS_K
# narrows it (a pytest -k expression).
# A call for another chunk (other profile, models, task or ARMS) on a machine whose last chunk finished packs
# that one into OUT/prev_chunk.tgz, copies its SFT checkpoints into this copy of the repository (the new
# chunk does not rebuild them) and starts the new one.
set -uo pipefail
t0=$(date +%s)
wheels=${1:?usage: remote_call.sh WHEELS PROFILE MODEL[,MODEL...] [TASK]}; profile=${2:?profile}; model=${3:?model}; task=${4:-}
limit=${LIMIT:-575}
out=${OUT:?the device tool sets OUT}
work=${WORK:-/tmp/trace-chunk}
WHEELS=$wheels REQUIRE_WHEELS=1; . scripts/gpu/env.sh || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
echo "install/check $(( $(date +%s) - t0 )) s"
key="$profile $model $task ${ARMS:-}"
if [ -e "$work/pid" ] && [ "$(cat "$work/key" 2>/dev/null)" != "$key" ] && ! kill -0 "$(cat "$work/pid")" 2>/dev/null; then
  echo "the chunk that ended here was another one ($(cat "$work/key" 2>/dev/null)): packed into prev_chunk.tgz"
  bash scripts/gpu/profile_chunk.sh wait 0 "$out/prev_chunk.tgz" > "$out/prev_chunk.log" 2>&1
  for c in "$work"/results/runs/*/*/*/sft/ckpt; do
    [ -d "$c" ] || continue
    d=${c#"$work"/}
    [ -e "$d" ] || { mkdir -p "$(dirname "$d")" && cp -r "$c" "$d" && echo "kept $d"; }
  done
  rm -f "$work/pid"
fi
if [ -e "$work/pid" ] && kill -0 "$(cat "$work/pid")" 2>/dev/null; then
  echo "chunk already running"
  [ "$(cat "$work/key" 2>/dev/null)" = "$key" ] || echo "(it is $(cat "$work/key" 2>/dev/null), not $key: call again when it has finished)"
elif [ -e "$work/pid" ]; then
  echo "a chunk ran on this machine and ended; packing it"
  bash scripts/gpu/profile_chunk.sh wait 0 "$out/chunk.tgz"; exit 0
else
  # the GPU suite first (once per machine and source tree); its line goes into every run's meta.json
  TEST_LIMIT=$(( limit - ($(date +%s) - t0) - 30 )) bash scripts/gpu/gpu_tests.sh "${GPU_SUITE:-full}" \
    || { echo "the chunk is not started"; exit 1; }
  TRACE_GPU_TESTS=$(cat "$out/gpu_tests.txt") bash scripts/gpu/profile_chunk.sh start "$profile" "$model" $task || exit 1
  echo "$key" > "$work/key"
fi
bash scripts/gpu/profile_chunk.sh wait $(( limit - ($(date +%s) - t0) )) "$out/chunk.tgz"
echo "call $(( $(date +%s) - t0 )) s"
