#!/usr/bin/env bash
# One call of a GPU lease (the device tool's `run`, at most 600 s) that goes on with a profile chunk,
# whatever state the machine is in: installs the carried wheel files when the machine is fresh (a no-op
# on a warm one), checks the kernels the runs will use, starts the chunk if none is running, and waits
# for it until the call's time is nearly spent, then packs what is done.
#   bash scripts/gpu/lease_call.sh WHEELS PROFILE MODEL[,MODEL...] [TASK[,TASK...]]   # e.g. .whl-pipe experiments/profiles/small.yaml qwen3_moe-small reasoning
# carry WHEELS (scripts/gpu/offline_wheels.sh download WHEELS pipeline; `all` adds Ray and no longer fits the carry). OUT/chunk.tgz holds the run dirs
# without checkpoints (unpack in the repository root); call again until it prints "finished".
# LIMIT (default 575) is the call's own budget in seconds, counted from its start. TRACE_GIT_COMMIT (the
# launching commit, `git rev-parse HEAD` with a clean tree) goes into every run's meta.json: the lease's .git
# is older than the files it carries.
# A call for another chunk (other profile, models, task or ARMS) on a machine whose last chunk finished packs
# that one into OUT/prev_chunk.tgz, copies its SFT checkpoints into this copy of the repository (the new
# chunk does not rebuild them) and starts the new one; the GPU tests run once per machine and commit.
set -uo pipefail
t0=$(date +%s)
wheels=${1:?usage: lease_call.sh WHEELS PROFILE MODEL[,MODEL...] [TASK]}; profile=${2:?profile}; model=${3:?model}; task=${4:-}
limit=${LIMIT:-575}
out=${OUT:?the device tool sets OUT}
work=${WORK:-/tmp/trace-chunk}
bash scripts/gpu/offline_wheels.sh install "$wheels" > "$out/install.log" 2>&1 || { tail -30 "$out/install.log"; exit 1; }
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
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
  bash scripts/gpu/profile_chunk.sh start "$profile" "$model" $task || exit 1
  echo "$key" > "$work/key"
fi
passed=${GPU_TESTS_PASSED:-/tmp/trace-gpu-tests-passed}  # the commit whose GPU tests passed on this machine
if [ ! -e "$work/tests_done" ] && [ "$(cat "$passed" 2>/dev/null)" = "${TRACE_GIT_COMMIT:-none}" ]; then
  echo "GPU tests passed on this machine at this commit already"; touch "$work/tests_done"
elif [ ! -e "$work/tests_done" ]; then
  touch "$work/tests_done"
  # the kernels and the recording graphs at the families' shapes (tests/rollout/test_gpu.py) and the plain
  # activation quantize, the KV decode attention and the routing sort at the GPU's sizes (tests/kernels/) and one trace step
  # of the coding and long-horizon tasks on the GPU path (tests/rl/test_steps.py) and an SFT that repeats bit for
  # bit on the GPU (tests/test_sft.py) and the trainer's FP4 fake quant on the Triton kernel against the reference
  # ops (tests/fp4/test_kernel_path.py, tests/qat/test_patch.py -k kernel_path), beside the chunk's
  # first minutes (SFT); a failure stops the chunk, whose jobs are one process group (setsid). GPU_TESTS
  # narrows them (a -k expression; the default took ~135 s on two H200s before the recording test ran twice,
  # above the engine's crossover and with the kernels forced; most of it the recording graphs).
  if ! timeout 450 python3 -m pytest tests/rollout/test_gpu.py tests/kernels/test_quantize.py tests/kernels/test_attention.py \
      tests/kernels/test_moe.py tests/kernels/test_sampling.py tests/rl/test_steps.py tests/test_sft.py tests/fp4/test_kernel_path.py tests/qat/test_patch.py \
      -q -p no:cacheprovider \
      -k "${GPU_TESTS:-self_test or recording or plain_variant or every_gpu_tile or stable_sort or gpu_step or kernel_path or sampl}" > "$out/gpu_tests.log" 2>&1; then
    tail -40 "$out/gpu_tests.log"
    kill -- -"$(cat "$work/pid")" 2>/dev/null; rm -f "$work/pid"
    echo "GPU tests failed: the chunk is stopped"; exit 1
  fi
  tail -1 "$out/gpu_tests.log"
  echo "${TRACE_GIT_COMMIT:-none}" > "$passed"
fi
bash scripts/gpu/profile_chunk.sh wait $(( limit - ($(date +%s) - t0) )) "$out/chunk.tgz"
echo "call $(( $(date +%s) - t0 )) s"
