"""The exact arm (DESIGN.md §4 "Exact on-policy arm") end to end through the embedded RL trainer.

What is compared: the trainer's per-token log-probs (what the loss, TIS and the mismatch metrics read; values from the
engine's batch-invariant forward over the rollout's tokens, gradient from the QAT forward) against the rollout's
log-probs of the same tokens, with torch.equal; and the logged metrics (k3 and max |dlp| exactly 0, no record, zero
guidance bytes; k3_grad, the k3 of the QAT forward whose gradient the step takes, above 0). On a CPU both sides run the kernels in the Triton interpreter (float32), on a GPU compiled (bf16,
CUDA-graph decode) on the small flavors of all four families.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.rl.conftest import small_cfg
from trace.config import ConfigError
from trace.rl.losses import mismatch_metrics
from trace.rl.trainer import RLTrainer


def _spy(tr):
    """Wrap the trainer's log-probs: keeps (log-probs, rollout log-probs, mask, pinned forward's log-probs) of each
    step."""
    seen, orig = [], tr.logprobs

    def spy(sub, rows, **kw):
        out = orig(sub, rows, **kw)
        lp = out.lp
        assert lp.requires_grad and lp.grad_fn is not None  # the QAT forward's gradient flows through
        assert out.stats is None and out.engine_s > 0  # no record: values from the engine's scoring
        seen.append((lp.detach().clone(), sub.lp_roll.clone(), sub.mask.clone(), out.grad_lp.clone()))
        return out

    tr.logprobs = spy
    return seen


def _check_run(out, seen, steps):
    assert len(seen) == steps
    for lp, roll, mask, _ in seen:
        assert mask.any() and torch.equal(lp[mask], roll[mask])
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r["step"] >= 1 and "k3" in r]
    assert len(recs) == steps
    for r, (_, roll, mask, g) in zip(recs, seen, strict=True):
        assert r["method"] == "exact" and r["k3"] == 0.0 and r["k1"] == 0.0 and r["dlp_abs_max"] == 0.0
        # k3_grad: the differentiated QAT forward's own log-probs against the rollout's, which k3 does not see
        assert r["k3_grad"] == pytest.approx(mismatch_metrics(g, roll, mask)["k3"]) and r["k3_grad"] > 0
        assert r["ratio_out_frac"] == 0.0 and r["guidance_bytes_per_gen_token"] == 0.0
        assert r["guidance_bits_per_element"] is None and r["code_flip_rate"] == {} and r["record_overhead"] == 0.0
        assert r["time_exact_score_s"] > 0 and r["loss"] == r["loss"] and r["grad_norm"] == r["grad_norm"]
    assert (out / "done").exists()


@pytest.mark.slow
def test_exact_arm_steps_on_cpu(tmp_path, sft_ckpt):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the exact arm on a CPU runs the kernels in the Triton interpreter (tests/conftest.py sets it)")
    cfg = small_cfg(["rl.method=exact", "rl.steps=2", "rl.prompts_per_step=2", "rl.group_size=2",
                     "rl.max_new_tokens=4", "rl.ckpt_every=2", "rl.eval_every=0"], init_ckpt=sft_ckpt)
    tr = RLTrainer(cfg, tmp_path / "exact", progress=False)
    assert tr.engine.batch_invariant and tr.method.exact and tr.method.records() == (False, False)
    assert tr.model._trace_rt.mode == "w4a4kv4"  # the QAT forward that gives the gradient
    seen = _spy(tr)
    tr.run()
    _check_run(tmp_path / "exact", seen, 2)


def test_exact_arm_on_cpu_needs_the_interpreter(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = small_cfg(["rl.method=exact", "rl.steps=1"])
    with pytest.raises(ConfigError, match="TRITON_INTERPRET"):
        RLTrainer(cfg, tmp_path / "x", progress=False)
    assert not (tmp_path / "x").exists()  # rejected before anything is written
    with pytest.raises(ConfigError, match="NVFP4"):
        small_cfg(["rl.method=exact", "rl.fmt=mxfp4"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe"])
def test_exact_arm_on_gpu_small_flavors(tmp_path, family):
    """One RL step of the exact arm per small family (random init, reasoning, 16 prompts x 4 samples x 64 tokens):
    the trainer's log-probs equal the rollout's bit for bit over a batch of real rollouts."""
    cfg = small_cfg([f"model={family}-small", "device=cuda", "rl.method=exact", "rl.steps=1", "task.name=reasoning",
                     "task.difficulty=medium", "rl.prompts_per_step=16", "rl.group_size=4", "rl.max_new_tokens=64",
                     "rl.eval_every=0", "rl.ckpt_every=1"])
    tr = RLTrainer(cfg, tmp_path / family, progress=False)
    seen = _spy(tr)
    tr.run()
    _check_run(tmp_path / family, seen, 1)
