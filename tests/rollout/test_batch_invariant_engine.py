"""The engine's batch-invariant mode (`RolloutEngine(batch_invariant=True)`, DESIGN.md §4 "Exact on-policy arm").

What is compared: the log-probs the engine reported for the tokens it sampled (decode steps, one token per row, rows
of the whole batch) against the log-probs of the same tokens from ONE full-sequence forward of the same engine
(`RolloutEngine.score`, the trainer's values in the exact arm), with torch.equal; and a prompt's greedy tokens and
log-probs decoded in a batch against the same prompt decoded alone. Both sides run the Triton kernels of
kernels/batch_invariant.py (on a CPU in the interpreter, float32; on a GPU compiled, bf16 with CUDA graphs).
"""
import os

import pytest
import torch
from rollout_helpers import FAMILIES, random_seqs, tiny

from trace.models import build_model
from trace.rollout import RolloutEngine


def _engine(model, **kw):
    eng = RolloutEngine(model.config, mode="w4a4", kv_fp4=True, batch_invariant=True, **kw)
    eng.sync_weights(model)
    return eng


def _assert_scored_equal(eng, out, prompts_per_sample):
    """Each sample's rollout log-probs equal the full-sequence forward's of the same tokens, bit for bit."""
    scored = eng.score(out.tokens, temperature=1.0)
    for b in range(len(out.tokens)):
        P = len(prompts_per_sample[b])
        roll = torch.tensor(out.logprobs[b], dtype=torch.float32)
        full = torch.tensor(scored[b][P - 1: P - 1 + len(roll)], dtype=torch.float32)
        assert len(roll) > 0 and torch.equal(roll, full), (b, float((roll - full).abs().max()))


@pytest.mark.slow
def test_batch_invariant_engine_scores_its_rollouts_bit_for_bit():
    """qwen3_moe-tiny in the interpreter (~25 s): 2 prompts x 2 samples x 3 tokens scored; greedy 2 tokens alone and
    in a batch of two."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU comparison runs the kernels in the Triton interpreter (tests/conftest.py sets it)")
    m = tiny("qwen3_moe")
    eng = _engine(m)
    prompts = random_seqs([4, 2], seed=4)
    out = eng.generate(prompts, n=2, max_new_tokens=3, temperature=1.0, seed=5)
    _assert_scored_equal(eng, out, [prompts[b // 2] for b in range(4)])
    alone = eng.generate(prompts[1:], max_new_tokens=2, temperature=0.0)  # greedy: no draw depends on the batch
    both = eng.generate(prompts, max_new_tokens=2, temperature=0.0)
    assert alone.tokens[0] == both.tokens[1] and alone.logprobs[0] == both.logprobs[1]


def test_batch_invariant_mode_needs_the_fp4_kernels():
    m = tiny("mixtral")
    for kw in (dict(mode="bf16", kv_fp4=True), dict(mode="w4a4", kv_fp4=False), dict(mode="w4a4", fmt="mxfp4",
                                                                                    kv_fp4=True)):
        with pytest.raises(ValueError, match="batch_invariant needs"):
            RolloutEngine(m.config, batch_invariant=True, **kw)
    with pytest.raises(ValueError, match="fp4_backend"):
        RolloutEngine(m.config, mode="w4a4", kv_fp4=True, batch_invariant=True, fp4_backend="torch")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", FAMILIES)
def test_batch_invariant_engine_on_gpu_small_flavors(family):
    """The small flavor (random init, bf16, CUDA-graph decode): 24 prompts x 4 samples x 48 tokens at temperature 1,
    scored by one full-sequence forward, bit for bit; greedy decoding of 3 prompts alone equals theirs in the batch of
    24."""
    m = build_model(f"{family}-small", 0, device="cuda")
    eng = _engine(m, device="cuda", dtype=torch.bfloat16)
    prompts = random_seqs([5 + (7 * i) % 23 for i in range(24)], seed=11)
    out = eng.generate(prompts, n=4, max_new_tokens=48, temperature=1.0, seed=3)
    _assert_scored_equal(eng, out, [prompts[b // 4] for b in range(len(out.tokens))])
    both = eng.generate(prompts, max_new_tokens=24, temperature=0.0)
    alone = eng.generate(prompts[:3], max_new_tokens=24, temperature=0.0)
    for i in range(3):
        assert alone.tokens[i] == both.tokens[i] and alone.logprobs[i] == both.logprobs[i], i


def test_self_test_checks_the_batch_invariant_kernels(monkeypatch):
    """`TritonPath.self_test` (every sync on a GPU) checks the batch-invariant mode's own configs against
    kernels.reference at the model's shapes: a broken batch-invariant GEMM config is named."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the kernels in the Triton interpreter")
    import kernels.batch_invariant as kb

    eng = _engine(tiny("mixtral"))
    eng.fwd.fast.self_test(eng.weights, torch.float32, "cpu", rows=(3,))
    monkeypatch.setattr(kb, "fp4_linear_bi", lambda x, w, on_quant=None: torch.zeros(x.shape[0], w.N))
    with pytest.raises(RuntimeError, match="W4A4 linear"):
        eng.fwd.fast.self_test(eng.weights, torch.float32, "cpu", rows=(3,))
