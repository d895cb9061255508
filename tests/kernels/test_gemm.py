"""Triton FP4 dense GEMM (MMA and GEMV paths, split-K, W4A4) vs kernels.reference.fp4_linear.
Tolerance (relative Frobenius error, tests/kernels/conftest.py): FP32 FMA paths TOL = 1e-5 on both
devices; the MMA path TOL_MMA = 1e-5 in the interpreter (FP32 dots over exactly dequantized operands:
only accumulation order differs) and 1e-4 on the GPU (BF16 tensor cores over the same operands, exact
in BF16 because the activations are BF16-exact, FP32 accumulation; 3e-4 for the one case with K = 2048)."""
import dataclasses

import numpy as np
import pytest
import torch

from kernels import gemm as kg
from kernels import quantize as kq
from kernels import reference as ref
from kernels.gemm import (
    GemmConfig,
    default_config,
    fp4_linear,
    prepare_weight,
    quantize_act_for_gemm,
    uses_dot_order,
)
from tests.kernels.conftest import (
    DEV,
    GPU_TOL_MMA,
    MMA_KW,
    ON_GPU,
    TOL,
    TOL_MMA,
    bf16_exact,
    compile_sm90,
    dev,
    host,
    rel,
)

MMA_CASES = [(1, 40, 96), (17, 33, 256), (5, 64, 48)]


def _w(N, K, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g)
    w[:, :16] = 0  # a zero block column
    return ref.nvfp4_quantize(w)


def _mma_case(M, N, K):
    """Weight (codes, scales, S_enc) and BF16-exact activations x [M, K] (conftest.py)."""
    return _w(N, K, M + N + K), bf16_exact(torch.randn(M, K, generator=torch.Generator().manual_seed(K)))


@pytest.mark.parametrize("M,N,K", MMA_CASES)
@pytest.mark.parametrize("act_quant", [False, True])
def test_mma_path(M, N, K, act_quant):
    (c, s, o), x = _mma_case(M, N, K)
    pw = prepare_weight(*dev(c, s, o))
    cfg = GemmConfig(BN=16, BM=16, split=2 if K >= 128 else 1, num_stages=1, **MMA_KW)  # MMA explicitly
    y = fp4_linear(dev(x), pw, act_quant=act_quant, config=cfg)
    r = ref.fp4_linear(x, c, s, o, act_quant=act_quant)
    assert y.shape == (M, N) and rel(y, r) < TOL_MMA
    y = fp4_linear(dev(x), pw, act_quant=act_quant)  # default (v1 GEMV for M <= 2, else MMA)
    assert y.shape == (M, N) and rel(y, r) < TOL_MMA


@pytest.mark.parametrize("M,N,K", MMA_CASES)
@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("bf16_decode", [False, True])
def test_mma_path_decodes(M, N, K, act_quant, bf16_decode):
    """The MMA tile with its decode in fp32 and in bf16 (inline PTX, GPU only) against the oracle, split-K
    included: the same products either way, so the same tolerance."""
    if bf16_decode and not ON_GPU:
        pytest.skip("the bf16 decode is inline PTX (the interpreter decodes in fp32)")
    (c, s, o), x = _mma_case(M, N, K)
    pw = prepare_weight(*dev(c, s, o))
    cfg = GemmConfig(BN=16, BM=16, split=2 if K >= 128 else 1, num_stages=1, bf16_decode=bf16_decode, **MMA_KW)
    y = fp4_linear(dev(x), pw, act_quant=act_quant, config=cfg)
    assert y.shape == (M, N) and rel(y, ref.fp4_linear(x, c, s, o, act_quant=act_quant)) < TOL_MMA


@pytest.mark.parametrize("M,N,K", MMA_CASES)
def test_w4a4_decoded_activation_is_the_w4a16_tile_times_the_row_factor(M, N, K):
    """W4A4 on the MMA tile reads the tile values its quantize pass writes (q * s_b * 2^-7, exact in bf16) as the
    W4A16 tile reads x, and multiplies each output row by the row's 2^7 / S_enc after the MMA: in the interpreter
    (FP32 dots, FP32 output) bit for bit the W4A16 tile on those values times that factor; on a GPU the oracle's
    tolerance. The recorder sees the codes, scales and S_enc of the reference quantization."""
    (c, s, o), x = _mma_case(M, N, K)
    pw = prepare_weight(*dev(c, s, o))
    cfg = GemmConfig(BN=16, BM=16, split=1, num_stages=1, **MMA_KW)
    seen = []
    y = fp4_linear(dev(x), pw, act_quant=True, out_dtype=torch.float32, config=cfg, on_quant=seen.append)
    tile, factor = quantize_act_for_gemm(dev(x))
    if not ON_GPU:
        y16 = fp4_linear(tile, pw, out_dtype=torch.float32, config=cfg)
        assert torch.equal(host(y), host(y16 * factor[:, None]))
    rc, rs, ro = ref.nvfp4_quantize(x, outer="row")
    q = host(seen[0])
    assert torch.equal(q.codes(), rc) and torch.equal(q.scales, rs) and torch.equal(q.outer, ro)
    assert rel(y, ref.fp4_linear(x, c, s, o, act_quant=True)) < TOL_MMA


def _truncated_accumulation(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T with exact products summed in FP32, every addition truncated toward zero
    (the worst plausible tensor-core summation), in float64 numpy on the CPU."""
    xs, ws = x.double().numpy(), w.double().numpy()
    acc = np.zeros((x.shape[0], w.shape[0]))
    for kk in range(x.shape[1]):
        v = acc + np.outer(xs[:, kk], ws[:, kk])  # exact in float64
        r = v.astype(np.float32)
        up = np.abs(r.astype(np.float64)) > np.abs(v)
        r[up] = np.nextafter(r[up], np.float32(0))
        acc = r.astype(np.float64)
    return torch.from_numpy(acc)


def test_mma_gpu_tolerance_covers_truncated_accumulation():
    """CPU emulation of the GPU MMA path (`_truncated_accumulation`) stays 5x inside GPU_TOL_MMA on
    test_mma_path's inputs. Runs on every device (torch/numpy on the CPU)."""
    for M, N, K in MMA_CASES:
        (c, s, o), x = _mma_case(M, N, K)
        acc = _truncated_accumulation(x, ref.nvfp4_dequantize(c, s, o))
        assert rel(acc, ref.fp4_linear(x, c, s, o)) < GPU_TOL_MMA / 5


@pytest.mark.parametrize("split", [1, 3])
def test_gemv_path_and_split(split):
    M, N, K = 2, 37, 272
    c, s, o = _w(N, K, 1)
    pw = prepare_weight(*dev(c, s, o))
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(split))
    cfg = GemmConfig(kind="gemv", BN=16, BKW=4, split=split, num_warps=1, num_stages=1)
    assert rel(fp4_linear(dev(x), pw, config=cfg), ref.fp4_linear(x, c, s, o)) < TOL


def test_w4a4_equals_dequant_then_gemm():
    M, N, K = 4, 32, 128
    c, s, o = _w(N, K, 2)
    pw = prepare_weight(*dev(c, s, o))
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(4)) * 3
    xq = ref.fake_quantize_rows(x)
    y = fp4_linear(dev(x), pw, act_quant=True)  # default: the GEMV kernel on the dequantized activations
    assert rel(y, xq @ ref.nvfp4_dequantize(c, s, o).T) < TOL


# GPU tolerance of the K = 2048 case below: truncated accumulation over 2048 terms (4.4e-5 on its
# inputs) is too close to GPU_TOL_MMA; test_gpu_tiles_tolerance_covers_truncated_accumulation keeps 5x.
GPU_TOL_M128_K2048 = 3e-4


def _m128_k2048_case():
    M, N, K = 128, 256, 2048
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(6)).bfloat16()
    return _w(N, K, 5), x


def test_gpu_tiles_tolerance_covers_truncated_accumulation():
    (c, s, o), x = _m128_k2048_case()
    acc = _truncated_accumulation(ref.fake_quantize_rows(x.float()), ref.nvfp4_dequantize(c, s, o))
    assert rel(acc, ref.fp4_linear(x.float(), c, s, o, act_quant=True)) < GPU_TOL_M128_K2048 / 5


def test_w4a4_mma_with_the_gpu_tiles_of_m128_k2048(monkeypatch):
    """W4A4 on the MMA path with the tiles a GPU takes at M=128, K=2048 (the shape of the benchmark's
    dense W4A4 check): the activation quantize at one row of 128 blocks per program (`kq._config` on a
    GPU; two rows per program with 4 warps saturated every code of a bf16 input on an H200), the GEMM
    at BM=64, BN=64, BKW=16, one K split, the weight in the dot order (`default_config` for M > 64). Forced in the
    interpreter, the defaults on a GPU. BF16 input as in the benchmark, FP32 output. The activation
    codes and scales are checked first, so a failure says which of the two kernels is wrong."""
    (c, s, o), x = _m128_k2048_case()
    (M, K), N = x.shape, c.shape[0]
    gpu_q = kq._config(M, K, 16, interpret=False)
    cfg = GemmConfig(BN=64, BM=64, BKW=16, split=1, num_warps=4, num_stages=3, bf16_decode=True, dot_order=True)
    assert uses_dot_order(cfg.dot_order, K, cfg.BKW, cfg.tma)  # K and the K-tile of 128 elements: the dot order runs
    assert gpu_q[:3] == (1, 128, True)
    if ON_GPU:
        assert kq._config(M, K, 16) == gpu_q and default_config(M, N, K, DEV) == cfg
    else:
        with monkeypatch.context() as mp:  # the GPU's choice, read on the CPU too (M > 64: no split-K, no SM count)
            mp.setattr(kg, "INTERPRET", False)
            assert default_config(M, N, K, DEV) == cfg
        monkeypatch.setattr(kq, "_config", lambda *a: gpu_q)
    q = host(kq.quantize_rows(dev(x), "nvfp4"))
    qc, qs, qo = ref.nvfp4_quantize(x.float(), outer="row")
    assert torch.equal(q.codes(), qc) and torch.equal(q.scales, qs) and torch.equal(q.outer, qo)
    y = fp4_linear(dev(x), prepare_weight(*dev(c, s, o)), act_quant=True, out_dtype=torch.float32, config=cfg)
    assert rel(y, ref.fp4_linear(x.float(), c, s, o, act_quant=True)) < (GPU_TOL_M128_K2048 if ON_GPU else TOL)


@pytest.mark.parametrize("M,K", [(1, 4096), (128, 2048), (128, 14336), (4096, 1024), (64, 16384), (7, 256)])
def test_gpu_quantize_takes_one_row_per_program(M, K):
    """The tile the GPU gets is one row per program at every shape (kernels/NOTES.md, v2d: several rows per
    program miscompiled for bf16 inputs under Triton 3.6 on an H200)."""
    assert kq._config(M, K, 16, interpret=False)[0] == 1


def test_errors():
    c, s, o = dev(*_w(16, 32, 3))
    pw = prepare_weight(c, s, o)
    with pytest.raises(ValueError, match="non-finite"):
        fp4_linear(torch.full((1, 32), float("nan"), device=DEV), pw)
    with pytest.raises(ValueError, match="K="):
        fp4_linear(torch.ones(1, 48, device=DEV), pw)
    with pytest.raises(TypeError):
        fp4_linear(torch.ones(1, 32, dtype=torch.int64, device=DEV), pw)
    with pytest.raises(ValueError):
        prepare_weight(c, s[:, :1], o)
    with pytest.raises(ValueError):
        prepare_weight(c[:, :24], s, o)
    with pytest.raises(ValueError, match="kind"):  # "mma" names the MMA tile; no other kind runs it
        fp4_linear(torch.ones(1, 32, device=DEV), pw, config=GemmConfig(kind="wgmma"))
    assert fp4_linear(torch.ones(0, 32, device=DEV), pw).shape == (0, 16)


@pytest.mark.parametrize("M,config", [(1, None), (17, None), (5, "mma")])
def test_on_quant_sees_the_codes_the_kernel_multiplies(M, config):
    """W4A4: the observer gets the activation's codes, scale bytes and S_enc once, bit-identical to the
    reference quantization (what a rollout recorder keeps), on the GEMV (M 1) and MMA paths."""
    (c, s, o), x = _mma_case(M, 40, 96)
    cfg = GemmConfig(BN=16, BM=16, split=1, num_stages=1, **MMA_KW) if config == "mma" else None
    seen = []
    fp4_linear(dev(x), prepare_weight(*dev(c, s, o)), act_quant=True, config=cfg, on_quant=seen.append)
    assert len(seen) == 1
    rc, rs, ro = ref.nvfp4_quantize(x.float(), outer="row")
    q = seen[0]
    assert torch.equal(host(q.codes()), rc) and torch.equal(host(q.scales), rs) and torch.equal(host(q.outer), ro)


@pytest.mark.parametrize("M,N,K", [(1, 40, 256), (17, 33, 512), (5, 70, 768)])
@pytest.mark.parametrize("act_quant", [False, True])
def test_tma_tiles_give_the_pointer_path_bit_for_bit(M, N, K, act_quant):
    """GemmConfig(tma=True) brings the weight words and scales by tensor descriptors (TMA on a GPU) instead of
    per-thread loads: the same values reach the same decode and MMA, so the output is the pointer path's exactly,
    rows past N and split-K included (TMA reads 0 past the ends, as the loads' masks)."""
    (c, s, o), x = _mma_case(M, N, K)
    pw = prepare_weight(*dev(c, s, o))
    base = dict(MMA_KW, BN=16, BM=16, split=2 if K >= 512 else 1, num_stages=1, BKW=32)
    y_tma = fp4_linear(dev(x), pw, act_quant=act_quant, config=GemmConfig(tma=True, **base))
    y = fp4_linear(dev(x), pw, act_quant=act_quant, config=GemmConfig(**base))
    if base["split"] > 1 and ON_GPU:  # split-K adds its partial sums with atomics, in no fixed order
        assert rel(y_tma, host(y).float()) < GPU_TOL_MMA
    else:
        assert torch.equal(y_tma, y)
    assert rel(y_tma, ref.fp4_linear(x, c, s, o, act_quant=act_quant)) < TOL_MMA


@pytest.mark.parametrize("M,N,K,act_quant", [(1, 40, 256, True), (17, 33, 512, False)])
def test_register_cap_changes_no_value(M, N, K, act_quant):
    """GemmConfig(maxnreg=64) compiles the same tile under a register cap (on a GPU: another register allocation, spills
    where 64 do not suffice): the same instructions on the same values, so the uncapped output bit for bit."""
    (c, s, o), x = _mma_case(M, N, K)
    pw = prepare_weight(*dev(c, s, o))
    base = dict(MMA_KW, BN=16, BM=16, split=1, num_stages=1)
    y = fp4_linear(dev(x), pw, act_quant=act_quant, config=GemmConfig(maxnreg=64, **base))
    assert torch.equal(y, fp4_linear(dev(x), pw, act_quant=act_quant, config=GemmConfig(**base)))
    assert rel(y, ref.fp4_linear(x, c, s, o, act_quant=act_quant)) < TOL_MMA


@pytest.mark.parametrize("M,N,K,split,bkw", [(1, 40, 256, 1, 16), (17, 33, 512, 2, 16), (5, 70, 384, 2, 16),
                                              (3, 20, 768, 2, 32)])
@pytest.mark.parametrize("act_quant", [False, True])
def test_dot_order_gives_the_pair_order_values(M, N, K, split, bkw, act_quant):
    """GemmConfig(dot_order=True): the weight in the dot order (`PreparedFP4Weight.dotted`) decoded by
    `kernels.gemm.dot_decode` into the same tile values in the same k order. In the interpreter that is the pair
    path's output bit for bit; on a GPU the MMA takes its left operand from registers, not from shared memory, so the
    check there is the oracle's tolerance. K 384 in two splits: a split that ends inside a tile (the K mask); K-tiles
    of 256 (two groups of the order per tile, the GPU default at BM 16) over K 768 in two splits."""
    (c, s, o), x = _mma_case(M, N, K)
    pw = prepare_weight(*dev(c, s, o))
    base = dict(MMA_KW, BN=16, BM=16, split=split, num_stages=1, BKW=bkw)
    y_dot = fp4_linear(dev(x), pw, act_quant=act_quant, config=GemmConfig(dot_order=True, **base))
    assert pw.dot_words is not None
    if not ON_GPU:
        assert torch.equal(y_dot, fp4_linear(dev(x), pw, act_quant=act_quant, config=GemmConfig(**base)))
    assert rel(y_dot, ref.fp4_linear(x, c, s, o, act_quant=act_quant)) < TOL_MMA


def test_dot_order_needs_k_in_groups_of_128():
    """Where K or the K-tile is not a multiple of 128 the config's dot_order leaves the weight in the pair order."""
    (c, s, o), x = _mma_case(3, 16, 192)
    pw = prepare_weight(*dev(c, s, o))
    base = dict(MMA_KW, BN=16, BM=16, split=1, num_stages=1, BKW=8)
    y = fp4_linear(dev(x), pw, config=GemmConfig(dot_order=True, **base))
    assert pw.dot_words is None and rel(y, ref.fp4_linear(x, c, s, o)) < TOL_MMA


def test_tma_needs_16_byte_rows():
    (c, s, o), x = _mma_case(3, 16, 96)  # 6 scale bytes per row: not a TMA row
    with pytest.raises(ValueError, match="tma needs"):
        fp4_linear(dev(x), prepare_weight(*dev(c, s, o)), config=GemmConfig(tma=True, BN=16, BM=16, BKW=32))


def _fused_quant_case(M, N, K, seed, dtype):
    """Weight and fresh activations x [M, K] (BF16-exact) with an all-zero row, a row with a huge outlier (its other
    elements' blocks fall to tiny or zero scales) and a zero block."""
    g = torch.Generator().manual_seed(seed)
    c, s, o = _w(N, K, seed)
    x = bf16_exact(torch.randn(M, K, generator=g) * torch.exp(torch.randn(M, 1, generator=g)))
    x[0] = 0
    x[-1, K // 3] = 3e4
    if M > 2:
        x[1, 16:32] = 0
    return (c, s, o), x.to(dtype)


@pytest.mark.parametrize("M,N,K,split", [(5, 33, 96, 1), (17, 20, 256, 2), (3, 16, 80, 1), (2, 40, 272, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_act_quant_gives_the_unfused_w4a4_bit_for_bit(M, N, K, split, dtype):
    """GemmConfig(fuse_quant=True): the MMA kernel reads x itself, takes each row's S_enc in a first pass over the
    whole row (under split-K too) and quantizes each K-tile in registers (`kernels.quantize.nvfp4_tile_values`): the
    tile values `quantize_act_for_gemm` writes, the same dots and the same 2^7 / S_enc, so the unfused W4A4 output
    bit for bit; zero and outlier rows, and K past the last whole K-tile (80, 272 with the interpreter's 32-element
    tiles) included. On a GPU split-K adds partial sums with atomics in no fixed order (the tolerance there)."""
    (c, s, o), x = _fused_quant_case(M, N, K, M * K, dtype)
    pw = prepare_weight(*dev(c, s, o))
    base = dict(MMA_KW, BN=16, BM=16, split=split, num_stages=1)
    kw = dict(act_quant=True, out_dtype=torch.float32)
    y = fp4_linear(dev(x), pw, config=GemmConfig(fuse_quant=True, **base), **kw)
    y0 = fp4_linear(dev(x), pw, config=GemmConfig(**base), **kw)
    if split > 1 and ON_GPU:
        assert rel(y, host(y0)) < GPU_TOL_MMA
    else:
        assert torch.equal(y, y0)
    assert rel(y, ref.fp4_linear(x.float(), c, s, o, act_quant=True)) < TOL_MMA
    assert torch.equal(host(y)[0], torch.zeros(N))


def test_fused_act_quant_keeps_the_unfused_path_for_an_observer_and_the_gemv():
    """With an on_quant observer (TRACE's record needs the codes, which the fused kernel does not write) fuse_quant
    runs the unfused path: the observer sees the codes once. GEMV kinds ignore fuse_quant (their W4A4 reads the
    dequantized activations)."""
    (c, s, o), x = _fused_quant_case(3, 24, 64, 7, torch.float32)
    pw = prepare_weight(*dev(c, s, o))
    base = dict(MMA_KW, BN=16, BM=16, split=1, num_stages=1)
    seen = []
    y = fp4_linear(dev(x), pw, act_quant=True, config=GemmConfig(fuse_quant=True, **base), on_quant=seen.append)
    assert len(seen) == 1 and torch.equal(host(seen[0].codes()), ref.nvfp4_quantize(x, outer="row")[0])
    assert torch.equal(y, fp4_linear(dev(x), pw, act_quant=True, config=GemmConfig(fuse_quant=True, **base)))
    gv = kg.gemv2_config(3, 24, 64, DEV)
    y_gv = fp4_linear(dev(x), pw, act_quant=True, config=dataclasses.replace(gv, fuse_quant=True))
    assert torch.equal(y_gv, fp4_linear(dev(x), pw, act_quant=True, config=gv))


def test_fused_act_quant_compiles_for_sm90():
    """`_fp4_gemm_kernel` with FQ (split-K, the weight in the dot order, bf16 decode) compiles for sm_90 without a
    GPU, with the quantize's saturating FMAs and the correctly rounded divisions of S_enc in its PTX."""
    sig = {"x_ptr": "*bf16", "xf_ptr": "*bf16", "w_ptr": "*i32", "ws_ptr": "*i32", "wf_ptr": "*fp32", "out_ptr": "*fp32",
           "M": "i32", "N": "i32", "KW": "i32", "stride_xm": "i32", "kw_per_split": "i32", "amax_min": "fp32"}
    cst = dict(BM=16, BN=64, BKW=32, SPLIT=2, INTERP=False, NIT=8, BF16D=True, XF=False, WDESC=False, DOT=True,
               KMASK=False, FQ=True, NITA=16)
    n = compile_sm90("kernels.gemm", "_fp4_gemm_kernel", sig, cst, ("fma.rn.sat", "div.rn"), 4,
                     wide=("KW", "stride_xm", "kw_per_split"))
    assert n["fma.rn.sat"] >= 7 and n["div.rn"] >= 2, n


def test_match_layouts_builds_what_the_other_weight_built():
    """An in-place weight refresh (trace.rollout.weights.copy_into) copies tensor for tensor: the new weight must
    first build the lazy layouts the held one has, from its own words."""
    held, new = (prepare_weight(*_w(32, 128, seed)) for seed in (1, 2))
    held.paired()
    new.match_layouts(held)
    assert new.pair_words is not None and new.dot_words is None
    assert torch.equal(new.pair_words, kg.pair_layout(new.words))
    held.dotted()
    new.match_layouts(held)
    assert new.dot_words is not None and not torch.equal(new.dot_words[0], held.dot_words[0])
