#!/usr/bin/env bash
# The RL-step benchmark (benchmarks/bench_rlstep.py) at one medium shape on one H200, in two bounded calls of the
# device tool (each under 10 minutes) on the same machine: PART 1 times bf16, fp4-naive and qat-independent, PART 2
# trace and trace-deep; both append to one table on the machine (/tmp/rlstep/rlstep.csv), so PART 2's ratios take
# PART 1's bf16 and qat-independent rows of the same run, and each call copies that table to $OUT/rlstep.csv.
#   GIT_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu/rlstep_unit.sh MODEL PART VERSION
#   e.g. qwen3_moe-medium 1 m1, then qwen3_moe-medium 2 m1; mixtral-medium 1 m1, then mixtral-medium 2 m1
# At home: python benchmarks/results_table.py OUT/rlstep.csv --into results/rlstep/rlstep.csv (the last call's
# table holds the earlier calls' rows too: append it once, after the last call), then `snakemake figures`.
# Every sequence generates GEN (default 1024) tokens, forced (the row says so). Sequences per step = PROMPTS x GROUP,
# per model below: the trainer runs a step's batch in one forward, which keeps ~0.3 MB per token and layer for the
# backward (trace/models/FAMILIES.md section 7), so 256 sequences of 1,024 tokens do not fit one H200 (the trainer
# has no micro-batches); the default is the largest round batch that the section's estimate fits with room.
# Device time, ESTIMATED (nothing timed at these shapes yet): per arm ~1.5-2 min (model init on the CPU, engine
# build and CUDA-graph capture, 3 steps of a ~3 s rollout and a few-second train step, the replay probe), so PART 1
# ~5-6 min, PART 2 ~4 min, plus ~1 min of installation and the GPU check on a fresh machine: ~20 min for both
# shapes (a fresh machine's first call may only run the GPU suite: call again). A PART that runs out of its TIMEOUT
# (default 480 s) appends nothing: lower STEPS or split ARMS.
# Env: WHEELS (default .whl-pipe: jsonschema for trace.config), SKIP_GPU_TESTS=1 / GPU_SUITE (default fast) as in
# gpu_tests.sh, PROMPTS / GROUP / GEN / STEPS override the defaults, ARMS overrides the PART's arms,
# EXTRA adds benchmark options (e.g. --recompute-experts, --init-ckpt DIR).
set -uo pipefail
t0=$(date +%s)
model=${1:?usage: rlstep_unit.sh MODEL PART VERSION}; part=${2:?PART 1 or 2}; version=${3:?VERSION}
out=${OUT:?the device tool sets OUT}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
wheels=${WHEELS:-.whl-pipe}
if [ -d "$wheels" ]; then
  python3 -m pip install -q --no-index --find-links "$wheels" --target /tmp/site-rlstep jsonschema > "$out/install.log" 2>&1 \
    || { tail -20 "$out/install.log"; exit 1; }
  export PYTHONPATH=$PYTHONPATH:/tmp/site-rlstep
fi
case $part in
  1) arms=${ARMS:-bf16 fp4-naive qat-independent};;
  2) arms=${ARMS:-trace trace-deep};;
  *) echo "PART must be 1 or 2" >&2; exit 2;;
esac
case $model in
  qwen3_moe-medium) prompts=4; group=8;;   # 32 x ~1,060 tokens: ~44 GB of activations beside ~56 GB fixed
  mixtral-medium) prompts=4; group=8;;
  olmoe-medium|qwen2_moe-medium) prompts=4; group=8;;
  *) prompts=2; group=4;;
esac
prompts=${PROMPTS:-$prompts}; group=${GROUP:-$group}
# the GPU suite first (once per machine and source tree); where it took this call's time, the timing waits for the next
suite_start=$(date +%s)
TEST_LIMIT=400 bash scripts/gpu/gpu_tests.sh "${GPU_SUITE:-fast}" || { echo "GPU tests failed: nothing timed"; exit 1; }
if [ $(( $(date +%s) - suite_start )) -gt 60 ] && [ $(( $(date +%s) - t0 )) -gt 120 ]; then
  echo "the GPU suite took this call's time: call again on this machine for the timings"; exit 0
fi
mkdir -p /tmp/rlstep
table=/tmp/rlstep/rlstep.csv
if [ "$part" = 2 ] && ! grep -q "^$version,.*,$model,[^,]*,bf16," "$table" 2>/dev/null; then
  echo "no PART 1 rows of $model ($version) on this machine: PART 2's rows get no ratios against bf16 / qat-independent"
fi
# the benchmark on the device at a tiny shape first (seconds): the phases, the probe and the forced length on CUDA
python3 benchmarks/bench_rlstep.py --device cuda --model qwen3_moe-tiny --arms qat-independent trace --prompts 2 \
  --group-size 4 --gen 32 --steps 2 --version check --out /tmp/rlstep/check.csv > "$out/check.log" 2>&1 \
  || { tail -30 "$out/check.log"; echo "the tiny check failed: nothing timed"; exit 1; }
echo "setup and checks $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
timeout "${TIMEOUT:-480}" python3 benchmarks/bench_rlstep.py --device cuda --model "$model" --arms $arms \
  --prompts "$prompts" --group-size "$group" --gen "${GEN:-1024}" --steps "${STEPS:-3}" --version "$version" \
  --out "$table" ${EXTRA:-} > "$out/rlstep_${model}_part$part.log" 2>&1
rc=$?
tail -n 12 "$out/rlstep_${model}_part$part.log"
[ -e "$table" ] && cp "$table" "$out/rlstep.csv"
echo "part $part of $model: rc $rc, $(( $(date +%s) - t0 )) s"
exit $rc
