"""The policy actor's step on one micro-batch, outside Ray, for the ZeRO-3 tests (test_actor_zero3.py at world size
1 in-process, test_world_size_2.py over two gloo ranks): the records the rollout actor ships per sample, the
log-probs, and one training step under the arm's replay."""
import torch

from trace.arms import ARMS
from trace.guidance import arm_recorders
from trace.integrations.openrlhf.records import split_record
from trace.integrations.openrlhf.rollout import DIAG_KEY, RECORD_KEY
from trace.models import build_model
from trace.qat import patch_model, recording

B, T = 2, 12
THRESHOLD = 0  # partition every parameter (DeepSpeed's default, 1e5 elements, partitions none of a tiny model)


def ds_config(micro_batch: int = B) -> dict:
    """The DeepSpeed config of the tests: ZeRO-3 with every parameter partitioned, BF16, AdamW."""
    return {"train_micro_batch_size_per_gpu": micro_batch, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": THRESHOLD},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}


def rollout_records(name, cfg, ids):
    """What the rollout actor ships per sample: {RECORD_KEY, DIAG_KEY: record} as the arm takes them,
    recorded from a float32 forward (the stand-in for the engine's rollout) of ids [B, T]."""
    arm, rl = ARMS[cfg["rl"]["method"]], cfg["rl"]
    roll = build_model(name, seed=0)
    patch_model(roll, arm.trainer_mode, rl["fmt"])
    n, t = ids.shape
    seq, pos = torch.arange(n), torch.arange(t).expand(n, t)
    out = [{} for _ in range(n)]
    recs = arm_recorders(arm, roll.config.num_hidden_layers, rl["rho"], rl["diag_flips"])
    for key, r in zip((RECORD_KEY, DIAG_KEY), recs, strict=True):
        if r is None:
            continue
        with torch.no_grad(), recording(roll, r, seq, pos):
            roll(input_ids=ids)
        for m, one in zip(out, split_record(r.finish(), n), strict=True):
            m[key] = one
    return out if any(out) else None


def logprobs(model, ids, att):
    lp = torch.log_softmax(model(input_ids=ids, attention_mask=att).logits.float(), -1)
    return lp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, T-1]


def train_step(tr, model, ids, mm, backward):
    """The actor on one micro-batch: the old log-probs (no grad), then the training step: log-probs
    [B, T-1] under the arm's replay, backward of -mean(lp) (+ alignment) with the replay still open;
    (old lp, lp, alignment, flip rates)."""
    att = torch.ones_like(ids)
    with torch.no_grad(), tr.context(model, mm, att):
        old = logprobs(model, ids, att)
    with tr.context(model, mm, att) as st:
        lp = logprobs(model, ids, att)
        loss = -lp.mean()
        al = tr.method.alignment(st)
        al = None if al is None else al.term
        if al is not None:
            loss = loss + al
        backward(loss)
    flips = None if st is None else st.summary().get("code_flip_rate")
    return old, lp.detach(), None if al is None else float(al), flips
