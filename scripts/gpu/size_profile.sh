#!/usr/bin/env bash
# Sizing runs for a GPU profile: per family, an SFT base on the small profile's reasoning task (timed,
# evaluated at the end), then a few RL steps of each FP4-relevant arm from that base (per-step rollout
# and train seconds in each run's metrics.jsonl). Families run side by side on the visible GPU.
#   bash scripts/gpu/size_profile.sh OUT_DIR [SFT_STEPS] [RL_STEPS]
# The GPU test suite runs first (scripts/gpu/gpu_tests.sh; GPU_SUITE, default full; SKIP_GPU_TESTS=1 skips it):
# its line is OUT_DIR/gpu_tests.txt.
set -uo pipefail
out=${1:?usage: scripts/gpu/size_profile.sh OUT_DIR [SFT_STEPS] [RL_STEPS]}
mkdir -p "$out"
OUT=$out bash scripts/gpu/gpu_tests.sh "${GPU_SUITE:-full}" || { echo "no run started" >&2; exit 1; }
sft_steps=${2:-1000}; rl_steps=${3:-3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
common=(--set device=cuda --set threads=4 --set wandb.mode=disabled --set task.difficulty=medium
        --set task.n_train=4096 --set task.n_test=256 --set eval.samples_per_prompt=4)
one_family() {
  local fam=$1 d=$out/$1-small/reasoning
  /usr/bin/time -f "$fam sft: %e s wall" "$py" -m trace.sft --config experiments/configs/smoke_sft_reasoning.yaml \
    --out $d/sft --set model=$fam-small "${common[@]}" --set sft.steps=$sft_steps --set sft.batch_size=64 \
    --set sft.lr=1e-3 --set sft.ckpt_every=$sft_steps --set sft.log_every=50 --set sft.eval_every=$((sft_steps / 2)) \
    --set sft.label_smoothing=0.3 > $out/$fam.log 2>&1 || return
  for arm in bf16 fp4-naive qat-independent trace; do
    /usr/bin/time -f "$fam $arm: %e s wall" "$py" -m trace.rl --config experiments/configs/smoke_rl_reasoning.yaml \
      --out $d/$arm/seed0 --set model=$fam-small "${common[@]}" --set rl.method=$arm --set rl.init_ckpt=$d/sft \
      --set rl.steps=$rl_steps --set rl.prompts_per_step=64 --set rl.group_size=8 --set rl.max_new_tokens=128 \
      --set rl.lr=1e-5 --set rl.ckpt_every=1000 --set rl.eval_every=0 >> $out/$fam.log 2>&1
  done
}
mkdir -p "$out"
for fam in qwen3_moe mixtral olmoe qwen2_moe; do one_family $fam & done
wait
