"""GPU-only checks of the rollout engine: CUDA-graph decode equals eager decode, the BF16 engine matches
the transformers forward in BF16 on the GPU, and the FP4 backends (torch emulation, Triton kernels) agree.

Skipped without CUDA (CI has none); run on the GPU machine with
`python -m pytest tests/rollout/test_gpu.py -q` (part of scripts/gpu/gpu_tests.sh's suite).
"""
import pytest
import torch
from rollout_helpers import FAMILIES, random_seqs, tiny

from trace.rollout import RolloutEngine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PROMPTS = random_seqs([5, 9, 3, 12, 7, 4], seed=3)


def _gen(model, **kw):
    eng = RolloutEngine(model.config, dtype=torch.bfloat16, device="cuda", **kw)
    eng.sync_weights(model)
    return eng.generate(PROMPTS, n=2, max_new_tokens=40, temperature=1.0, seed=7, stop_token_ids=(3,))


def _agree(a, b, tol):
    """Same tokens up to the first sampled difference; log-probs of the common part within tol."""
    worst, same = 0.0, 0
    for i in range(len(a.tokens)):
        ta, tb = a.response_tokens(i), b.response_tokens(i)
        n = 0
        while n < min(len(ta), len(tb)) and ta[n] == tb[n]:
            n += 1
        same += n == len(ta) == len(tb)
        if n:
            worst = max(worst, float((torch.tensor(a.logprobs[i][:n]) - torch.tensor(b.logprobs[i][:n])).abs().max()))
    assert worst < tol, f"max |dlp| {worst:.3e} over the common prefixes"
    return same / len(a.tokens)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kw", [dict(mode="bf16"), dict(mode="w4a4", fp4_backend="torch"),
                                dict(mode="w4a4", kv_fp4=True, fp4_backend="torch"),
                                dict(mode="w4a4", kv_fp4=True, fp4_backend="triton")],
                         ids=["bf16", "w4a4", "w4a4kv4", "w4a4kv4-triton"])
def test_graph_decode_equals_eager(family, kw):
    m = tiny(family, dtype=torch.bfloat16).cuda()
    g, e = _gen(m, cuda_graphs=True, **kw), _gen(m, cuda_graphs=False, **kw)
    # the prefill is the same eager forward in both: the first sampled token and its log-prob agree exactly
    for i in range(len(g.tokens)):
        assert g.response_tokens(i)[0] == e.response_tokens(i)[0] and g.logprobs[i][0] == e.logprobs[i][0]
    if kw["mode"] == "bf16":
        # graph steps attend over a 256-slot bucket (masked beyond each row) and always run all rows:
        # the same kernels, possibly another reduction order
        assert _agree(g, e, tol=0.05) >= 0.5
    # FP4 decode past the first token is not compared: a graph step runs every row of the batch while an
    # eager step runs the pending rows only, and the W4A4 GEMMs pick their kernel (GEMV or MMA) by row
    # count; a last-bit BF16 difference then flips FP4 codes downstream (on the H200: max |dlp| 1.08 and
    # 42% identical samples with the Triton backend). TRACE needs no agreement here: a record is made by
    # the path that generated.


def test_graphs_replay_same_outputs_and_resync():
    m = tiny("qwen3_moe", dtype=torch.bfloat16).cuda()
    eng = RolloutEngine(m.config, mode="w4a4", dtype=torch.bfloat16, device="cuda")
    eng.sync_weights(m)
    a = eng.generate(PROMPTS, n=2, max_new_tokens=24, seed=1)
    b = eng.generate(PROMPTS, n=2, max_new_tokens=24, seed=1)
    assert a.tokens == b.tokens and a.logprobs == b.logprobs
    with torch.no_grad():  # new weights must reach the replayed graphs
        for p in m.parameters():
            p.mul_(-1.0)
    kept = eng._kept
    eng.sync_weights(m)
    assert eng._kept is kept  # the sync copied into the captured tensors: the graphs are replayed, not recaptured
    c = eng.generate(PROMPTS, n=2, max_new_tokens=24, seed=1)
    fresh = RolloutEngine(m.config, mode="w4a4", dtype=torch.bfloat16, device="cuda")  # graphs of the new weights
    fresh.sync_weights(m)
    d = fresh.generate(PROMPTS, n=2, max_new_tokens=24, seed=1)
    assert c.tokens != a.tokens
    assert c.tokens == d.tokens and c.logprobs == d.logprobs


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_engine_matches_transformers_on_gpu(family):
    m = tiny(family, dtype=torch.bfloat16).cuda()
    eng = RolloutEngine(m.config, mode="bf16", dtype=torch.bfloat16, device="cuda")
    eng.sync_weights(m)
    seqs = random_seqs([17, 30, 8], seed=5)
    got = eng.score(seqs)
    worst = 0.0
    for s, lp in zip(seqs, got, strict=True):
        with torch.no_grad():
            logits = m(torch.tensor([s], device="cuda")).logits.float()
        ref = torch.log_softmax(logits, -1)[0, :-1].gather(-1, torch.tensor(s[1:], device="cuda")[:, None]).squeeze(-1)
        worst = max(worst, float((torch.tensor(lp) - ref.cpu()).abs().max()))
    assert worst < 0.06, f"{family}: bf16 engine vs transformers max |dlp| {worst:.3e}"  # same bound as the CPU test


@pytest.mark.parametrize("family", FAMILIES)
def test_fast_path_self_test_at_the_small_flavors_shapes(family):
    """The Triton path's self-test (fast.TritonPath.self_test, run by every sync on a GPU) at the shapes
    of the profile's small models: mixtral-small's expert width 1792 took the quantize tile that Triton 3.6
    miscompiled on an H200 (kernels/NOTES.md v2d) while no kernel test used it."""
    from trace.models import build_model

    m = build_model(f"{family}-small", 0, dtype=torch.bfloat16)
    eng = RolloutEngine(m.config, mode="w4a4", kv_fp4=True, dtype=torch.bfloat16, device="cuda")
    eng.sync_weights(m)  # raises RuntimeError where a kernel disagrees with kernels.reference
    assert eng.fwd.fast is not None and eng._fast_checked


@pytest.mark.parametrize("crossover", [None, "inf,inf"], ids=["crossover", "kernels"])
@pytest.mark.parametrize("family", FAMILIES)
def test_captured_recording_steps_store_what_eager_steps_store(family, crossover, monkeypatch):
    """Recording inside the captured decode graphs (graphs.StepRecording): with one graph per attention
    length (graph_bucket 1) and every row fed at every step, a captured step runs the eager step's shapes
    and kernels, so tokens and records agree bit for bit; then with the default buckets and rows that stop
    early, every fed (seq, pos) is in the record and nothing else. 40 rows per step: above the engine's
    crossover (the quantize kernel's codes into BF16 GEMMs), and with the kernels forced at every size
    (TRACE_FP4_CROSSOVER=inf,inf) the MMA kernels (dense M > 8, MoE T*k/E > 8)."""
    from trace.guidance.record import Recorder

    if crossover is not None:
        monkeypatch.setenv("TRACE_FP4_CROSSOVER", crossover)
    m = tiny(family, dtype=torch.bfloat16).cuda()
    prompts = random_seqs([6] * 20, seed=4)  # 40 rows
    outs = {}
    for graphs in (False, True):
        eng = RolloutEngine(m.config, mode="w4a4", kv_fp4=True, dtype=torch.bfloat16, device="cuda",
                            cuda_graphs=graphs)
        eng.sync_weights(m)
        assert eng.fwd.fast is not None  # recording decodes on the Triton path, its kernels' codes recorded
        eng.graph_bucket = 1
        rec = Recorder(layers=None, full_codes=True, routing=True)
        out = eng.generate(prompts, n=2, max_new_tokens=10, temperature=1.0, seed=2, recorder=rec)
        outs[graphs] = (out, rec.finish())
        if graphs:
            assert eng._kept[2].recording is not None and eng._kept[2].capture
    (oe, re_), (og, rg) = outs[False], outs[True]
    assert og.tokens == oe.tokens and og.logprobs == oe.logprobs
    assert sorted(rg.sites) == sorted(re_.sites)
    for key, rows in rg.sites.items():
        for f in ("keys", "mantissa", "scales", "outer", "codes"):
            assert torch.equal(getattr(rows, f), getattr(re_.sites[key], f)), (key, f)
    eng = RolloutEngine(m.config, mode="w4a4", kv_fp4=True, dtype=torch.bfloat16, device="cuda")
    eng.sync_weights(m)
    rec = Recorder(layers=None, routing=True)
    out = eng.generate(PROMPTS, n=2, max_new_tokens=40, temperature=1.0, seed=7, stop_token_ids=(3,), recorder=rec)
    got = rec.finish()
    want = {(b << 24) | p for b, t in enumerate(out.tokens) for p in range(len(t))
            if not (b % 2 and p < out.prompt_lens[b])}  # the second sample's prompt rows are aliases
    for key, rows in got.sites.items():
        assert set(rows.keys.tolist()) == want, key


def test_fused_sampling_matches_the_torch_passes(monkeypatch):
    """The engine's sampling by `kernels.sampling.fused_sample` against its torch passes (`sample_torch`): greedy,
    the same tokens and log-probs within 1e-4; at temperature 1, reproducible per seed, other seeds other tokens, and
    log-probs of the sampled tokens that the engine's own rescoring (`score`, one BF16 prefill) gives back (median
    difference under 0.05; a wrong token's or temperature's log-prob is off by O(1))."""
    from trace.rollout import fast

    model = tiny(FAMILIES[0], dtype=torch.bfloat16).cuda()
    eng = RolloutEngine(model.config, dtype=torch.bfloat16, device="cuda")
    eng.sync_weights(model)
    greedy = dict(n=2, max_new_tokens=24, temperature=0.0, seed=0)
    fused = eng.generate(PROMPTS, **greedy)
    monkeypatch.setattr(fast, "fused_sampling", lambda: False)
    plain = eng.generate(PROMPTS, **greedy)
    monkeypatch.undo()
    assert _agree(fused, plain, 1e-4) > 0.9
    a = eng.generate(PROMPTS, n=2, max_new_tokens=24, temperature=1.0, seed=5)
    b = eng.generate(PROMPTS, n=2, max_new_tokens=24, temperature=1.0, seed=5)
    c = eng.generate(PROMPTS, n=2, max_new_tokens=24, temperature=1.0, seed=6)
    assert a.tokens == b.tokens and a.tokens != c.tokens
    lp = eng.score(a.tokens)
    diffs = torch.cat([torch.tensor(a.logprobs[i]) - torch.tensor(lp[i][len(PROMPTS[i // 2]) - 1:])
                       for i in range(len(a.tokens))]).abs()
    assert diffs.median() < 0.05, f"median |dlp| against rescoring {diffs.median():.3e}"
