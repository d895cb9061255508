"""Triton FP4 weight GEMM (dense), decode and prefill: y = x @ W^T with W in NVFP4.

What: `prepare_weight` turns an NVFP4 weight (codes [N, K] or [E, N, K], 1x16 E4M3 block scales,
per-tensor / per-expert S_enc) into the kernel layout: int32 words [.., N, K/8] holding 8 consecutive
K-elements (nibble j = element 8i+j, i.e. `pack_fp4` bytes read as little-endian int32), scale
bytes [.., N, K/16] and an FP32 epilogue factor 2^7 / S_enc. `fp4_linear` multiplies BF16 (or FP32)
activations [M, K] by it; with `act_quant=True` the activation is first quantized per row to NVFP4 by
`kernels.quantize.quantize_rows` and dequantized inside the GEMM (W4A4 emulated exactly: both
operands are E2M1 * E4M3 products, exact in BF16, BF16 MMA with FP32 accumulation, outer scales
applied after accumulation).

Kernel ("swap AB"): each program computes acc[BN, BM] = W_tile[BN, K] @ x^T[K, BM], so the tiny
decode batch is the MMA's N dimension. A K-tile of BK elements is BK/8 words per weight row; nibble j
of every word is decoded with the bit trick of `kernels._common` (E2M1 * 2^-126 as FP32 bits, times
s_b * 2^119) and multiplied against the activation columns 8i+j, so no in-register reshape is
needed. Decode uses split-K (FP32 atomics) so that the whole GPU streams the weights.

Compared against: `kernels.reference.fp4_linear` (FP32 dequantize-then-matmul); tests in
tests/kernels/test_gemm.py (interpreter), timing vs cuBLAS BF16 `F.linear` in benchmarks/bench_kernels.py.
Run: `python -m pytest tests/kernels/test_gemm.py -q`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import reference as ref
from kernels._common import (
    EPI_POW,
    INTERPRET,
    check_tensor,
    e4m3_value,
    nib_to_f32_scaled,
    num_sms,
)


@dataclass
class PreparedFP4Weight:
    """Kernel layout of an NVFP4 weight. words int32 [(E,) N, K/8]; scales uint8 [(E,) N, K/16];
    factor fp32 [E] (or [1]) = 2^7 / S_enc."""

    words: torch.Tensor
    scales: torch.Tensor
    factor: torch.Tensor
    N: int
    K: int
    E: int | None = None

    def nbytes(self) -> int:
        return self.words.numel() * 4 + self.scales.numel() + self.factor.numel() * 4


def prepare_weight(codes: torch.Tensor, scales: torch.Tensor, outer: torch.Tensor) -> PreparedFP4Weight:
    """Offline re-layout of an NVFP4 weight (unpacked codes uint8 [(E,) N, K], E4M3 scale bytes
    [(E,) N, K/16], S_enc fp32 scalar or [E, 1, 1]). Accepts `trace.fp4.FP4Tensor` fields directly:
    `prepare_weight(t.codes, t.scales, t.outer)`. 16x16 blocks / MXFP4 weights are not supported."""
    check_tensor(codes, "codes", (torch.uint8,))
    check_tensor(scales, "scales", (torch.uint8,))
    check_tensor(outer, "outer", (torch.float32,), finite=True)
    if codes.dim() not in (2, 3):
        raise ValueError(f"codes must be [N, K] or [E, N, K], got {tuple(codes.shape)}")
    *lead, N, K = codes.shape
    if K % 16:
        raise ValueError(f"K={K} must be a multiple of 16 (NVFP4 blocks)")
    if tuple(scales.shape) != (*lead, N, K // 16):
        raise ValueError(f"scales must have shape {(*lead, N, K // 16)} (1x16 NVFP4 blocks), got {tuple(scales.shape)}")
    E = lead[0] if lead else None
    if bool((outer <= 0).any()):
        raise ValueError("outer scale S_enc must be positive")
    o = outer.reshape(-1)
    if o.numel() not in (1, E or 1):
        raise ValueError(f"outer must hold 1 or E={E} values, got {outer.numel()}")
    words = ref.pack_fp4(codes).contiguous().view(torch.int32)  # [(E,) N, K/8]
    factor = (EPI_POW / o.to(torch.float64)).to(torch.float32).contiguous()
    if E is not None and factor.numel() == 1:
        factor = factor.expand(E).contiguous()
    return PreparedFP4Weight(words, scales.contiguous(), factor, N, K, E)


@triton.jit
def _fp4_tile_dot(acc, w_ptrs, s_ptrs, wmask, x_ptr, xs_ptr, offs_m, mmask, stride_xm, kw0, KW,
                  A_FP4: tl.constexpr, BKW: tl.constexpr, INTERP: tl.constexpr):
    """acc[BN, BM] += dequant(W[:, 8*kw0 : 8*(kw0+BKW)]) @ x[offs_m, same]^T.
    w_ptrs: [BN, BKW] pointers to the words at kw0; s_ptrs: [BN, BKW] pointers to their scales."""
    offs_i = tl.arange(0, BKW)
    kmask = (kw0 + offs_i) < KW
    wmask2 = wmask & kmask[None, :]
    w = tl.load(w_ptrs, mask=wmask2, other=0)  # [BN, BKW] int32, 8 nibbles each
    sc = e4m3_value(tl.load(s_ptrs, mask=wmask2, other=0)) * 6.646139978924579e35  # s_b * 2^119
    xmask = kmask[:, None] & mmask[None, :]
    if A_FP4:
        xw = tl.load(x_ptr + offs_m[None, :].to(tl.int64) * KW + (kw0 + offs_i)[:, None], mask=xmask, other=0)
        xsc = e4m3_value(tl.load(xs_ptr + offs_m[None, :].to(tl.int64) * (KW // 2) + ((kw0 + offs_i) // 2)[:, None],
                                 mask=xmask, other=0)) * 6.646139978924579e35
    for j in tl.static_range(8):
        wj = nib_to_f32_scaled(w >> (4 * j)) * sc  # [BN, BKW] = q * s_b * 2^-7, exact
        if A_FP4:
            xj = nib_to_f32_scaled(xw >> (4 * j)) * xsc  # [BKW, BM]
        else:
            xj = tl.load(x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + ((kw0 + offs_i) * 8 + j)[:, None],
                         mask=xmask, other=0.0)
        if INTERP:
            acc += tl.dot(wj, xj.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(wj.to(tl.bfloat16), xj.to(tl.bfloat16))
    return acc


@triton.jit
def _fp4_gemm_kernel(x_ptr, xs_ptr, xf_ptr, w_ptr, ws_ptr, wf_ptr, out_ptr,
                     M, N, KW, stride_xm, kw_per_split,
                     BM: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr, A_FP4: tl.constexpr,
                     SPLIT: tl.constexpr, INTERP: tl.constexpr, NIT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)  # [BN]
    offs_m = pid_m * BM + tl.arange(0, BM)  # [BM]
    nmask = offs_n < N
    mmask = offs_m < M
    offs_i = tl.arange(0, BKW)
    kw_lo = pid_k * kw_per_split
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * KW + (kw_lo + offs_i)[None, :]
    s_ptrs = ws_ptr + offs_n[:, None].to(tl.int64) * (KW // 2) + ((kw_lo + offs_i) // 2)[None, :]
    acc = tl.zeros([BN, BM], tl.float32)
    for it in range(NIT):  # constexpr trip count (the interpreter cannot loop to a runtime bound)
        kw0 = kw_lo + it * BKW
        acc = _fp4_tile_dot(acc, w_ptrs, s_ptrs, nmask[:, None], x_ptr, xs_ptr, offs_m, mmask, stride_xm, kw0, KW,
                            A_FP4, BKW, INTERP)
        w_ptrs += BKW
        s_ptrs += BKW // 2
    acc = acc * tl.load(wf_ptr)
    if A_FP4:
        acc = acc * tl.load(xf_ptr + offs_m, mask=mmask, other=0.0)[None, :]
    o_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * N + offs_n[:, None]  # out [M, N], tile transposed
    omask = nmask[:, None] & mmask[None, :]
    if SPLIT > 1:
        tl.atomic_add(o_ptrs, acc, mask=omask, sem="relaxed")
    else:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _fp4_gemv_kernel(x_ptr, w_ptr, ws_ptr, wf_ptr, out_ptr, M, N, KW, stride_xm, kw_per_split,
                     BN: tl.constexpr, BKW: tl.constexpr, SPLIT: tl.constexpr, NIT: tl.constexpr):
    """Decode GEMV without tensor cores: one activation row per program (grid axis 1), FMA into a
    [BN, BKW, 8] FP32 register tile, one reduction at the end. No layout conversions, no MMA."""
    pid_n = tl.program_id(0)
    m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < N
    offs_i = tl.arange(0, BKW)
    offs_j = tl.arange(0, 8)
    kw_lo = pid_k * kw_per_split
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * KW + (kw_lo + offs_i)[None, :]
    s_ptrs = ws_ptr + offs_n[:, None].to(tl.int64) * (KW // 2) + ((kw_lo + offs_i) // 2)[None, :]
    x_ptrs = x_ptr + m.to(tl.int64) * stride_xm + ((kw_lo + offs_i) * 8)[:, None] + offs_j[None, :]  # [BKW, 8]
    acc = tl.zeros([BN, BKW, 8], tl.float32)
    for it in range(NIT):
        kmask = (kw_lo + it * BKW + offs_i) < KW
        wm = nmask[:, None] & kmask[None, :]
        w = tl.load(w_ptrs, mask=wm, other=0)  # [BN, BKW] int32
        sc = e4m3_value(tl.load(s_ptrs, mask=wm, other=0)) * 6.646139978924579e35
        x = tl.load(x_ptrs, mask=kmask[:, None], other=0.0).to(tl.float32)  # [BKW, 8]
        q = nib_to_f32_scaled(w[:, :, None] >> (4 * offs_j)[None, None, :])  # [BN, BKW, 8]
        acc += (q * sc[:, :, None]) * x[None, :, :]  # q*s_b*2^-7 first: sc*x alone can overflow
        w_ptrs += BKW
        s_ptrs += BKW // 2
        x_ptrs += BKW * 8
    y = tl.sum(tl.sum(acc, axis=2), axis=1) * tl.load(wf_ptr)  # [BN]
    o_ptrs = out_ptr + m.to(tl.int64) * N + offs_n
    if SPLIT > 1:
        tl.atomic_add(o_ptrs, y, mask=nmask, sem="relaxed")
    else:
        tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=nmask)


@dataclass(frozen=True)
class GemmConfig:
    kind: str = "mma"  # "mma" (tensor cores, any M) or "gemv" (FMA, one row per program, W4A16 only)
    BN: int = 64
    BM: int = 16
    BKW: int = 32  # words per K-tile (BK = 8 * BKW elements)
    split: int = 1
    num_warps: int = 4
    num_stages: int = 3


def default_config(M: int, N: int, K: int, device) -> GemmConfig:
    """Heuristic: BM covers the batch up to 64 (prefill tiles of 64), split-K until ~4 waves of CTAs."""
    if INTERPRET:
        return GemmConfig(BN=16, BM=16, BKW=4, split=2 if K >= 128 else 1, num_warps=1, num_stages=1)
    bm = 16 if M <= 16 else (32 if M <= 32 else 64)
    bn = 64 if M <= 64 else 128
    bkw = 32
    tiles = triton.cdiv(N, bn) * triton.cdiv(M, bm)
    kw = K // 8
    split = 1
    target = 4 * num_sms(device)
    while tiles * split < target and kw // (split * 2) >= 4 * bkw and M <= 64:
        split *= 2
    return GemmConfig(BN=bn, BM=bm, BKW=bkw, split=split, num_warps=4, num_stages=4)


def quantize_act_for_gemm(x: torch.Tensor, check_finite: bool = True):
    """Per-row NVFP4 quantize of x [M, K] for the W4A4 path -> (words int32 [M, K/8], scales [M, K/16],
    factor fp32 [M] = 2^7 / S_enc)."""
    from kernels.quantize import quantize_rows

    q = quantize_rows(x, "nvfp4", check_finite=check_finite)
    return q.packed.view(torch.int32), q.scales, (EPI_POW / q.outer.reshape(-1))


def fp4_linear(x: torch.Tensor, w: PreparedFP4Weight, *, act_quant: bool = False, out_dtype: torch.dtype | None = None,
               config: GemmConfig | None = None, check_finite: bool = True) -> torch.Tensor:
    """y [M, N] = x [M, K] @ dequant(W)^T. x: bf16/fp16/fp32 (fp32 under the interpreter).
    act_quant: W4A4 emulation (per-row NVFP4 activations). out_dtype defaults to x.dtype."""
    check_tensor(x, "x", (torch.bfloat16, torch.float16, torch.float32), dim=2, finite=check_finite)
    if not isinstance(w, PreparedFP4Weight) or w.E is not None:
        raise TypeError("w must be a dense PreparedFP4Weight from prepare_weight(codes [N, K], ...)")
    M, K = x.shape
    if K != w.K:
        raise ValueError(f"x has K={K}, weight has K={w.K}")
    if x.device != w.words.device:
        raise ValueError(f"x on {x.device}, weight on {w.words.device}")
    out_dtype = out_dtype or x.dtype
    N = w.N
    cfg = config or default_config(M, N, K, x.device)
    if M == 0:
        return torch.empty((0, N), dtype=out_dtype, device=x.device)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if act_quant:
        xa, xs, xf = quantize_act_for_gemm(x, check_finite=False)
        stride_xm = K // 8
    else:
        xa, xs, xf, stride_xm = x, x, x, x.stride(0)
    KW = K // 8
    split = max(1, min(cfg.split, triton.cdiv(KW, cfg.BKW)))
    kw_per_split = triton.cdiv(triton.cdiv(KW, split), cfg.BKW) * cfg.BKW
    split = triton.cdiv(KW, kw_per_split)
    if split > 1:
        out = torch.zeros((M, N), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if cfg.kind == "gemv" and not act_quant:
        grid = (triton.cdiv(N, cfg.BN), M, split)
        _fp4_gemv_kernel[grid](xa, w.words, w.scales, w.factor, out, M, N, KW, stride_xm, kw_per_split,
                               BN=cfg.BN, BKW=cfg.BKW, SPLIT=split, NIT=kw_per_split // cfg.BKW,
                               num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return out if out.dtype == out_dtype else out.to(out_dtype)
    grid = (triton.cdiv(N, cfg.BN), triton.cdiv(M, cfg.BM), split)
    _fp4_gemm_kernel[grid](xa, xs, xf, w.words, w.scales, w.factor, out, M, N, KW, stride_xm, kw_per_split,
                           BM=cfg.BM, BN=cfg.BN, BKW=cfg.BKW, A_FP4=act_quant, SPLIT=split, INTERP=INTERPRET, NIT=kw_per_split // cfg.BKW,
                           num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out if out.dtype == out_dtype else out.to(out_dtype)
