"""Embedded FP4 rollout engine (own forward for the four MoE families, KV cache BF16/FP4, batched
sampling, multi-turn, guidance recording). See trace/rollout/engine.py."""
from trace.rollout.engine import MODES, RolloutBatch, RolloutEngine  # noqa: F401
from trace.rollout.env import EnvPool  # noqa: F401
