#!/usr/bin/env bash
# The RL-step benchmark (benchmarks/bench_rlstep.py) at one medium shape on one H200, in two bounded calls of the
# device tool (each under 10 minutes) on the same machine: PART 1 times bf16 and qat-independent, PART 2 trace and
# trace-deep, PART 3 fp4-naive; all append to one table on the machine (/tmp/rlstep/rlstep.csv), so PART 2's and 3's
# ratios take PART 1's bf16 and qat-independent rows of the same run, and each call copies that table to
# $OUT/rlstep.csv.
#   GIT_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu/rlstep_unit.sh MODEL PART VERSION
#   e.g. qwen3_moe-medium 1 m1, then qwen3_moe-medium 2 m1, then qwen3_moe-medium 3 m1; likewise mixtral-medium
# At home: python benchmarks/results_table.py OUT/rlstep.csv --into results/rlstep/rlstep.csv (the last call's
# table holds the earlier calls' rows too: append it once, after the last call), then `snakemake figures`.
# Every sequence generates GEN (default 1024) tokens, forced (the row says so). Sequences per step = PROMPTS x GROUP
# (issue #48: 256), trained in micro-batches of MICRO sequences (rl.micro_batch: one forward and backward each,
# gradients accumulated, trace/rl/microbatch.py). MICRO per model below, an ESTIMATE from the saved-activation
# slopes of trace/models/FAMILIES.md section 7 (measured on the CPU; TRACE's replay adds an unmeasured part):
#   qwen3_moe-medium: fixed ~56 GB (AdamW state 16 B x 2.49B = 40 GB, FP4 engine 6.4 GB, BF16 weight casts 4 x
#     1.19 GB, CUDA context) + at step 1 the alignment term's separate gradient (4 B x 2.49B = 10 GB) + the engine's
#     BF16 KV of 256 x 1,100 tokens (8,192 B each: 2.3 GB) = ~69 GB; a sequence of ~1,100 tokens (prompt +
#     1,024 generated) keeps 1,100 x 324 KB x 4 layers = 1.43 GB, so 32 sequences = 46 GB: ~115 GB, ~26 GB left
#     for the record, the replay and the allocator (the whole 256 in one forward: ~365 GB).
#   mixtral-medium: fixed ~70 GB + 4 B x 2.90B = 11.6 GB + 2.3 GB KV = ~84 GB; a sequence keeps 1,100 x 463 KB x
#     2 layers = 1.02 GB, so 32 sequences = 33 GB: ~117 GB, ~24 GB left.
#   olmoe / qwen2_moe medium: no activation slope measured; 32 sequences in one forward as before.
# GPU time, ESTIMATED (nothing timed at 256 sequences yet): a step = a 256-sequence rollout (~3-5 s) + 8
# micro-batches of 32 x ~1,100 tokens (each a forward+backward of the size the benchmark's earlier 32-sequence
# steps took a few seconds for): ~30-40 s; per arm ~2.5-3.5 min with setup, 2 steps and the replay probe, so each
# PART (2 arms, PART 3 one) ~4-7 min (a fresh machine's first call may only run the GPU suite: call again). A PART
# that runs out of its TIMEOUT (default 540 s) appends nothing: split ARMS.
# Env: WHEELS (default .whl-pipe: jsonschema for trace.config), SKIP_GPU_TESTS=1 / GPU_SUITE (default fast) as in
# gpu_tests.sh, PROMPTS / GROUP / GEN / STEPS / MICRO override the defaults (MICRO=0: the whole batch in one
# forward), ARMS overrides the PART's arms,
# EXTRA adds benchmark options (e.g. --recompute-experts, --init-ckpt DIR).
set -uo pipefail
t0=$(date +%s)
model=${1:?usage: rlstep_unit.sh MODEL PART VERSION}; part=${2:?PART 1 or 2}; version=${3:?VERSION}
out=${OUT:?the device tool sets OUT}
. scripts/gpu/env.sh || exit 1
case $part in
  1) arms=${ARMS:-bf16 qat-independent};;
  2) arms=${ARMS:-trace trace-deep};;
  3) arms=${ARMS:-fp4-naive};;
  *) echo "PART must be 1, 2 or 3" >&2; exit 2;;
esac
case $model in
  qwen3_moe-medium) prompts=32; group=8; micro=32;;   # 256 sequences, 8 micro-batches (estimate above)
  mixtral-medium) prompts=32; group=8; micro=32;;
  olmoe-medium|qwen2_moe-medium) prompts=4; group=8; micro=0;;
  *) prompts=2; group=4; micro=0;;
esac
prompts=${PROMPTS:-$prompts}; group=${GROUP:-$group}; micro=${MICRO:-$micro}
# the GPU suite first (once per machine and source tree); where it took this call's time, the timing waits for the next
suite_start=$(date +%s)
TEST_LIMIT=400 bash scripts/gpu/gpu_tests.sh "${GPU_SUITE:-fast}" || { echo "GPU tests failed: nothing timed"; exit 1; }
if [ $(( $(date +%s) - suite_start )) -gt 60 ] && [ $(( $(date +%s) - t0 )) -gt 120 ]; then
  echo "the GPU suite took this call's time: call again on this machine for the timings"; exit 0
fi
mkdir -p /tmp/rlstep
table=/tmp/rlstep/rlstep.csv
if [ "$part" != 1 ] && ! grep -q "^$version,.*,$model,[^,]*,bf16," "$table" 2>/dev/null; then
  echo "no PART 1 rows of $model ($version) on this machine: PART $part's rows get no ratios against bf16 / qat-independent"
fi
# the benchmark on the device at a tiny shape first (seconds): the phases, the probe and the forced length on CUDA
python3 benchmarks/bench_rlstep.py --device cuda --model qwen3_moe-tiny --arms qat-independent trace --prompts 2 \
  --group-size 4 --gen 32 --steps 2 --micro-batch 3 --version check --out /tmp/rlstep/check.csv > "$out/check.log" 2>&1 \
  || { tail -30 "$out/check.log"; echo "the tiny check failed: nothing timed"; exit 1; }
echo "setup and checks $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
timeout "${TIMEOUT:-540}" python3 benchmarks/bench_rlstep.py --device cuda --model "$model" --arms $arms \
  --prompts "$prompts" --group-size "$group" --gen "${GEN:-1024}" --steps "${STEPS:-2}" --version "$version" \
  --micro-batch "$micro" --out "$table" ${EXTRA:-} > "$out/rlstep_${model}_part$part.log" 2>&1
rc=$?
tail -n 12 "$out/rlstep_${model}_part$part.log"
[ -e "$table" ] && cp "$table" "$out/rlstep.csv"
echo "part $part of $model: rc $rc, $(( $(date +%s) - t0 )) s"
exit $rc
