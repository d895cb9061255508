#!/usr/bin/env bash
# OpenRLHF 0.11.2's train_ppo_ray on one GPU through `trace.integrations.openrlhf.launch`, colocated (Ray,
# DeepSpeed ZeRO-3 as on a cluster, our engine actor in place of vLLM, CUDA-IPC weight sync): an SFT base of
# qwen3_moe-small (our SFT, one config), then the arms bf16, qat-independent and trace for
# rl.steps steps each, then the table of those runs.
#   bash scripts/gpu/openrlhf_small.sh OUT_DIR [--set key=value ...]
# Needs openrlhf, ray and deepspeed (scripts/install.sh; on a machine without package access, the wheel
# files of docs/openrlhf.md). OUT_DIR/<model>/<task>/<arm>/seed0 are run dirs as analysis/ reads them.
# The GPU test suite runs first (scripts/gpu/gpu_tests.sh; GPU_SUITE, default full; SKIP_GPU_TESTS=1 skips it):
# its line is OUT_DIR/gpu_tests.txt.
set -euo pipefail
out=${1:?usage: scripts/gpu/openrlhf_small.sh OUT_DIR [--set key=value ...]}
mkdir -p "$out"
OUT=$out bash scripts/gpu/gpu_tests.sh "${GPU_SUITE:-full}" || { echo "no run started" >&2; exit 1; }
shift
cfg=experiments/configs/openrlhf_small.yaml
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
base=$out/qwen3_moe-small/reasoning
"$py" -m trace.integrations.openrlhf.launch --stage sft --config $cfg --out $base/sft "$@"
for arm in bf16 qat-independent trace; do
  /usr/bin/time -f "$arm: %e s wall" "$py" -m trace.integrations.openrlhf.launch --config $cfg \
    --out $base/$arm/seed0 --zero-stage 3 --set rl.method=$arm --set rl.init_ckpt=$base/sft "$@"
done
"$py" -m analysis.tables --runs "$out" --out "$out/tables"
