"""The train step (trace/rl/trainstep.py): one RL step in micro-batches against the same step on the whole batch.

What is compared: two trainers built from the same SFT checkpoint and config roll out the same batch (8 sequences;
prompts and seeds derive from (seed, step)); one trains on it in one forward, the other in chunks of 4 (two
micro-batches) or 3 (3 + 3 + 2); the trainer's weights are moved off the engine's by the same seeded noise in
both, so the FP4 arms' rounding disagrees with the rollout's (flips, alignment term). The accumulated parameter
gradients (read just before clipping) must be allclose in float32 (autocast off) and every logged metric equal or
allclose: mismatch (k1, k3, ...), loss and its parts, TIS / ICEPOP fractions, KL, flip rates, the alignment term and
its parts, guidance bytes, gradient norms. The arms cover the whole-batch normalizations: token means (bf16 with KL,
fp4-naive with the rollout as PPO's old policy), reinforce_baseline's whitening over the batch (qat-independent, flip
statistics from the diagnostic record), and TRACE's record lookup per chunk with the alignment term's mean over all
guided items and its gradient split (trace, step 1). The exact arm refuses micro-batches (config error).
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.rl.conftest import small_cfg
from trace.config import ConfigError
from trace.rl.trainer import RLTrainer, build_train_batch
from trace.rl.trainstep import chunks, sub_batch

SKIP = ("time_", "rollout_gen_tokens_per_s", "record_overhead", "gpu_peak")


def _step(tmp_path, name, extra, micro):
    """Step 1 with rl.micro_batch=micro; returns (metrics, {param name: gradient before clipping})."""
    cfg = small_cfg(["rl.steps=1", "rl.prompts_per_step=2", "rl.group_size=4", "rl.autocast=none",
                     *extra, *([f"rl.micro_batch={micro}"] if micro is not None else [])], init_ckpt=_step.ckpt)
    tr = RLTrainer(cfg, tmp_path / f"{name}-{micro}", progress=False)
    # the trainer's weights moved off the engine's by 1% seeded noise (the same in every trainer): its rounding then
    # disagrees with the rollout's, so flips, the alignment term and the mismatch are non-zero in float32
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in tr.model.parameters():
            p.mul_(1 + 0.01 * torch.randn(p.shape, generator=g))
    grads, apply = {}, tr.train.apply

    def spy():
        grads.update({n: p.grad.detach().clone() for n, p in tr.model.named_parameters() if p.grad is not None})
        return apply()

    tr.train.apply = spy
    return tr.step(1).to_dict(), grads


def _grad_close(g, ref, key):
    """Float32 summation order differs between one forward and several: elementwise within 1e-5 of the
    tensor's largest entry (a wrong normalization is off by a factor of the entry itself)."""
    err, scale = float((g - ref).abs().max()), float(ref.abs().max())
    assert err <= 1e-5 * scale + 1e-9, (key, err, scale)


def _close(a, b, key):
    if isinstance(a, dict):
        assert set(a) == set(b), key
        for k in a:
            _close(a[k], b[k], f"{key}.{k}")
    elif isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=5e-6), (key, a, b)  # float32 log-prob noise: ~1e-6
    else:
        assert a == b, (key, a, b)


ARMS = {
    "bf16": ["rl.method=bf16", "rl.kl_coef=0.05"],
    "fp4-naive": ["rl.method=fp4-naive", "rl.ppo_ratio=rollout"],
    "qat-independent": ["rl.method=qat-independent", "rl.advantage=reinforce_baseline"],
    "trace": ["rl.method=trace"],
}


# ~20-35 s per arm on 2 busy cores (three trainers each): trace, the arm with every whole-batch normalization, in
# the default run, the others slow
@pytest.mark.parametrize("arm", [a if a == "trace" else pytest.param(a, marks=pytest.mark.slow) for a in ARMS])
def test_micro_batches_give_the_whole_batch_step(tmp_path, arm, sft_ckpt):
    _step.ckpt = sft_ckpt
    ref, g_ref = _step(tmp_path, arm, ARMS[arm], None)
    assert ref["n_tokens"] > 0 and g_ref
    for micro in (4, 3):
        rec, g = _step(tmp_path, arm, ARMS[arm], micro)
        assert set(g) == set(g_ref)
        for n in g_ref:
            _grad_close(g[n], g_ref[n], f"{micro}:{n}")
        assert set(rec) == set(ref)
        for k in ref:
            if not k.startswith(SKIP):
                _close(ref[k], rec[k], f"{micro}:{k}")
    if arm == "trace":  # the alignment term and its gradient split were in the step
        assert ref["align_loss"] > 0 and ref["grad_norm_align"] > 0 and ref["guidance_bytes_per_gen_token"] > 0
    if arm == "qat-independent":
        assert ref["code_flip_rate"]  # flip statistics merged over the chunks


def test_chunks_and_sub_batch(tmp_path, sft_ckpt):
    assert chunks(8, 3) == [range(0, 3), range(3, 6), range(6, 8)] and chunks(8, 8) == [range(0, 8)]
    cfg = small_cfg(["rl.steps=1", "rl.prompts_per_step=2", "rl.group_size=4"], init_ckpt=sft_ckpt)
    tr = RLTrainer(cfg, tmp_path / "c", progress=False)
    from trace.episode import run_episode
    ep = run_episode(tr.engine, tr.task, tr.tok, tr._prompts_for(1), n=4, max_new_tokens=4, temperature=1.0,
                     seed=3, max_turns=1)
    tb = build_train_batch(ep.batch, tr.tok.pad_token_id)
    for r in chunks(8, 3):
        s = sub_batch(tb, r)
        T = s.ids.shape[1]
        assert T == int(tb.att[r.start: r.stop].sum(1).max()) and torch.equal(s.seq, tb.seq[r.start: r.stop])
        assert torch.equal(s.mask, tb.mask[r.start: r.stop, :T]) and not tb.mask[r.start: r.stop, T:].any()


def test_micro_batch_config():
    assert small_cfg(["rl.micro_batch=4"])["rl"]["micro_batch"] == 4
    assert small_cfg()["rl"]["micro_batch"] is None  # the default: the whole batch
    with pytest.raises(ConfigError, match="micro_batch"):
        small_cfg(["rl.micro_batch=-1"])


def test_exact_arm_refuses_micro_batches():
    with pytest.raises(ConfigError, match="micro_batch"):
        small_cfg(["rl.method=exact", "rl.micro_batch=2"])
