"""Temperature on both sides: the rollout's log-probs are those of the distribution it sampled from,
log_softmax(logits / T), and the trainer's are taken at the same T, so at T = 0.7 an FP32 trainer and
the FP32 engine agree and every TIS weight is 1.

Numbers this relies on (qwen3_moe-tiny SFT base, easy arithmetic, 8 prompts x 3 samples, 5 new tokens):
before the fix the engine reported log-probs at T = 1 while sampling at T = 0.7; those differ from the
T = 0.7 log-probs by far more than the 0.05 nats asserted below, and against a trainer at T = 0.7 the
TIS weights exp(lp_train - lp_rollout) would have been far from 1. Agreement here is to float rounding
(|dlp| < 1e-4), as in test_train_batch_alignment at T = 1.
"""
from __future__ import annotations

import torch

from tests.rl.conftest import small_cfg
from trace.episode import run_episode
from trace.rl.trainer import RLTrainer, build_train_batch, token_logprobs

T = 0.7


def test_rollout_and_trainer_logprobs_at_the_sampling_temperature(tmp_path, sft_ckpt):
    cfg = small_cfg(["rl.method=bf16", "rl.autocast=none", f"rl.temperature={T}"], init_ckpt=sft_ckpt)
    tr = RLTrainer(cfg, tmp_path / "r", progress=False)
    batch = run_episode(tr.engine, tr.task, tr.tok, tr._prompts_for(1), n=3, seed=5, temperature=T,
                        max_new_tokens=5, max_turns=1).batch
    tb = build_train_batch(batch, tr.tok.pad_token_id)
    m = tb.mask
    with torch.no_grad():
        logits = tr.model(input_ids=tb.ids, attention_mask=tb.att).logits.float()  # [B, T, V], FP32
        lp_at = {t: torch.log_softmax(logits / t, -1).gather(-1, tb.tgt[..., None]).squeeze(-1) for t in (1.0, T)}
        lp_train = token_logprobs(tr.model, tb, autocast=False, temperature=T)
    # the rollout reports the behaviour policy (T = 0.7), not the T = 1 policy
    torch.testing.assert_close(tb.lp_roll[m], lp_at[T][m], atol=1e-4, rtol=0)
    assert float((tb.lp_roll[m] - lp_at[1.0][m]).abs().max()) > 0.05
    # trainer at the same temperature: TIS weights min(pi_train / pi_rollout, 2) are 1
    tis = (lp_train - tb.lp_roll).exp().clamp(max=2.0)[m]
    torch.testing.assert_close(tis, torch.ones_like(tis), atol=1e-4, rtol=0)


def test_rl_step_at_temperature_has_no_mismatch(tmp_path, sft_ckpt):
    """A whole bf16 step at T = 0.7 with an FP32 trainer: k3 and |dlp| are float rounding, no TIS weight
    is truncated."""
    cfg = small_cfg(["rl.method=bf16", "rl.autocast=none", f"rl.temperature={T}", "rl.steps=1"],
                    init_ckpt=sft_ckpt)
    rec = RLTrainer(cfg, tmp_path / "s", progress=False).step(1).to_dict()
    assert rec["dlp_abs_max"] < 1e-4 and rec["k3"] < 1e-8
    assert rec["is_filter_frac"] == 0.0
