"""Plumbing of one RL step per arm: the right engine/trainer modes, records, metrics keys, and the
non-finite guard (step not applied, last checkpoint kept)."""
from __future__ import annotations

import json

import pytest
import torch

from tests.rl.conftest import small_cfg
from trace import rundir
from trace.arms import ARMS
from trace.episode import run_episode
from trace.guidance.align import MARGIN
from trace.rl.trainer import NonFiniteError, RLTrainer, build_train_batch

KEYS = ("step", "reward_mean", "accuracy", "response_len", "k1", "k3", "dlp_abs_mean", "dlp_abs_max",
        "ratio_out_frac", "chi2", "code_flip_rate", "scale_flip_rate", "unrecoverable_rate", "routing_flip_rate",
        "guidance_bytes_per_gen_token", "guidance_bits_per_element", "rollout_gen_tokens_per_s", "record_overhead",
        "time_rollout_s", "time_score_s", "time_train_s", "time_step_s",
        "loss", "grad_norm")


@pytest.mark.parametrize("method", sorted(m for m, a in ARMS.items() if not a.exact))  # exact: tests/rl/test_exact.py
def test_one_step_each_arm(tmp_path, method, sft_ckpt):
    extra = {"fp4-naive": ["rl.ppo_ratio=rollout"], "qat-weight-only": ["rl.icepop=[0.5, 2.0]", "rl.tis_cap=null"],
             "bf16": ["rl.kl_coef=0.05"]}
    cfg = small_cfg([f"rl.method={method}", "rl.steps=1", "rl.prompts_per_step=8",
                     *extra.get(method, ["rl.advantage=rloo"])], init_ckpt=sft_ckpt)
    tr = RLTrainer(cfg, tmp_path / method, progress=False)
    arm = ARMS[method]
    assert tr.engine.mode == arm.engine_mode and tr.engine.kv_fp4 == arm.kv_fp4
    assert tr.model._trace_rt.mode == arm.trainer_mode
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    recs = tr.run()
    rec = json.loads((tmp_path / method / "metrics.jsonl").read_text().splitlines()[-1])
    for k in KEYS:
        assert k in rec, k
    assert rec["step"] == 1 and 0.0 <= rec["accuracy"] <= 1.0
    assert all(v == v for v in (rec["k3"], rec["loss"], rec["grad_norm"]))
    # the trainer (BF16 autocast, FP4 fake quantization in the FP4 arms) never gives the FP32 engine's log-probs bit
    # for bit: a zero mismatch would mean the metrics compared one side's log-probs with themselves
    assert rec["k3"] > 0 and rec["dlp_abs_mean"] > 0
    changed = any(not torch.equal(before[k], v) for k, v in tr.model.state_dict().items())
    assert changed, "the optimizer step changed nothing"
    assert rec["rollout_gen_tokens_per_s"] > 0
    assert rec["gpu_peak_alloc_gb"] is None and rec["gpu_peak_reserved_gb"] is None  # on the CPU
    if method in ("qat-independent", "trace", "trace-fullcodes", "trace-noalign", "trace-noroutingreplay"):
        # one diagnostic for every arm whose trainer quantizes activations: all layers, routing too
        assert {int(k) for k in rec["code_flip_rate"]} == {0, 1, 2, 3}
        assert {int(k) for k in rec["routing_flip_rate"]} == {0, 1, 2, 3}
    else:
        assert rec["code_flip_rate"] == {}
    if method.startswith("trace"):
        assert rec["guidance_bytes_per_gen_token"] > 0 and rec["guidance_bits_per_element"] > 1
        assert rec["record_overhead"] > 0
    else:
        assert rec["guidance_bytes_per_gen_token"] == 0.0 and rec["guidance_bits_per_element"] is None
        assert rec["record_overhead"] == 0.0  # a diagnostic record is never timed as the arm's own
    if method == "trace-fullcodes":
        # the full-codes replay feeds the guided layers the rollout's own codes: nothing is left unrecoverable
        assert rec["unrecoverable_rate"] and set(rec["unrecoverable_rate"]) <= {"0", "1", "2", "3"}
        assert all(v == 0.0 for v in rec["unrecoverable_rate"].values()), rec["unrecoverable_rate"]
    if ARMS[method].align and ARMS[method].record == "guide":
        # step 1 splits the gradient: the norm of the sum lies between the difference and the sum of the parts
        a, r, g = rec["grad_norm_align"], rec["grad_norm_rest"], rec["grad_norm"]
        assert a > 0 and r > 0 and abs(a - r) * (1 - 1e-4) <= g <= (a + r) * (1 + 1e-4), (a, r, g)
        # the term's element and block-scale parts (NVFP4): shares of its sum
        assert abs(rec["align_codes_share"] + rec["align_scales_share"] - 1) < 1e-6
        # a flipped item lies outside the rollout's interval (distance d <= 0 past its boundary), so its hinge
        # relu(margin - d)^2 is at least margin^2: a part's mean hinge over its flipped items is >= margin^2, or 0
        # where the part has none (share 0); the code part has flipped elements at step 1
        margin2 = MARGIN ** 2  # the trainer's margin (the replay's default)
        assert rec["align_codes_share"] > 0 and rec["align_codes_hinge"] >= margin2 * (1 - 1e-4), rec
        assert (rec["align_scales_hinge"] >= margin2 * (1 - 1e-4) if rec["align_scales_share"] > 0
                else rec["align_scales_hinge"] == 0.0), rec
        assert set(rec["align_scales_hinge_layer"]) <= {"0", "1", "2", "3"}  # per guided layer
    else:
        assert "grad_norm_align" not in rec
    assert (tmp_path / method / "done").exists()
    assert rundir.latest_checkpoint(tmp_path / method) is not None
    assert len(recs) == 1


def test_trace_with_all_layers_guided_cuts_mismatch(tmp_path, sft_ckpt):
    """rho = 1 with routing replay: the trainer sees the rollout's FP4 operands everywhere, so the
    mismatch falls far below the unguided trainer's on the same prompts and seed."""
    out = {}
    for m, rho in (("qat-independent", 0.5), ("trace", 1.0)):
        cfg = small_cfg([f"rl.method={m}", f"rl.rho={rho}", "rl.steps=1", "rl.prompts_per_step=8"], init_ckpt=sft_ckpt)
        out[m] = RLTrainer(cfg, tmp_path / m, progress=False).step(1).to_dict()
    assert out["trace"]["k3"] < 0.2 * out["qat-independent"]["k3"], (out["trace"]["k3"], out["qat-independent"]["k3"])
    assert out["trace"]["dlp_abs_mean"] < out["qat-independent"]["dlp_abs_mean"]


def test_recompute_experts_repeats_the_step_exactly(tmp_path, sft_ckpt):
    """rl.recompute_experts trades memory for a second expert forward: the same step (rollout, loss, gradient
    norm, the alignment term's split) and bit-identical weights after it."""
    out = {}
    for on in (False, True):
        cfg = small_cfg(["rl.method=trace", "rl.steps=1", "rl.prompts_per_step=8", f"rl.recompute_experts={on}"],
                        init_ckpt=sft_ckpt)
        tr = RLTrainer(cfg, tmp_path / str(on), progress=False)
        assert tr.model._trace_rt.recompute_experts is on
        rec = tr.step(1).to_dict()
        out[on] = (rec, {k: v.clone() for k, v in tr.model.state_dict().items()})
    (r0, w0), (r1, w1) = out[False], out[True]
    for k in ("reward_mean", "k3", "loss", "grad_norm", "grad_norm_align", "grad_norm_rest", "align_loss"):
        assert r0[k] == r1[k], k
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


def test_train_batch_alignment(tmp_path, sft_ckpt):
    """Trainer log-probs line up with the rollout's: with the trainer in FP32 (no autocast) and the
    engine in FP32, the bf16 arm's log-probs agree to float rounding on every trainable token."""
    cfg = small_cfg(["rl.method=bf16", "rl.autocast=none"], init_ckpt=sft_ckpt)
    tr = RLTrainer(cfg, tmp_path / "r", progress=False)
    ex = tr._prompts_for(1)
    batch = run_episode(tr.engine, tr.task, tr.tok, ex, n=3, seed=5, temperature=1.0, max_new_tokens=5,
                        max_turns=1).batch
    tb = build_train_batch(batch, tr.tok.pad_token_id)
    from trace.rl.trainer import token_logprobs
    with torch.no_grad():
        lp = token_logprobs(tr.model, tb, autocast=False)
    assert int(tb.mask.sum()) == sum(sum(t) for t in batch.trainable)
    torch.testing.assert_close(lp[tb.mask], tb.lp_roll[tb.mask], atol=1e-4, rtol=0)
    # every input position is addressed, padding is -1
    assert bool(((tb.pos >= 0) == tb.att.bool()).all())


def test_nonfinite_stops_step_and_keeps_checkpoint(tmp_path, monkeypatch, sft_ckpt):
    cfg = small_cfg(["rl.method=trace", "rl.steps=4", "rl.ckpt_every=2"], init_ckpt=sft_ckpt)
    tr = RLTrainer(cfg, tmp_path / "nf", progress=False)
    orig = RLTrainer.step

    def poisoned(self, step):
        if step == 3:  # the trainer's weights go bad after the engine synced: its forward must catch it
            with torch.no_grad():
                self.model.lm_head.weight[5, 0] = float("nan")
            self._poison_snapshot = {k: v.clone() for k, v in self.model.state_dict().items()}
        return orig(self, step)

    monkeypatch.setattr(RLTrainer, "step", poisoned)
    with pytest.raises(NonFiniteError) as ei:
        tr.run()
    msg = str(ei.value)
    assert "RL step 3" in msg and "non-finite" in msg and "step not applied" in msg
    assert "step_000002" in msg
    # nothing was applied: parameters are exactly the poisoned snapshot (no optimizer step)
    for k, v in tr.model.state_dict().items():
        assert torch.equal(v, tr._poison_snapshot[k]) or (torch.isnan(v).any() and k.startswith("lm_head"))
    recs = rundir.read_metrics(tmp_path / "nf" / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2]
    latest = rundir.latest_checkpoint(tmp_path / "nf")
    assert latest.name == "step_000002"
    from safetensors.torch import load_file
    sd = load_file(str(latest / "model.safetensors"))
    assert all(bool(torch.isfinite(t).all()) for t in sd.values())
    assert not (tmp_path / "nf" / "done").exists()


def test_nonfinite_loss_guard(tmp_path, monkeypatch):
    """A NaN that appears only in the loss (e.g. an advantage) is caught before backward/step."""
    cfg = small_cfg(["rl.method=bf16", "rl.steps=1"])
    tr = RLTrainer(cfg, tmp_path / "nl", progress=False)
    import trace.rl.trainer as T
    monkeypatch.setattr(T, "compute_advantages", lambda *a, **k: torch.full_like(a[1], float("nan"), dtype=torch.float32))
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    with pytest.raises(NonFiniteError, match="non-finite loss"):
        tr.step(1)
    assert all(torch.equal(before[k], v) for k, v in tr.model.state_dict().items())


def test_nonfinite_trainer_logits(tmp_path, sft_ckpt):
    """The engine is clean (it holds its own copy), the trainer's forward goes NaN: caught by the
    trainer's logits check, before any backward or optimizer step."""
    import copy
    cfg = small_cfg(["rl.method=bf16", "rl.steps=1"], init_ckpt=sft_ckpt)
    tr = RLTrainer(cfg, tmp_path / "nt", progress=False)
    tr.engine.sync_weights(copy.deepcopy(tr.model))
    with torch.no_grad():
        tr.model.model.norm.weight[3] = float("inf")
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    with pytest.raises(NonFiniteError, match="non-finite logits in the trainer forward"):
        tr.step(1)
    for k, v in tr.model.state_dict().items():
        assert torch.equal(v, before[k])
    assert all(p.grad is None for p in tr.model.parameters())


@pytest.mark.parametrize("task", ["long_horizon", "coding"])
def test_step_other_tasks(tmp_path, task):
    """Multi-turn (environment tokens masked out of the loss) and sandboxed coding rewards run end to end."""
    cfg = small_cfg([f"task.name={task}", "rl.method=trace", "rl.steps=1", "rl.max_new_tokens=4",
                     "rl.prompts_per_step=2", "rl.group_size=2", "rl.max_turns=3"])
    tr = RLTrainer(cfg, tmp_path / task, progress=False)
    ex = tr._prompts_for(1)
    ep = run_episode(tr.engine, tr.task, tr.tok, ex, n=2, seed=3, temperature=1.0, max_new_tokens=4, max_turns=3)
    batch, scores = ep.batch, ep.scores
    assert len(scores) == 4 and all(0.0 <= s <= 1.0 for s in scores)
    tb = build_train_batch(batch, tr.tok.pad_token_id)
    assert int(tb.mask.sum()) == sum(sum(t) for t in batch.trainable)
    if task == "long_horizon" and any(batch.turns):
        assert any(not all(t) for t in batch.trainable), "environment tokens must be non-trainable"
    rec = tr.step(1).to_dict()
    assert rec["k3"] is not None and rec["n_tokens"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("task", ["long_horizon", "coding"])
def test_gpu_step_other_tasks(tmp_path, task):
    """The small profile's other tasks on the GPU path (BF16 engine with the FP4 kernels and CUDA graphs,
    BF16-autocast trainer), which their reasoning runs exercise but the multi-turn episodes and the coding
    sandbox do not: one trace step each, with the guidance replayed (in scripts/gpu/gpu_tests.sh's suite)."""
    cfg = small_cfg([f"task.name={task}", "rl.method=trace", "rl.steps=1", "rl.max_new_tokens=8",
                     "rl.prompts_per_step=4", "rl.group_size=2", "rl.max_turns=3", "device=cuda"])
    tr = RLTrainer(cfg, tmp_path / task, progress=False)
    rec = tr.step(1).to_dict()
    assert rec["n_tokens"] > 0 and rec["guidance_bytes_per_gen_token"] > 0
    assert all(torch.isfinite(torch.tensor(float(rec[k]))) for k in ("k3", "loss", "grad_norm"))
    assert 0 < rec["gpu_peak_alloc_gb"] <= rec["gpu_peak_reserved_gb"]


def test_wandb_offline_mirror(tmp_path):
    pytest.importorskip("wandb")
    cfg = small_cfg(["rl.method=bf16", "rl.steps=1", "wandb.mode=offline"])
    RLTrainer(cfg, tmp_path / "w", progress=False).run()
    assert list((tmp_path / "w").glob("wandb/offline-run-*")), "no offline wandb run written"
    assert len(rundir.read_metrics(tmp_path / "w" / "metrics.jsonl")) == 1


def test_build_train_batch_multiturn_masks():
    """Hand-made multi-turn batch: env tokens in the middle are inputs but not targets; env tokens
    after the last action are dropped (never needed, maybe never fed to the engine)."""
    from trace.rollout import RolloutBatch
    # sample 0: prompt [1,10,11], action [20,4], env [30,31], action [21,4], env [32,33] (final obs)
    # sample 1: prompt [1,10,11], action [22,23,4]
    toks = [[1, 10, 11, 20, 4, 30, 31, 21, 4, 32, 33], [1, 10, 11, 22, 23, 4]]
    tr = [[True, True, False, False, True, True, False, False], [True, True, True]]
    lp = [[-0.1, -0.2, 0.0, 0.0, -0.3, -0.4, 0.0, 0.0], [-0.5, -0.6, -0.7]]
    b = RolloutBatch(toks, [3, 3], lp, tr, [0, 0], [7, 8], [True, True], ["env_done", "stop_string"], 7, 0.0)
    tb = build_train_batch(b, pad_id=0)
    assert tb.ids.shape == (2, 8)  # sample 0 inputs end before its last action token (index 8)
    assert tb.ids[0].tolist() == [1, 10, 11, 20, 4, 30, 31, 21]
    assert tb.tgt[0].tolist() == [10, 11, 20, 4, 30, 31, 21, 4]
    assert tb.mask[0].tolist() == [False, False, True, True, False, False, True, True]
    assert tb.lp_roll[0].tolist() == pytest.approx([0, 0, -0.1, -0.2, 0, 0, -0.3, -0.4])
    assert tb.pos[1].tolist() == [0, 1, 2, 3, 4, -1, -1, -1] and tb.seq.tolist() == [7, 8]
    assert tb.mask[1].tolist() == [False, False, True, True, True, False, False, False]
