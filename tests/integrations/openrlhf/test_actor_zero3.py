"""`prepare_for_qat` under DeepSpeed ZeRO-3 with every parameter partitioned
(`stage3_param_persistence_threshold: 0`: DeepSpeed releases and re-gathers each one around every
module, as it does on a real model), for the arms bf16, qat-independent (trainer mode w4a4kv4) and
trace (qwen3_moe; trace also on qwen2_moe, whose shared expert is a second kind of leaf). The records
are what the rollout actor ships per sample (`arm_recorders`, recorded from a float32 forward, split
per sample); the step is the policy actor's: `TraceReplay.context` open across forward and backward,
the alignment term added for trace, then the optimizer step.

Compared against the same patched model in BF16 outside DeepSpeed under the same replay:
- log-probs agree to 1e-3 (measured: exactly equal on this CPU). ZeRO-3 runs the same BF16 tensors
  through its own linear autograd function (`input.matmul(weight.t())` instead of `F.linear`), which
  other kernels may round differently by an ulp; the bound leaves room for that, far below the
  FP4-vs-BF16 mismatch the metrics measure;
- the alignment term and the per-layer code flip rates agree (to 1e-3 relative / absolute), i.e.
  every site was quantized and looked up once per forward, as outside DeepSpeed;
- every gradient agrees to 2% of its norm (measured: exactly equal; DeepSpeed reduces BF16 gradients
  in FP32 and may sum in another order on other machines) and every attention parameter gets one
  and moves in the step. Without `prepare_for_qat`'s keyword-input hook the attention's ZeRO-3 leaf
  hook fires before the attention's backward and the backward raises "The size of tensor a (0) must
  match the size of tensor b (...)".
Run: `python -m pytest tests/integrations/openrlhf/test_actor_zero3.py -n 0` (about 15 s).
"""
import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

from zero3_steps import B, T, ds_config, rollout_records, train_step  # noqa: E402

from trace import config as C  # noqa: E402
from trace.arms import ARMS  # noqa: E402
from trace.integrations.openrlhf.actor import TraceReplay, prepare_for_qat  # noqa: E402
from trace.models import build_model  # noqa: E402
from trace.qat import patch_model  # noqa: E402

LP_TOL = 1e-3
GRAD_REL_TOL = 2e-2
# (model, arm): the three arms on qwen3_moe; trace also on qwen2_moe, whose shared expert's gate/up
# share one input (a second kind of ZeRO-3 leaf)
CASES = [("qwen3_moe-tiny", a) for a in ("bf16", "qat-independent", "trace")] + [("qwen2_moe-tiny", "trace")]


@pytest.mark.parametrize("name,arm", CASES)
def test_zero3_partitioned_step_matches_unwrapped(gloo, name, arm):
    cfg = C.load_config(None, [f"model={name}", f"rl.method={arm}"])
    mode, fmt = ARMS[arm].trainer_mode, cfg["rl"]["fmt"]
    ids = torch.randint(5, 100, (B, T), generator=torch.Generator().manual_seed(1))
    mm = rollout_records(name, cfg, ids)
    tr = TraceReplay(cfg)

    ref = build_model(name, seed=0, dtype=torch.bfloat16)
    patch_model(ref, mode, fmt)
    old_ref, lp_ref, al_ref, flips_ref = train_step(tr, ref, ids, mm, lambda loss: loss.backward())

    model = build_model(name, seed=0, dtype=torch.bfloat16)
    prepare_for_qat(model, mode, fmt, zero_stage=3)
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config())
    names = [n for n, _ in model.named_parameters()]
    assert all(p.numel() == 0 for p in model.parameters())  # every parameter partitioned and released
    old, lp, al, flips = train_step(tr, model, ids, mm, eng.backward)

    print(f"{name} {arm}: max|dlp| {float((lp - lp_ref).abs().max()):.3e}; align {al} vs {al_ref}; "
          f"code flips {flips} vs {flips_ref}")
    assert (lp - lp_ref).abs().max() < LP_TOL and (old - old_ref).abs().max() < LP_TOL
    assert (al is None) == (al_ref is None) == (arm != "trace")
    if al is not None:
        assert al == pytest.approx(al_ref, rel=1e-3, abs=1e-6) and al_ref > 0
    assert (flips is None) == (flips_ref is None) == (arm == "bf16")
    if flips is not None:
        assert sorted(flips) == sorted(flips_ref) and all(abs(flips[i] - flips_ref[i]) < 1e-3 for i in flips)
    ref_grads = dict(ref.named_parameters())
    before, worst = {}, 0.0
    for n, p in zip(names, model.parameters(), strict=True):
        got, want = deepspeed.utils.safe_get_full_grad(p), ref_grads[n].grad
        assert (got is None) == (want is None), n
        if want is None:
            continue
        rel = float((got - want.float()).norm() / want.float().norm().clamp_min(1e-12))
        worst = max(worst, rel)
        assert rel <= GRAD_REL_TOL or want.float().norm() < 1e-6, n
        if ".self_attn." in n:
            assert got.abs().sum() > 0, n
        before[n] = deepspeed.utils.safe_get_full_fp32_param(p).clone()
    print(f"{name} {arm}: largest relative gradient difference {worst:.3e}")
    eng.step()
    moved = {n for n, p in zip(names, model.parameters(), strict=True)
             if n in before and not torch.equal(deepspeed.utils.safe_get_full_fp32_param(p), before[n])}
    assert {n for n in before if ".self_attn." in n} <= moved
