"""RL for FP4 MoE policies: GRPO-style trainer with the method arms (bf16, fp4-naive, qat-independent,
qat-weight-only, trace and its ablations), OpenRLHF-compatible losses and advantage estimators, and the
train-rollout mismatch metrics. Entry point: ``python -m trace.rl --config CFG.yaml --out DIR``.
See trace/rl/trainer.py (the step) and trace/rl/losses.py (the math)."""
from trace.rl.losses import compute_advantages, kl_k3, mismatch_metrics, policy_loss  # noqa: F401
from trace.rl.trainer import NonFiniteError, RLTrainer, run_rl  # noqa: F401
