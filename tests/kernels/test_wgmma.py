"""The v4 dense and MoE kernels (kernels/wgmma.py: decoded NVFP4 weights as the wgmma A operand in registers).

On the CPU: the offline layout against an element-wise statement of it, and that its kernel compiles for sm_90
with the A operand in registers (`assert_trivial` on the layout conversion) and no shared-memory load in the loop.
On an H200 (Gluon has no interpreter): outputs against `kernels.reference.fp4_linear`, W4A16 and W4A4, within
GPU_TOL_MMA (BF16 tensor cores over operands exact in BF16, FP32 accumulation; tests/kernels/conftest.py).
"""
from pathlib import Path

import pytest
import torch

from kernels import reference as ref
from kernels import wgmma
from kernels._common import PAIR_BITS
from tests.kernels.conftest import GPU_TOL_MMA, ON_GPU, bf16_exact, compile_sm90, dev, rel
from tests.kernels.test_moe import (
    _case,  # the MoE kernels' cases: expert weights, x, routing (expert E-1 empty)
)

ROOT = Path(__file__).resolve().parents[2]


def _w(N, K, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * torch.exp(torch.randn(N, 1, generator=g))
    w[:, 64:80] = 0  # a zero block
    return ref.nvfp4_quantize(w)


def test_layout_holds_every_code_where_the_kernel_reads_it():
    """Element k of a row sits in word 8 (k // 64) + 2 q + sh, its code bit i at bit PAIR_BITS[j // 2][i] + 16 (j % 2),
    with k % 64 = 32 sh + 16 s0 + 8 h + 2 q + p and j = 4 s0 + 2 h + p (kernels/wgmma.py)."""
    codes = torch.randint(0, 16, (2, 3, 192), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    words = wgmma.wgmma_layout(codes).to(torch.int64) & 0xFFFFFFFF  # [2, 3, 24]
    k = torch.arange(192)
    r = k % 64
    sh, s0, h, q, p = r // 32, (r // 16) % 2, (r // 8) % 2, (r // 2) % 4, r % 2
    col = 8 * (k // 64) + 2 * q + sh
    j = 4 * s0 + 2 * h + p
    bits = torch.tensor(PAIR_BITS)[j // 2] + 16 * (j % 2)[:, None]  # [192, 4]: code bit i -> word bit
    got = sum(((words[..., col] >> bits[:, i]) & 1) << i for i in range(4))
    assert torch.equal(got.to(torch.uint8), codes)


def test_scale_bytes_become_the_bf16_multiplier_by_one_multiply_add():
    """Every positive E4M3 scale (subnormals included) re-encoded (`wgmma_scales`) and decoded as the kernel's PTX
    does (byte * 0x100010 + 0x76807680: the bf16x2 pair) is s_b * 2^119 exactly in both halves; a zero scale is byte
    0; two blocks share an int16, the lower block in the low byte."""
    b = torch.arange(0, 127, dtype=torch.uint8)  # 0 and every positive finite E4M3 value
    enc = wgmma.wgmma_scales(torch.stack([b, b.flip(0)], -1).reshape(1, -1))  # [1, 127] int16
    pairs = enc.view(torch.uint8).reshape(127, 2).to(torch.int64)
    assert torch.equal(pairs[:, 0].flip(0), pairs[:, 1])
    assert f"mad.lo.u32 sa, sa, 0x100010, {wgmma.SCALE_MAD};" in wgmma._DECODE8_WG.value
    word = (pairs[:, 0] * 0x100010 + wgmma.SCALE_MAD) & 0xFFFFFFFF
    lo, hi = word & 0xFFFF, word >> 16
    want = (ref.e4m3_decode(b) * 2.0**119).to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    assert int(pairs[0, 0]) == 0
    assert torch.equal(lo[1:], want[1:]) and torch.equal(hi[1:], want[1:])


def test_layout_rejects_a_partial_tile():
    with pytest.raises(ValueError, match="multiple of 64"):
        wgmma.wgmma_layout(torch.zeros(4, 96, dtype=torch.uint8))


def _ptx_counts(name: str, sig: dict, constexprs: dict, keys=("wgmma.mma_async", "ldmatrix", "ld.shared")) -> dict:
    return compile_sm90("kernels.wgmma", name, sig, constexprs, keys, num_warps=4, wide=("N", "K", "stride_xm"))


def test_kernel_keeps_the_decoded_tile_in_registers():
    """Offline sm_90 compile (no GPU): the layout conversion into the wgmma A layout is asserted trivial at compile
    time, and the register loop reads no shared memory (the Triton-language tile does STS + LDSM per K
    tile)."""
    n = _ptx_counts("_w4_wgmma_kernel", wgmma.DENSE_SIG, {"BM": 16, "SPLIT": 2, "XF": True, "num_warps": 4})
    assert n["wgmma.mma_async"] >= 1 and n["ldmatrix"] == 0 and n["ld.shared"] == 0, n


def test_moe_kernel_keeps_the_decoded_tiles_in_registers():
    """The MoE kernel's register loop (gate and up rows sharing one activation tile) compiles for sm_90 the same
    way."""
    n = _ptx_counts("_moe_wgmma_kernel", wgmma.moe_sig("*bf16"),
                    {"BM": 16, "GATED": True, "ROUTE_W": False, "XF": True, "SPLIT": 1, "num_warps": 4})
    assert n["wgmma.mma_async"] >= 2 and n["ldmatrix"] == 0 and n["ld.shared"] == 0, n


@pytest.mark.parametrize("M,N,K", [(1, 64, 64), (5, 128, 192), (16, 256, 512), (37, 192, 1024), (64, 128, 256),
                                   (130, 64, 128)])
@pytest.mark.parametrize("act_quant", [False, True])
def test_wgmma_matches_the_oracle(M, N, K, act_quant):
    if not ON_GPU or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("Gluon wgmma kernel: Hopper GPUs only")
    c, s, o = _w(N, K, M + N + K)
    x = bf16_exact(torch.randn(M, K, generator=torch.Generator().manual_seed(K)))
    w = wgmma.prepare_wgmma(*dev(c, s, o))
    r = ref.fp4_linear(x, c, s, o, act_quant=act_quant)
    # the default and every token tile; splits that leave a program one tile, an odd count and a short tail
    for cfg in (None, (16, 1), (32, 2), (64, 3), (16, 3), (16, 7)):
        y = wgmma.fp4_linear_wgmma(dev(x).to(torch.bfloat16), w, act_quant=act_quant, out_dtype=torch.float32,
                                   config=cfg)
        assert y.shape == (M, N)
        assert rel(y, r) < GPU_TOL_MMA, (cfg, rel(y, r))
    # x a view whose rows are not 16-byte aligned: Triton specializes a launch on its pointers' and strides'
    # divisibility by 16, so this one compiles narrower loads of x
    xw = torch.zeros(M, K + 4, dtype=torch.bfloat16, device="cuda")
    xw[:, 4:] = dev(x).to(torch.bfloat16)
    y = wgmma.fp4_linear_wgmma(xw[:, 4:], w, act_quant=act_quant, out_dtype=torch.float32)
    assert rel(y, r) < GPU_TOL_MMA, rel(y, r)


MOE_CASES = [(7, 5, 64, 128, 2), (40, 9, 128, 64, 3), (256, 17, 192, 128, 4)]


def _hopper():
    if not ON_GPU or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("Gluon wgmma kernel: Hopper GPUs only")


@pytest.mark.parametrize("T,E,H,I,k", MOE_CASES)
def test_moe_wgmma_matches_the_oracle(T, E, H, I, k):
    """W4A16 end to end: h stays in BF16 between the two launches, as the oracle rounds it (h_dtype), and the output
    is BF16: within GPU_TOL_MOE_MMA, as `kernels.moe`'s MMA path in tests/kernels/test_moe.py."""
    _hopper()
    from tests.kernels.conftest import GPU_TOL_MOE_MMA

    g, u, d, x, ids, tw = _case(T, E, H, I, k)
    w = wgmma.prepare_moe_wgmma(*dev(g, u, d))
    xd, idsd, twd = dev(x, ids, tw)
    r = ref.moe_fp4_reference(x, g, u, d, ids, tw, h_dtype=torch.bfloat16)
    for bm in (None, 16, 32, 64):
        y = wgmma.fused_moe_wgmma(xd.to(torch.bfloat16), w, idsd, twd, BM=bm)
        assert y.shape == (T, H) and rel(y.float(), r) < GPU_TOL_MOE_MMA, (bm, rel(y.float(), r))


@pytest.mark.parametrize("T,E,H,I,k", MOE_CASES)
@pytest.mark.parametrize("act_quant", [False, True])
def test_moe_wgmma_launches_match_the_oracle(T, E, H, I, k, act_quant):
    """Each launch against the oracle on the inputs it was given: gate/up (SiLU product) per slot from x, down (times
    the routing weight) per slot from the kernel's own h, so an FP4 code of h at a rounding boundary cannot differ
    between the two sides (W4A4 quantizes that h with the trainer's kernel, the oracle with the reference: the same
    codes). Outputs in BF16: within 4e-3 (2^-9 of the output's rounding, twice)."""
    _hopper()
    from kernels.gemm import quantize_act_for_gemm
    from kernels.moe import moe_align

    (gc, gs, go), (uc, us, uo), (dc, ds, do), x, ids, tw = _case(T, E, H, I, k)
    w = wgmma.prepare_moe_wgmma(*dev((gc, gs, go), (uc, us, uo), (dc, ds, do)))
    xb = dev(x).to(torch.bfloat16)
    idsd = dev(ids)
    slots, bexp = moe_align(idsd, E, 16)
    S = T * k
    kw = dict(a_div=k, gated=True)
    if act_quant:
        xq, xf = quantize_act_for_gemm(xb)
        h = wgmma.moe_wgmma(xq, w.w13, w.s13, w.f13, I, H, slots, bexp, S, 16, a_factor=xf, out_dtype=torch.bfloat16, **kw)
    else:
        h = wgmma.moe_wgmma(xb, w.w13, w.s13, w.f13, I, H, slots, bexp, S, 16, **kw)
    rw = dev(tw).reshape(-1).float()
    ys = []
    for split in (None, 1, 2, 3):  # the down launch split over K (fp32 atomics), its default and forced
        if act_quant:
            hq, hf = quantize_act_for_gemm(h)
            ys.append(wgmma.moe_wgmma(hq, w.w2, w.s2, w.f2, H, I, slots, bexp, S, 16, a_div=1, gated=False,
                                      route_w=rw, a_factor=hf, out_dtype=torch.bfloat16, split=split))
        else:
            ys.append(wgmma.moe_wgmma(h, w.w2, w.s2, w.f2, H, I, slots, bexp, S, 16, a_div=1, gated=False, route_w=rw,
                                      split=split))
    h_cpu = h.float().cpu()
    e_of = ids.reshape(-1)
    h_ref = torch.empty(S, I)
    y_ref = torch.empty(S, H)
    for s in range(S):
        e, t = int(e_of[s]), s // k
        gx = ref.fp4_linear(x[t:t + 1], gc[e], gs[e], go[e].reshape(()), act_quant=act_quant)
        ux = ref.fp4_linear(x[t:t + 1], uc[e], us[e], uo[e].reshape(()), act_quant=act_quant)
        h_ref[s] = (torch.nn.functional.silu(gx) * ux)[0]
        y_ref[s] = tw.reshape(-1)[s] * ref.fp4_linear(h_cpu[s:s + 1], dc[e], ds[e], do[e].reshape(()),
                                                      act_quant=act_quant)[0]
    assert rel(h_cpu, h_ref) < 4e-3, rel(h_cpu, h_ref)
    for split, y in zip((None, 1, 2, 3), ys, strict=True):
        assert rel(y.float().cpu(), y_ref) < 4e-3, (split, rel(y.float().cpu(), y_ref))
