"""Triton grouped MoE (fused gate/up SiLU + down, token-sorted by expert) vs
kernels.reference.moe_fp4_reference; empty experts, odd sizes, W4A4; moe_align vs a torch oracle
(exact on both devices). Tolerances (tests/kernels/conftest.py): the GEMV path (FP32 FMA) TOL = 1e-5
on both devices; the MMA path 1e-5 in the interpreter (FP32 dots); on the GPU its down GEMM reads the
FP32 h as BF16, so W4A16 is held to TOL_MOE_MMA; W4A4 quantizes h to FP4 first (operands exact in
BF16), so it is held to TOL_MMA."""
import pytest
import torch

from kernels import reference as ref
from kernels.gemm import quantize_act_for_gemm
from kernels.moe import MoEConfig, default_moe_config, fused_moe, moe_align, moe_gemm, prepare_moe_weights
from tests.kernels.conftest import (
    DEV,
    GPU_TOL_MMA,
    GPU_TOL_MOE_MMA,
    MMA_KW,
    ON_GPU,
    TOL,
    TOL_MMA,
    TOL_MOE_MMA,
    bf16_exact,
    compile_sm90,
    dev,
    host,
    rel,
)

MOE_CASES = [(7, 5, 64, 48, 2), (1, 4, 32, 80, 1), (19, 6, 48, 32, 3)]


def _weights(E, H, I, seed):
    g = torch.Generator().manual_seed(seed)
    q = lambda *sh: ref.nvfp4_quantize(torch.randn(*sh, generator=g), outer="expert")  # noqa: E731
    return q(E, I, H), q(E, I, H), q(E, H, I)


def _case(T, E, H, I, k):
    """Expert weights (gate, up, down), BF16-exact x [T, H] (conftest.py), topk ids and weights [T, k]."""
    g, u, d = _weights(E, H, I, T * 7 + E)
    gen = torch.Generator().manual_seed(T)
    x = bf16_exact(torch.randn(T, H, generator=gen))
    ids = torch.stack([torch.randperm(E - 1, generator=gen)[:k] for _ in range(T)])  # expert E-1 stays empty
    tw = torch.softmax(torch.randn(T, k, generator=gen), -1)
    return g, u, d, x, ids, tw


@pytest.mark.parametrize("T,E,H,I,k", MOE_CASES)
@pytest.mark.parametrize("act_quant", [False, True])
def test_fused_moe_matches_reference(T, E, H, I, k, act_quant):
    g, u, d, x, ids, tw = _case(T, E, H, I, k)
    mw = prepare_moe_weights(*dev(g, u, d))
    xd, idsd, twd = dev(x, ids, tw)
    y = fused_moe(xd, mw, idsd, twd, act_quant=act_quant)  # default config: GEMV at T*k/E <= 4 (8 on the GPU)
    r = ref.moe_fp4_reference(x, g, u, d, ids, tw, act_quant=act_quant)
    mma = default_moe_config(T, k, E).kind == "mma"
    assert rel(y, r) < (TOL if not mma else TOL_MMA if act_quant else TOL_MOE_MMA)
    if not act_quant:  # the MMA kernels explicitly
        cfg = MoEConfig(BM=16, BN=16, num_stages=1, BN_down=16, **MMA_KW)
        y = fused_moe(xd, mw, idsd, twd, config=cfg)
        assert rel(y, r) < TOL_MOE_MMA


@pytest.mark.parametrize("T,E,H,I,k", MOE_CASES)
@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("bf16_decode", [False, True])
def test_fused_moe_mma_decodes_match_reference(T, E, H, I, k, act_quant, bf16_decode):
    """The MMA kernels with the tile's decode in fp32 and in bf16 (inline PTX, GPU only), W4A16 and W4A4:
    the same products either way, so the same tolerances."""
    if bf16_decode and not ON_GPU:
        pytest.skip("the bf16 decode is inline PTX (the interpreter decodes in fp32)")
    g, u, d, x, ids, tw = _case(T, E, H, I, k)
    mw = prepare_moe_weights(*dev(g, u, d))
    cfg = MoEConfig(BM=16, BN=16, num_stages=1, BN_down=16, bf16_decode=bf16_decode, **MMA_KW)
    xd, idsd, twd = dev(x, ids, tw)
    y = fused_moe(xd, mw, idsd, twd, act_quant=act_quant, config=cfg)
    r = ref.moe_fp4_reference(x, g, u, d, ids, tw, act_quant=act_quant)
    assert rel(y, r) < (TOL_MMA if act_quant else TOL_MOE_MMA)


def _moe_oracle(x, gate, up, down, ids, tw, act_quant=False, h_map=None):
    """kernels.reference.moe_fp4_reference with a hook on h = silu(g) * u (FP32, [T, I] per slot j)."""
    wg, wu, wd = (ref.nvfp4_dequantize(*t) for t in (gate, up, down))
    x = ref.fake_quantize_rows(x) if act_quant else x
    out = torch.zeros(x.shape[0], wd.shape[1])
    for j in range(ids.shape[1]):
        e = ids[:, j]
        h = torch.nn.functional.silu(torch.einsum("th,tih->ti", x, wg[e])) * torch.einsum("th,tih->ti", x, wu[e])
        h = h_map(h) if h_map is not None else h
        h = ref.fake_quantize_rows(h) if act_quant else h
        out += tw[:, j, None] * torch.einsum("ti,thi->th", h, wd[e])
    return out


@pytest.mark.parametrize("T,E,H,I,k", MOE_CASES)
def test_moe_gpu_tolerances_cover_h_rounding(T, E, H, I, k):
    """CPU emulations of the GPU MMA path on test_fused_moe_matches_reference's inputs, 5x inside
    the GPU tolerances. W4A16: the down GEMM reads h as BF16. W4A4: h from the GPU differs from the
    oracle's by FP32 summation order and fast exp (~1e-7 relative); perturbed by 1e-5 relative, the
    W4A4 oracle moves only through S_enc (a flipped FP4 code or scale byte of h would move it by
    ~1e-3). Runs on every device."""
    g, u, d, x, ids, tw = _case(T, E, H, I, k)
    r = ref.moe_fp4_reference(x, g, u, d, ids, tw)
    assert rel(_moe_oracle(x, g, u, d, ids, tw), r) < 1e-5  # the hooked oracle is the oracle
    assert rel(_moe_oracle(x, g, u, d, ids, tw, h_map=bf16_exact), r) < GPU_TOL_MOE_MMA / 5
    r4 = ref.moe_fp4_reference(x, g, u, d, ids, tw, act_quant=True)
    for seed in range(5):
        gen = torch.Generator().manual_seed(seed)
        noisy = lambda h: h * (1 + 1e-5 * (2 * torch.rand(h.shape, generator=gen) - 1))  # noqa: E731
        assert rel(_moe_oracle(x, g, u, d, ids, tw, act_quant=True, h_map=noisy), r4) < GPU_TOL_MMA / 5


def test_align_pads_per_expert():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])
    slots, bexp = host(moe_align(dev(ids), E=5, BM=4))
    used = bexp[bexp >= 0].tolist()
    assert used == [0, 2, 3]  # experts 1 and 4 are empty: no blocks
    for b, e in enumerate(bexp.tolist()):
        blk = slots[b * 4:(b + 1) * 4]
        real = blk[blk < ids.numel()]
        assert bool((ids.reshape(-1)[real.long()] == e).all()) if e >= 0 else real.numel() == 0
    assert sorted(slots[slots < 6].tolist()) == list(range(6))


def _align_oracle(ids, E, BM):
    """Stable sort by expert with per-expert padding to BM, in plain torch."""
    flat = ids.reshape(-1).long()
    S = flat.numel()
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + BM - 1) // BM * BM
    pend = torch.cumsum(padded, 0)
    P = -(-(S + E * (BM - 1)) // BM) * BM
    slots = torch.full((P,), S, dtype=torch.int32)
    order = torch.argsort(flat, stable=True)
    rank = torch.arange(S) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    slots[(pend - padded)[flat[order]] + rank] = order.int()
    be = torch.searchsorted(pend, torch.arange(0, P, BM), right=True)
    return slots, torch.where(be < E, be, -1).int()


@pytest.mark.parametrize("T,k,E,BM", [(1, 8, 128, 1), (37, 2, 8, 4), (300, 4, 60, 16), (5, 8, 64, 2),
                                      (256, 8, 128, 16), (1100, 2, 8, 64), (33, 8, 128, 16)])
def test_align_equals_stable_sort_oracle(T, k, E, BM):
    """Both ways of sorting (one program up to ALIGN_ONE_PROGRAM_MAX_SLOTS slots, chunk-parallel above:
    T*k = 8 .. 2,200 slots, 1 to 35 chunks of 64, more than one group of 16 chunks) equal the oracle."""
    g = torch.Generator().manual_seed(T * E)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])  # several chunks when T*k > 64
    slots, bexp = host(moe_align(dev(ids), E=E, BM=BM))
    r_slots, r_bexp = _align_oracle(ids, E, BM)
    assert torch.equal(slots, r_slots) and torch.equal(bexp, r_bexp)


def test_errors():
    g, u, d = dev(*_weights(3, 32, 48, 0))
    mw = prepare_moe_weights(g, u, d)
    x = torch.randn(2, 32, device=DEV)
    ids = torch.tensor([[0, 1], [1, 2]], device=DEV)
    tw = torch.ones(2, 2, device=DEV)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(x, mw, ids + 5, tw)
    with pytest.raises(ValueError):
        fused_moe(x, mw, ids, tw[:, :1])
    with pytest.raises(ValueError, match="hidden"):
        fused_moe(torch.randn(2, 48, device=DEV), mw, ids, tw)
    with pytest.raises(ValueError, match="non-finite"):
        fused_moe(torch.full((2, 32), float("inf"), device=DEV), mw, ids, tw)
    with pytest.raises(ValueError):
        prepare_moe_weights(g, u, g)
    with pytest.raises(ValueError, match="kind"):  # "mma" names the MMA tile; no other kind runs it
        fused_moe(x, mw, ids, tw, config=MoEConfig(kind="wgmma"))


@pytest.mark.parametrize("T,E,H,I,k,mma", [(7, 5, 64, 48, 2, False), (19, 6, 48, 32, 3, True)])
def test_on_quant_sees_both_activations_in_slot_order(T, E, H, I, k, mma):
    """W4A4: the observer gets the gate/up input [T, H] (bit-identical to the reference quantization) and
    the down input [T*k, I] with row t*k + j = slot j of token t: its codes are the reference h's of that
    slot, up to codes at a rounding point (h rounds to x's dtype in the kernel, not in the oracle)."""
    g, u, d, x, ids, tw = _case(T, E, H, I, k)
    mw = prepare_moe_weights(*dev(g, u, d))
    cfg = MoEConfig(BM=16, BN=16, num_stages=1, BN_down=16, **MMA_KW) if mma else None
    seen = []
    xd, idsd, twd = dev(x, ids, tw)
    fused_moe(xd, mw, idsd, twd, act_quant=True, config=cfg, on_quant=lambda w, q: seen.append((w, q)))
    assert [w for w, _ in seen] == ["gate_up", "down"]
    (_, qx), (_, qh) = seen
    rc, rs, ro = ref.nvfp4_quantize(x.float(), outer="row")
    assert torch.equal(host(qx.codes()), rc) and torch.equal(host(qx.scales), rs) and torch.equal(host(qx.outer), ro)
    hs = []
    _moe_oracle(x, g, u, d, ids, tw, act_quant=True, h_map=lambda h: hs.append(h) or h)  # hs[j]: [T, I]
    want = ref.nvfp4_quantize(torch.stack(hs, 1).reshape(T * k, I), outer="row")[0]  # [T*k, I], row t*k + j
    assert qh.packed.shape[0] == T * k
    assert (host(qh.codes()) == want).float().mean() > 0.95


def test_default_configs_on_a_gpu_are_the_measured_best(monkeypatch):
    """The GPU heuristics (forced here off the interpreter, 132 SMs as on the H200) give the tiles measured
    best on the H200 (kernels/NOTES.md v3b, v5d, v5k): the MMA tile with the bf16 decode of the dot order from 1 row per
    expert on, the GEMV below."""
    import kernels.gemm as kg
    import kernels.moe as km

    monkeypatch.setattr(kg, "INTERPRET", False)
    monkeypatch.setattr(km, "INTERPRET", False)
    monkeypatch.setattr(kg, "num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    assert kg.auto_config(16, 14336, 4096, cuda) == kg.GemmConfig(
        kind="mma", BN=64, BM=16, BKW=32, split=4, num_warps=4, num_stages=3, bf16_decode=True, dot_order=True)
    assert kg.auto_config(1, 14336, 4096, cuda) == kg.auto_config(16, 14336, 4096, cuda)  # the tile beats the GEMV (v5k)
    assert kg.auto_config(64, 14336, 4096, cuda).BKW == 16
    qwen3, mixtral = default_moe_config(256, 8, 128), default_moe_config(256, 2, 8)
    assert qwen3 == MoEConfig(BM=32, BN=64, BKW=16, num_warps=4, num_stages=3, BN_down=64, kind="mma",
                              bf16_decode=True, dot_order=True)  # 16 rows per expert: one BM 32 block each (v5d)
    assert mixtral == MoEConfig(BM=64, BN=64, BKW=16, num_warps=4, num_stages=3, BN_down=64, kind="mma",
                                bf16_decode=True, dot_order=True)
    assert default_moe_config(4, 8, 128).kind == "gemv" and default_moe_config(1, 2, 8).kind == "gemv"
    assert default_moe_config(16, 8, 128).kind == "mma" and default_moe_config(4, 2, 8).kind == "mma"
    assert default_moe_config(64, 8, 128).BM == 16 and default_moe_config(64, 2, 8).BM == 32
    # K-tiles of 256 at BM 16 (v5l sweep: Mixtral T16 378.6 -> 304.9 us), of 128 above (Mixtral T256 BM 64: 758.8 -> 1033)
    assert default_moe_config(16, 2, 8).BKW == default_moe_config(64, 8, 128).BKW == 32
    assert default_moe_config(64, 2, 8).BKW == 16
    assert km.mma_moe_config(4, 2, 8).kind == "mma"  # what the benchmark times beside the GEMV there



def test_block_rows_follow_the_rows_per_expert():
    """BM grows with the rows per expert and never shrinks as T grows: 16 while an expert's rows rarely pass 16,
    32 once a BM 16 block would decode many experts twice, 64 once BM 32 would; the same at any E for the same mean
    load (the model sees only T*k/E)."""
    from kernels.moe import moe_block_rows

    bms = [moe_block_rows(T, 8, 128) for T in range(1, 2049, 7)]
    assert bms == sorted(bms) and set(bms) == {16, 32, 64}
    assert moe_block_rows(128, 8, 128) == 16 and moe_block_rows(256, 8, 128) == 32
    assert moe_block_rows(1024, 8, 128) == 64 and moe_block_rows(0, 8, 128) == 16
    for T in (16, 64, 256, 1024):
        assert moe_block_rows(T, 8, 128) == moe_block_rows(T // 4, 2, 8)


@pytest.mark.parametrize("T,E,H,I,k", [(7, 5, 256, 512, 2), (19, 6, 512, 256, 3)])
@pytest.mark.parametrize("act_quant", [False, True])
def test_tma_tiles_give_the_pointer_path_bit_for_bit(T, E, H, I, k, act_quant):
    """MoEConfig(tma=True): the experts' weight words and scales by tensor descriptors over their 2-D [E * rows, K]
    views (TMA on a GPU), gate and up rows of each expert at their offsets: the same values reach the same decode
    and MMAs as the pointer tile's, so the same output bit for bit (empty experts and padding blocks included)."""
    g, u, d, x, ids, tw = _case(T, E, H, I, k)
    mw = prepare_moe_weights(*dev(g, u, d))
    xd, idsd, twd = dev(x, ids, tw)
    base = dict(MMA_KW, BM=16, BN=16, num_stages=1, BN_down=16, BKW=32)
    y_tma = fused_moe(xd, mw, idsd, twd, act_quant=act_quant, config=MoEConfig(tma=True, **base))
    assert torch.equal(y_tma, fused_moe(xd, mw, idsd, twd, act_quant=act_quant, config=MoEConfig(**base)))
    r = ref.moe_fp4_reference(x, g, u, d, ids, tw, act_quant=act_quant)
    assert rel(y_tma, r) < (TOL_MMA if act_quant else TOL_MOE_MMA)


@pytest.mark.parametrize("T,E,H,I,k", [(7, 5, 256, 128, 2), (19, 6, 128, 256, 3)])
@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("BKW", [16, 32])
def test_dot_order_gives_the_pair_order_values(T, E, H, I, k, act_quant, BKW):
    """MoEConfig(dot_order=True): both launches read the experts' weights in the dot order (`kernels.gemm.dot_decode`),
    gate and up rows and every expert at their offsets in the int32 scale rows: the pair path's output bit for bit in
    the interpreter (same values, same dots), within the oracle's tolerance on a GPU (the MMA's left operand from
    registers). Empty experts and padding blocks included; with K-tiles of 256 (BKW 32) one GEMM's K of 128 is half a
    tile."""
    g, u, d, x, ids, tw = _case(T, E, H, I, k)
    mw = prepare_moe_weights(*dev(g, u, d))
    xd, idsd, twd = dev(x, ids, tw)
    base = dict(MMA_KW, BM=16, BN=16, num_stages=1, BN_down=16, BKW=BKW)
    y_dot = fused_moe(xd, mw, idsd, twd, act_quant=act_quant, config=MoEConfig(dot_order=True, **base))
    assert mw.w13.dot_words is not None and mw.w2.dot_words is not None
    if not ON_GPU:
        assert torch.equal(y_dot, fused_moe(xd, mw, idsd, twd, act_quant=act_quant, config=MoEConfig(**base)))
    r = ref.moe_fp4_reference(x, g, u, d, ids, tw, act_quant=act_quant)
    assert rel(y_dot, r) < (TOL_MMA if act_quant else TOL_MOE_MMA)


@pytest.mark.parametrize("act_quant", [True, False] if ON_GPU else [True])  # the interpreter ignores the cap: one case
def test_register_cap_changes_no_value(act_quant):
    """MoEConfig(maxnreg=..., maxnreg_down=...): both launches under a register cap (on a GPU 64 spills registers of
    the gate/up tile) give the uncapped output bit for bit. (The interpreter ignores the cap: there a smaller case
    checks only that the config reaches both launches.)"""
    g, u, d, x, ids, tw = _case(7, 5, 256, 256, 2) if ON_GPU else _case(3, 3, 128, 64, 1)
    mw = prepare_moe_weights(*dev(g, u, d))
    xd, idsd, twd = dev(x, ids, tw)
    base = dict(MMA_KW, BM=16, BN=16, num_stages=2, BN_down=16)
    y = fused_moe(xd, mw, idsd, twd, act_quant=act_quant, config=MoEConfig(maxnreg=64, maxnreg_down=80, **base))
    assert torch.equal(y, fused_moe(xd, mw, idsd, twd, act_quant=act_quant, config=MoEConfig(**base)))
    assert rel(y, ref.moe_fp4_reference(x, g, u, d, ids, tw, act_quant=act_quant)) < (TOL_MMA if act_quant else TOL_MOE_MMA)


def _fused_quant_case(T, E, H, I, k, seed, dtype):
    """`_case`'s weights and routing with fresh activations x [T, H]: token 0 all zero (its h rows, the down input,
    are zero too), token 1 with a huge outlier (its other blocks' scales tiny or zero)."""
    g, u, d, _, ids, tw = _case(T, E, H, I, k)
    gen = torch.Generator().manual_seed(seed)
    x = bf16_exact(torch.randn(T, H, generator=gen) * torch.exp(torch.randn(T, 1, generator=gen)))
    x[0] = 0
    x[1, H // 3] = 3e4
    return g, u, d, x.to(dtype), ids, tw


FUSED_QUANT_CASES = [(7, 5, 64, 48, 2), (19, 6, 48, 32, 3), (5, 4, 80, 96, 2)]


@pytest.mark.parametrize("T,E,H,I,k", FUSED_QUANT_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_act_quant_gives_the_unfused_w4a4_bit_for_bit(T, E, H, I, k, dtype):
    """MoEConfig(fuse_quant=True): gate/up quantizes x per token (a_div = k) and down h per slot (a_div = 1) inside
    their kernels (`_moe_gemm_kernel`'s FQ: S_enc from a first pass over each row, each K-tile quantized in registers
    by `kernels.quantize.nvfp4_tile_values`): the tile values and row factors of `quantize_act_for_gemm`, so the
    unfused W4A4 output bit for bit. H 48 / 80 and I 48 / 96 end inside the interpreter's 32-element K-tile; empty
    experts and padding blocks included."""
    g, u, d, x, ids, tw = _fused_quant_case(T, E, H, I, k, T * H + I, dtype)
    mw = prepare_moe_weights(*dev(g, u, d))
    xd, idsd, twd = dev(x, ids, tw)
    base = dict(MMA_KW, BM=16, BN=16, num_stages=1, BN_down=16)
    y = fused_moe(xd, mw, idsd, twd, act_quant=True, config=MoEConfig(fuse_quant=True, **base))
    assert torch.equal(y, fused_moe(xd, mw, idsd, twd, act_quant=True, config=MoEConfig(**base)))
    assert torch.equal(host(y)[0], torch.zeros(H, dtype=dtype))
    if dtype == torch.float32:  # in bf16 h is rounded before its quantize, which moves codes off the FP32 oracle's
        assert rel(y, ref.moe_fp4_reference(x, g, u, d, ids, tw, act_quant=True)) < TOL_MMA


@pytest.mark.parametrize("gated", [True, False])
def test_fused_act_quant_launches_read_tokens_and_slots(gated):
    """Each launch alone: gate/up (rows of x per token, a_div = k, the token's row quantized once per slot that
    reads it) and down (rows of h per slot, a_div = 1) with fuse_quant give the a_factor launch on
    `quantize_act_for_gemm`'s tile values bit for bit."""
    T, E, H, I, k = 9, 5, 80, 48, 2
    g, u, d, x, ids, tw = _fused_quant_case(T, E, H, I, k, 3 + gated, torch.float32)
    mw = prepare_moe_weights(*dev(g, u, d))
    w, a_div, R, K = (mw.w13, k, T, H) if gated else (mw.w2, 1, T * k, I)
    a = x if gated else bf16_exact(torch.randn(R, K, generator=torch.Generator().manual_seed(5)))
    if not gated:
        a[3] = 0
        a[4, 7] = -5e4
    a = dev(a)
    slots, bexp = moe_align(dev(ids), E, 16)
    rw = dev(tw.reshape(-1))
    kw = dict(a_div=a_div, gated=gated, route_w=None if gated else rw, BM=16, BN=16, num_stages=1, **MMA_KW)
    y = moe_gemm(a, w, slots, bexp, T * k, fuse_quant=True, **kw)
    aq, af = quantize_act_for_gemm(a, check_finite=False)
    assert torch.equal(y, moe_gemm(aq, w, slots, bexp, T * k, a_factor=af, out_dtype=a.dtype, **kw))
    with pytest.raises(ValueError, match="a_factor"):
        moe_gemm(aq, w, slots, bexp, T * k, a_factor=af, fuse_quant=True, **kw)


def test_fused_act_quant_keeps_the_unfused_path_for_an_observer():
    """With on_quant (TRACE's record needs the codes, which the fused kernels do not write) fuse_quant runs the
    unfused path: the observer sees both activations, and the output is the fused one's."""
    T, E, H, I, k = 7, 5, 64, 48, 2
    g, u, d, x, ids, tw = _fused_quant_case(T, E, H, I, k, 11, torch.float32)
    mw = prepare_moe_weights(*dev(g, u, d))
    xd, idsd, twd = dev(x, ids, tw)
    cfg = MoEConfig(fuse_quant=True, BM=16, BN=16, num_stages=1, BN_down=16, **MMA_KW)
    seen = []
    y = fused_moe(xd, mw, idsd, twd, act_quant=True, config=cfg, on_quant=lambda w, q: seen.append(w))
    assert seen == ["gate_up", "down"]
    assert torch.equal(y, fused_moe(xd, mw, idsd, twd, act_quant=True, config=cfg))


def test_fused_act_quant_compiles_for_sm90():
    """The fused kernels' GPU path (the dot-order bf16 decode and the quantize's FFMA.SAT rounding in inline PTX,
    the tile's permutes) compiles for sm_90 without a GPU: the gate/up and down launches of `_moe_gemm_kernel` with
    FQ, each with the seven saturating FMAs per activation element and the correctly rounded divisions of S_enc."""
    sig = {"x_ptr": "*bf16", "xf_ptr": "*bf16", "w_ptr": "*i32", "ws_ptr": "*i32", "wf_ptr": "*fp32", "out_ptr": "*bf16",
           "slots_ptr": "*i32", "bexp_ptr": "*i32", "rw_ptr": "*fp32", "S": "i32", "N": "i32", "KW": "i32",
           "stride_xm": "i32", "A_DIV": "i32", "amax_min": "fp32"}
    for gated in (True, False):
        cst = dict(BM=16, BN=64, BKW=32, GATED=gated, ROUTE_W=not gated, INTERP=False, NIT=8, BF16D=True, XF=False,
                   WDESC=False, DOT=True, FQ=True)
        n = compile_sm90("kernels.moe", "_moe_gemm_kernel", sig, cst, ("fma.rn.sat", "div.rn"), 4,
                         wide=("KW", "stride_xm"))
        assert n["fma.rn.sat"] >= 7 and n["div.rn"] >= 2, (gated, n)
