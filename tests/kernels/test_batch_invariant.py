"""The batch-invariant mode of the kernels (kernels/batch_invariant.py): a row's result is bitwise the same in
calls of different row counts and at different positions in the call, and a decode query equals the same query
inside a full-sequence attention.

What is compared: the Triton kernels themselves (in the interpreter on a CPU, compiled on a GPU), each against its
own output in another call (torch.equal), and the largest call against kernels/reference.py within the kernel tests'
tolerances (conftest.py). Each call takes a window rows[s : s + n] of one input: the rows land at other positions of
the kernels' tiles and programs than in the full call, as a decode step's row does against the same token in a
prefill.
"""
from __future__ import annotations

import math

import torch

from kernels import batch_invariant as bi
from kernels import reference as ref
from kernels.attention import FP4KVCache, kv_store
from kernels.gemm import prepare_weight
from kernels.moe import prepare_moe_weights
from kernels.norm import norm_rope, rms_norm
from kernels.quantize import quantize_rows
from kernels.routing import topk_softmax
from tests.kernels.conftest import DEV, ON_GPU, TOL, TOL_ATTN, TOL_MMA, bf16_exact, dev, host, rel

ROWS = 37
WINDOWS = [(0, 1), (0, 3), (5, 16), (20, 17), (36, 1)]  # (start, rows) of the calls compared with the full one


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _assert_rows_invariant(fn, *xs):
    """fn(*[x[s:s+n] for x in xs]) equals rows s..s+n of fn(*xs) bit for bit, for every window; returns fn(*xs)."""
    full = host(fn(*dev(*xs)) if len(xs) > 1 else fn(dev(*xs)))
    for s, n in WINDOWS:
        part = [x[s:s + n] for x in xs]
        y = host(fn(*dev(*part)) if len(xs) > 1 else fn(dev(*part)))
        for a, b in zip(y if isinstance(y, tuple) else (y,), full if isinstance(full, tuple) else (full,), strict=True):
            assert torch.equal(a, b[s:s + n]), f"rows {s}..{s + n} differ from the full call's"
    perm = torch.randperm(ROWS, generator=_gen(99))  # every row at another place of the same call size
    y = host(fn(*dev(*[x[perm] for x in xs])) if len(xs) > 1 else fn(dev(xs[0][perm])))
    for a, b in zip(y if isinstance(y, tuple) else (y,), full if isinstance(full, tuple) else (full,), strict=True):
        assert torch.equal(a, b[perm]), "a permutation of the rows changed their results"
    return full


def test_fp4_linear_rows_invariant():
    N, K = 40, 96
    c, s, o = ref.nvfp4_quantize(torch.randn(N, K, generator=_gen(0)))
    w = prepare_weight(*dev(c, s, o))
    x = bf16_exact(torch.randn(ROWS, K, generator=_gen(1)) * torch.exp(torch.randn(ROWS, 1, generator=_gen(2))))
    y = _assert_rows_invariant(lambda t: bi.fp4_linear_bi(t, w), x)
    assert rel(y, ref.fp4_linear(x, c, s, o, act_quant=True)) < TOL_MMA
    assert bi.gemm_config(N, K) == bi.gemm_config(N, K) and bi.gemm_config(N, K).split == 1


def test_fused_moe_rows_invariant():
    E, H, I, k = 5, 64, 48, 2
    g = _gen(3)
    q = lambda *sh: ref.nvfp4_quantize(torch.randn(*sh, generator=g), outer="expert")  # noqa: E731
    gate, up, down = q(E, I, H), q(E, I, H), q(E, H, I)
    mw = prepare_moe_weights(*dev(gate, up, down))
    x = bf16_exact(torch.randn(ROWS, H, generator=g))
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(ROWS)])
    tw = torch.softmax(torch.randn(ROWS, k, generator=g), -1)
    y = _assert_rows_invariant(lambda a, b, c: bi.fused_moe_bi(a, mw, b, c), x, ids, tw)
    # the MoE tolerance of the MMA path in W4A4 (tests/kernels/test_moe.py)
    assert rel(y, ref.moe_fp4_reference(x, gate, up, down, ids, tw, act_quant=True)) < TOL_MMA
    assert bi.moe_config(E, k) == bi.moe_config(E, k)


def test_attention_decode_equals_prefill():
    """Two sequences of 29 and 21 tokens in an FP4 cache. 'Prefill': every position of both as one call (query i of
    length position + 1); 'decode': each position as its own call of one query, and a decode batch of one position
    per sequence; the outputs are bitwise equal and within the decode oracle's tolerance."""
    Hq, Hkv, D = 4, 2, 32
    lens, cap = [29, 21], 32
    g = _gen(4)
    k = torch.randn(2 * cap, Hkv, D, generator=g) * 3
    v = torch.randn(2 * cap, Hkv, D, generator=g)
    cache = FP4KVCache.allocate(2 * cap, Hkv, D, DEV)
    kv_store(cache, *dev(k, v, torch.arange(2 * cap)))
    q = bf16_exact(torch.randn(sum(lens), Hq, D, generator=g))
    starts = torch.tensor([0] * lens[0] + [cap] * lens[1])
    qlens = torch.tensor(list(range(1, lens[0] + 1)) + list(range(1, lens[1] + 1)))
    full = host(bi.attention(dev(q), cache, *dev(starts, qlens), cap))  # the prefill
    for i in (0, 7, 28, 29, 40, 49):  # single decode queries
        one = host(bi.attention(dev(q[i:i + 1]), cache, *dev(starts[i:i + 1], qlens[i:i + 1]), cap))
        assert torch.equal(one, full[i:i + 1]), f"query {i}"
    pick = torch.tensor([12, 29 + 20])  # a decode step of both sequences, with a longer max_len
    step = host(bi.attention(dev(q[pick]), cache, *dev(starts[pick], qlens[pick]), 2 * cap))
    assert torch.equal(step, full[pick])
    hc = host(cache)
    kh, vh = (ref.kv_dequantize(p, s, o).view(2, cap, Hkv, D)
              for p, s, o in ((hc.k_packed, hc.k_scales, hc.k_outer), (hc.v_packed, hc.v_scales, hc.v_outer)))
    seq = (starts // cap).long()
    r = torch.stack([ref.decode_attention_reference(q[i:i + 1], kh[seq[i]:seq[i] + 1], vh[seq[i]:seq[i] + 1],
                                                    qlens[i:i + 1])[0] for i in range(len(q))])
    assert rel(full, r) < TOL_ATTN


def test_linear_rows_invariant():
    N, K = 70, 48  # N and K not multiples of the tile: masked edges
    w = bf16_exact(torch.randn(N, K, generator=_gen(5)))
    b = bf16_exact(torch.randn(N, generator=_gen(6)))
    x = bf16_exact(torch.randn(ROWS, K, generator=_gen(7)))
    if ON_GPU:
        w, b, x = w.bfloat16(), b.bfloat16(), x.bfloat16()
    y = _assert_rows_invariant(lambda t: bi.linear(t, dev(w), dev(b)), x)
    r = x.float() @ w.float().T + b.float()
    assert rel(y.float(), r) < (1e-2 if ON_GPU else TOL)  # GPU: the output rounded to bf16


def test_token_logprobs_rows_invariant():
    V = 5000  # two blocks of 4096
    logits = torch.randn(ROWS, V, generator=_gen(8)) * 3
    tok = torch.randint(0, V, (ROWS,), generator=_gen(9))
    for t in (1.0, 0.7):
        y = _assert_rows_invariant(lambda a, b: bi.token_logprobs(a, b, t), logits, tok)  # noqa: B023
        r = torch.log_softmax(logits.double() / t, -1).gather(-1, tok[:, None]).squeeze(-1)
        assert float((y.double() - r).abs().max()) < 1e-4


def test_per_row_kernels_quantize_norm_rope_routing_rows_invariant():
    """The kernels that are one program per row in every mode (activation quantize, residual add + RMSNorm, q/k
    norm + RoPE, routing) and the elementwise ones of this mode."""
    g = _gen(10)
    H, Hh, D, E = 64, 4, 16, 8
    x = torch.randn(ROWS, H, generator=g) * torch.exp(torch.randn(ROWS, 1, generator=g))
    r = torch.randn(ROWS, H, generator=g)
    w = torch.rand(H, generator=g) + 0.5
    def quant(t):
        qr = quantize_rows(t, "nvfp4", fake_dtype=torch.float32)
        return qr.codes(), qr.scales, qr.outer.reshape(-1), qr.fake

    codes, scales, _, _ = _assert_rows_invariant(quant, x)
    c, s, _ = ref.nvfp4_quantize(x, outer="row")
    assert torch.equal(codes, c) and torch.equal(scales, s)
    _assert_rows_invariant(lambda a, b: rms_norm(a, dev(w), 1e-6, b), x, r)
    t = torch.randn(ROWS, Hh, D, generator=g)
    ang = torch.arange(ROWS)[:, None].float() * (1e-2 ** (torch.arange(D // 2) / (D // 2)))[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    wd = torch.rand(D, generator=g) + 0.5
    _assert_rows_invariant(lambda a, b, cc: norm_rope(a, b, cc, dev(wd), 1e-6), t, cos, sin)
    lg = torch.randn(ROWS, E, generator=g)
    _, ids = _assert_rows_invariant(lambda a: topk_softmax(a, 2, True), lg)
    assert torch.equal(ids, torch.topk(torch.softmax(lg, -1), 2)[1])
    a, b = torch.randn(ROWS, H, generator=g) * 4, torch.randn(ROWS, H, generator=g)
    y = _assert_rows_invariant(bi.silu_mul, a, b)
    assert rel(y, torch.nn.functional.silu(a) * b) < 1e-5
    z = _assert_rows_invariant(bi.sigmoid, a)
    assert rel(z, torch.sigmoid(a)) < 1e-5
    assert math.isclose(float(bi.sum_slots(torch.ones(3, 4, 2))[0, 0]), 4.0)
