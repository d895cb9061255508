"""The embedded trainer and the OpenRLHF path agree on the first step's log-probs and loss.

One batch (trace arm: W4A4 + FP4 KV rollout with records, rho 0.5) from our engine through
OpenRLHF's own executor and its `_process_response_into_experience` / `concat_experiences`, then
the first training step's action log-probs and policy loss (+ alignment term) computed
(a) the embedded way: FP32 master weights under BF16 autocast, `trace.qat.replay`, `token_logprobs`,
    `trace.rl.losses.policy_loss` (what `RLTrainer._step` does), and
(b) the OpenRLHF way: OpenRLHF's `Actor` in BF16 patched by `prepare_for_qat`, replay through the
    plugin's `TraceReplay.context` from the experience's record handles, OpenRLHF's `PolicyLoss`
    with the TIS flags the launcher passes.
With the embedded trainer's functions on BF16 weights (the plumbing alone: record batching and
addressing, replay, loss) the two agree to rounding: measured max |dlogprob| 4.8e-7, losses equal to
6 digits (asserted: 1e-4, 1e-5). With its FP32 master weights under autocast (what RLTrainer runs)
the non-matmul ops run in FP32 instead of BF16 and the unguided layers re-round: measured max
|dlogprob| 0.078, mean 0.019 (asserted: 0.15, 0.03); loss 0.0359 vs 0.0122 (asserted: 5e-2): the
alignment term's block-scale hinge counts the scale bytes the FP32 arithmetic rounds differently, so the
FP32 loss moves more than the log-probs (0.0089 vs 0.0029 with the earlier code-only midpoint term).
The BF16 engine's records match a BF16 trainer; see docs/openrlhf.md.
Flip statistics: the plugin's replay measures them against the diagnostic record of all layers that
rides beside the guidance record, as the embedded trainer does; on the same BF16 weights both give
per-layer code flip rates (the trainer's own RTN code before guidance vs the rollout's) for every
layer that agree to 0.01.
"""
import asyncio

import pytest
import torch

from trace import config as C
from trace.integrations.openrlhf import stand_ins
from trace.integrations.openrlhf.actor import TraceReplay, prepare_for_qat
from trace.integrations.openrlhf.launch import REWARD_FILE
from trace.integrations.openrlhf.rollout import DIAG_KEY, RECORD_KEY, TraceRolloutEngine
from trace.models import build_model, build_tokenizer, load_checkpoint, save_checkpoint
from trace.qat import patch_model, replay
from trace.rl.losses import compute_advantages, policy_loss
from trace.rl.trainer import TrainBatch, token_logprobs
from trace.tasks import get_task

stand_ins.install()
from openrlhf.models import Actor, PolicyLoss  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator  # noqa: E402
from vllm import SamplingParams  # noqa: E402

GROUP = 4
BF16_LP_TOL, BF16_LOSS_TOL = 1e-4, 1e-5
FP32_LP_TOL, FP32_LP_MEAN_TOL, FP32_LOSS_TOL = 0.15, 0.03, 5e-2
FLIP_TOL = 0.01


def test_first_step_logprobs_and_loss(tmp_path):
    torch.manual_seed(0)
    d = tmp_path / "model"
    save_checkpoint(build_model("qwen3_moe-tiny", seed=0), build_tokenizer(), d)
    # align_coef 0.1: FP32_LOSS_TOL bounds what FP32 master weights change (more flips, so a larger alignment
    # term) at this weight; the BF16 comparison is exact at any weight
    cfg = C.load_config(None, ["model=qwen3_moe-tiny", "rl.method=trace", "rl.max_new_tokens=6",
                               f"rl.group_size={GROUP}", "rl.align_coef=0.1"])
    rl = cfg["rl"]
    eng = TraceRolloutEngine(str(d), cfg, seed=5, remote_rm_url=[str(REWARD_FILE)])
    task = get_task("reasoning-short", difficulty="easy")
    responses = []
    for ex in task.make_split("train", 2, 0):
        responses += asyncio.run(eng.generate_responses(ex.prompt, ex.label, SamplingParams(max_tokens=6, logprobs=1),
                                                        64, eng.tok, num_samples=GROUP))
    exps = [SamplesGenerator._process_response_into_experience(None, r, max_len=64) for r in responses]
    b = Experience.concat_experiences(exps, eng.tok.pad_token_id)
    seqs, att, amask, lp_roll = b.sequences, b.attention_mask, b.action_mask.bool(), b.rollout_log_probs.float()
    # fixed 0/1 rewards so that the advantages (and the PPO term of the loss) are not all zero
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    adv = compute_advantages(rewards, amask, GROUP, rl["advantage"])

    # (b) OpenRLHF: its Actor (BF16), our patch + replay from the record handles, its PolicyLoss
    actor = Actor(str(d), attn_implementation="sdpa", param_dtype="bf16")
    prepare_for_qat(actor.model, "w4a4kv4", rl["fmt"], zero_stage=0)
    tr = TraceReplay(cfg)
    ploss = PolicyLoss(clip_eps_low=rl["clip_eps"], clip_eps_high=rl["clip_eps"], is_correction_level="token",
                       is_correction_mode="clip", is_correction_threshold=[0.0, rl["tis_cap"]])
    with tr.context(actor.model, b.mm_train_inputs, att) as st:
        lp_o = actor(seqs, amask, attention_mask=att).float()
        loss_o = ploss(lp_o, lp_o.detach(), adv, action_mask=amask, rollout_log_probs=lp_roll)[0]
        loss_o = tr.method.alignment(st).add_to(loss_o)  # + align_coef * the alignment term
    flips_o = st.summary()["code_flip_rate"]

    # (a) embedded: the trainer's functions on the same tokens and records, FP32 master weights under
    # BF16 autocast (RLTrainer) and, to isolate the plumbing, BF16 weights like OpenRLHF's
    from trace.integrations.openrlhf.records import batch_records
    B = seqs.shape[0]
    tgt = torch.cat([seqs[:, 1:], torch.zeros(B, 1, dtype=seqs.dtype)], 1)
    mask = torch.cat([amask, torch.zeros(B, 1, dtype=torch.bool)], 1)
    pos = torch.where(att.bool(), att.cumsum(-1) - 1, -1)
    tb = TrainBatch(seqs, att, tgt, pos, torch.arange(B), mask, torch.cat([lp_roll, torch.zeros(B, 1)], 1))
    rec = batch_records([m[RECORD_KEY] for m in b.mm_train_inputs])
    diag = batch_records([m[DIAG_KEY] for m in b.mm_train_inputs])
    out, flips_e = {}, {}
    for dtype in (torch.bfloat16, torch.float32):
        model, _ = load_checkpoint(d, dtype=dtype, load_tokenizer=False)
        patch_model(model, "w4a4kv4", rl["fmt"])
        with replay(model, rec, tb.seq, tb.pos, guide=True, routing=True, align=True, diag=diag) as st_e:
            lp_e = token_logprobs(model, tb, autocast=True)[:, :-1]
            loss_e, _ = policy_loss(lp_e, lp_e.detach(), adv, amask, lp_roll, clip_eps=rl["clip_eps"],
                                    tis_cap=rl["tis_cap"])
            loss_e = loss_e + rl["align_coef"] * st_e.alignment_loss()
        dlp = (lp_o - lp_e)[amask].abs()
        out[dtype] = (float(dlp.max()), float(dlp.mean()), float(loss_e))
        flips_e[dtype] = st_e.summary()["code_flip_rate"]
        print(f"embedded {dtype}: max|dlp| {out[dtype][0]:.3e} mean {out[dtype][1]:.3e}; loss {float(loss_e):.6f} "
              f"vs openrlhf {float(loss_o):.6f}")
    print(f"code flip rate per layer: openrlhf {flips_o}, embedded bf16 {flips_e[torch.bfloat16]}")
    assert sorted(flips_o) == sorted(flips_e[torch.bfloat16]) == [0, 1, 2, 3]
    assert all(abs(flips_o[i] - flips_e[torch.bfloat16][i]) < FLIP_TOL for i in flips_o)
    mx, mean, loss_bf16 = out[torch.bfloat16]
    assert mx < BF16_LP_TOL and loss_bf16 == pytest.approx(float(loss_o), abs=BF16_LOSS_TOL)
    mx, mean, loss_fp32 = out[torch.float32]
    assert mx < FP32_LP_TOL and mean < FP32_LP_MEAN_TOL
    assert loss_fp32 == pytest.approx(float(loss_o), abs=FP32_LOSS_TOL)
