"""Triton grouped MoE expert GEMMs over NVFP4 weights (decode and prefill), SiLU-gated.

What: tokens are routed to `topk` experts; slots (token, k) are sorted by expert and padded per expert
to multiples of BM (`moe_align`, one Triton launch, no host sync, so it can live in a CUDA graph). Two
launches then do the expert MLP:
  1. gate/up: h[slot] = silu(x[tok] @ Wg[e]^T) * (x[tok] @ Wu[e]^T), both products in one program
     (the SiLU product is fused: h is written once, in the activation dtype);
  2. down: y[slot] = topk_weight[slot] * (h[slot] @ Wd[e]^T), followed by a sum over the k slots of
     each token (torch, [T, k, H] -> [T, H]).
Weights use the layout of `kernels.gemm.prepare_weight` (int32 words of 8 nibbles, E4M3 scale bytes,
per-expert epilogue factor 2^7/S_enc). With `act_quant=True` the gate/up input is NVFP4-quantized per
token (shared by its experts) and the down input per (token, expert slot), as in DESIGN.md §2: on the
MMA path the GEMMs run W4A4 emulated exactly (BF16 MMA over E2M1*E4M3 products, FP32 accumulation), the
quantize kernel writing each activation's tile values q * s_b * 2^-7 (exact in BF16) for the tile to read
(`kernels.gemm.quantize_act_for_gemm`); on the decode GEMV path the quantize kernel writes the dequantized
activations instead (same codes and scales, one rounding to the activation dtype) and the W4A16 kernels read
them.
Below 1 (token, slot) row per expert the GEMMs are the decode GEMV kernels (the inner loop of kernels/gemv.py), from
1 on the MMA tile of `kernels.gemm.fp4_tile_dot` (on a GPU decoded in bf16 from the weights in the dot order,
`kernels.gemm.dot_decode`) with BM slots per block chosen by the expected number of blocks per expert
(`moe_block_rows`), `default_moe_config`; kernels/NOTES.md, "Grouped MoE".
Experts with no tokens launch programs that exit at once; their weights are never read.

Compared against: `kernels.reference.moe_fp4_reference` (FP32 dequantize-then-matmul); timing vs
`torch._grouped_mm` BF16 in benchmarks/bench_kernels.py. Run: `python -m pytest tests/kernels/test_moe.py -q`.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels._common import INTERPRET, check_tensor
from kernels.gemm import (
    PreparedFP4Weight,
    act_tile,
    act_tile_quant,
    fp4_tile_dot,
    fused_act_senc,
    prepare_weight,
    quantize_act_for_gemm,
    uses_dot_order,
)
from kernels.gemv import GV_GK, gv_group
from kernels.moe_align import moe_align  # noqa: F401  (the grouped GEMMs' slot order; re-exported)
from kernels.reference import AMAX_MIN


@dataclass
class MoEWeights:
    """w13: gate rows [0, I) and up rows [I, 2I) of each expert, [E, 2I, H/8] words; factor [E, 2]
    (gate, up). w2: down, [E, H, I/8] words, factor [E]."""

    w13: PreparedFP4Weight
    w2: PreparedFP4Weight
    E: int
    H: int
    I: int

    def nbytes(self) -> int:
        return self.w13.nbytes() + self.w2.nbytes()


def _fields(t):
    if isinstance(t, (tuple, list)):
        return t
    return t.codes, t.scales, t.outer


def prepare_moe_weights(gate, up, down) -> MoEWeights:
    """gate, up: NVFP4 (codes [E, I, H], scales [E, I, H/16], outer [E, 1, 1] or scalar), as tuples
    or FP4Tensor; down: (codes [E, H, I], scales [E, H, I/16], outer)."""
    g, u, d = (prepare_weight(*_fields(t)) for t in (gate, up, down))
    if g.E is None or u.E is None or d.E is None:
        raise ValueError("expert weights need a leading expert dimension [E, N, K]")
    if (g.E, g.N, g.K) != (u.E, u.N, u.K):
        raise ValueError(f"gate {(g.E, g.N, g.K)} and up {(u.E, u.N, u.K)} shapes differ")
    if (d.E, d.N, d.K) != (g.E, g.K, g.N):
        raise ValueError(f"down must be [E, H, I] = {(g.E, g.K, g.N)}, got {(d.E, d.N, d.K)}")
    w13 = PreparedFP4Weight(torch.cat([g.words, u.words], 1).contiguous(), torch.cat([g.scales, u.scales], 1).contiguous(),
                            torch.stack([g.factor, u.factor], 1).contiguous(), 2 * g.N, g.K, g.E,
                            torch.cat([g.gv_words, u.gv_words], 2).contiguous(),  # [E, G, 2I, 8, 4]
                            torch.cat([g.gv_scales, u.gv_scales], 2).contiguous())
    return MoEWeights(w13, d, g.E, g.K, g.N)




@triton.jit
def _moe_gemm_kernel(x_ptr, xf_ptr, w_ptr, ws_ptr, wf_ptr, out_ptr, slots_ptr, bexp_ptr, rw_ptr,
                     S, N, KW, stride_xm, A_DIV, amax_min,
                     BM: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr, GATED: tl.constexpr,
                     ROUTE_W: tl.constexpr, INTERP: tl.constexpr, NIT: tl.constexpr, BF16D: tl.constexpr,
                     XF: tl.constexpr, WDESC: tl.constexpr = False, DOT: tl.constexpr = False,
                     FQ: tl.constexpr = False):
    """One program = one block of BM slots of one expert x BN output rows, over the MMA tile of
    `kernels.gemm.fp4_tile_dot` (gate and up rows in one program, reading one activation tile, SiLU product
    fused; routing weight fused into down). BF16D: the tile's decode in bf16 (GPU only; weight words in
    `pair_layout`). XF (W4A4: x holds the activation's tile values): times the activation row's 2^7 / S_enc
    (xf_ptr). WDESC: w_ptr / ws_ptr are tensor descriptors over the experts' words and scales as 2-D [E * NW, K/8]
    and [E * NW, K/16] (TMA, `MoEConfig.tma`); a tile's rows past its expert's N read the next expert's rows (or 0
    past the last), which only feed output rows the store masks. DOT: the words in the dot order and the scales int32
    [E * NW, K/64] (`PreparedFP4Weight.dotted`; K a multiple of the K-tile, no mask along K). Programs of padding
    blocks (expert -1) exit at once.
    FQ (W4A4, `MoEConfig.fuse_quant`): x holds the activation itself (x per token for gate/up, h per slot for down);
    a first loop over each of the block's rows gives its S_enc (`kernels.gemm.fused_act_senc`), each K-tile is
    quantized in registers to the tile values XF would read (`kernels.gemm.act_tile_quant`) and the epilogue
    multiplies by 2^7 / S_enc: XF's operands and output without the quantize launch. Every N-tile program of a block
    quantizes the block's rows again (N / BN times per launch)."""
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(bexp_ptr + pid_b)
    if e < 0:
        return
    slots = tl.load(slots_ptr + pid_b * BM + tl.arange(0, BM))  # [BM] slot ids, S = padding
    mmask = slots < S
    rows = tl.where(mmask, slots // A_DIV, 0)  # activation rows (token for gate/up, slot for down)
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < N
    e64 = e.to(tl.int64)
    if GATED:
        NW = 2 * N  # weight rows per expert: gate [0, N), up [N, 2N)
    else:
        NW = N
    acc = tl.zeros([BN, BM], tl.float32)
    if GATED:
        acc_u = tl.zeros([BN, BM], tl.float32)
    SKW: tl.constexpr = 8 if DOT else 2  # words per scale element: int32 of 4 bytes / one byte
    if WDESC:  # the descriptors themselves; the tile's first row of the 2-D view
        wb, sb, wb_u, sb_u = w_ptr, ws_ptr, w_ptr, ws_ptr
    else:
        wb = w_ptr + e64 * NW * KW  # words of expert e: [NW, K/8]
        sb = ws_ptr + e64 * NW * (KW // SKW)
        wb_u, sb_u = wb + N * KW, sb + N * (KW // SKW)
    n0 = e * NW + pid_n * BN
    if FQ:
        s_enc = fused_act_senc(x_ptr, rows, mmask, stride_xm, KW * 8, amax_min, BM, 8 * BKW, NIT)
    for it in range(NIT):
        k0 = it * BKW * 8
        if FQ:
            xv = act_tile_quant(x_ptr, rows, mmask, stride_xm, k0, KW * 8, s_enc, BM, 8 * BKW, INTERP)  # [BK, BM]
        else:
            xv = act_tile(x_ptr, rows, mmask, stride_xm, k0, KW * 8, 8 * BKW)  # [BK, BM]
        acc = fp4_tile_dot(acc, wb, sb, offs_n, nmask, xv, k0, KW * 8, BN, 8 * BKW, INTERP, BF16D, WDESC, n0,
                           DOT, not DOT)
        if GATED:  # the up rows read the same activation tile
            acc_u = fp4_tile_dot(acc_u, wb_u, sb_u, offs_n, nmask, xv, k0, KW * 8, BN, 8 * BKW, INTERP, BF16D,
                                 WDESC, n0 + N, DOT, not DOT)
    if GATED:
        acc = acc * tl.load(wf_ptr + e * 2)
        acc_u = acc_u * tl.load(wf_ptr + e * 2 + 1)
    else:
        acc = acc * tl.load(wf_ptr + e)
    if XF or FQ:
        if XF:
            xf = tl.load(xf_ptr + rows, mask=mmask, other=0.0)[None, :]
        else:  # 2^7 / S_enc, correctly rounded as quantize_act_for_gemm's division
            xf = tl.math.div_rn(tl.full([BM], 128.0, tl.float32), s_enc)[None, :]
        acc = acc * xf
        if GATED:
            acc_u = acc_u * xf
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_u  # silu(g) * u
    if ROUTE_W:
        acc = acc * tl.load(rw_ptr + slots, mask=mmask, other=0.0)[None, :]
    o_ptrs = out_ptr + slots[None, :].to(tl.int64) * N + offs_n[:, None]  # out [S, N]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=nmask[:, None] & mmask[None, :])


@triton.jit
def _moe_gemv_kernel(x_ptr, w_ptr, s_ptr, wf_ptr, out_ptr, slots_ptr, bexp_ptr, rw_ptr,
                     S, N, K, G, stride_xm, A_DIV,
                     BN: tl.constexpr, BM: tl.constexpr, U: tl.constexpr, GATED: tl.constexpr,
                     ROUTE_W: tl.constexpr, NIT: tl.constexpr, EVEN: tl.constexpr):
    """Decode path: one program = one block of BM <= 4 slots of one expert x BN output rows, the dense decode
    GEMV's inner loop (`kernels.gemv.gv_group`) over the expert's `gemv_layout` weight (gate and up rows in one
    program, SiLU product fused; routing weight fused into down)."""
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(bexp_ptr + pid_b)
    if e < 0:
        return
    sl0 = tl.load(slots_ptr + pid_b * BM)
    sl1 = S
    sl2 = S
    sl3 = S
    if BM > 1:
        sl1 = tl.load(slots_ptr + pid_b * BM + 1)
    if BM > 2:
        sl2 = tl.load(slots_ptr + pid_b * BM + 2)
    if BM > 3:
        sl3 = tl.load(slots_ptr + pid_b * BM + 3)
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < N
    n3 = offs_n[None, :, None]
    t3 = tl.arange(0, 8)[:, None, None]
    w3 = tl.arange(0, 4)[None, None, :]
    if GATED:
        NW = 2 * N  # gate rows [0, N), up rows [N, 2N)
    else:
        NW = N
    e64 = e.to(tl.int64)
    wb = w_ptr + e64 * G * NW * 32
    sb = s_ptr + e64 * G * NW * 32
    xr0 = x_ptr + tl.where(sl0 < S, sl0 // A_DIV, 0).to(tl.int64) * stride_xm
    xr1 = x_ptr + tl.where(sl1 < S, sl1 // A_DIV, 0).to(tl.int64) * stride_xm
    xr2 = x_ptr + tl.where(sl2 < S, sl2 // A_DIV, 0).to(tl.int64) * stride_xm
    xr3 = x_ptr + tl.where(sl3 < S, sl3 // A_DIV, 0).to(tl.int64) * stride_xm
    acc0 = tl.zeros([8, BN, 4], tl.float32)
    acc1 = tl.zeros([8, BN, 4], tl.float32)
    acc2 = tl.zeros([8, BN, 4], tl.float32)
    acc3 = tl.zeros([8, BN, 4], tl.float32)
    u0 = tl.zeros([8, BN, 4], tl.float32)
    u1 = tl.zeros([8, BN, 4], tl.float32)
    u2 = tl.zeros([8, BN, 4], tl.float32)
    u3 = tl.zeros([8, BN, 4], tl.float32)
    for it in range(NIT):
        for uu in tl.static_range(U):
            g = it * U + uu
            base = (g.to(tl.int64) * NW + n3) * 32 + t3 * 4 + w3  # [8, BN, 4]
            kk = g * 256 + t3 * 32 + w3
            if EVEN:
                wmask = None
                xok = kk >= 0
            else:
                wmask = (n3 < N) & (g < G)
                xok = (kk < K) & (g < G)
            acc0, acc1, acc2, acc3 = gv_group(
                acc0, acc1, acc2, acc3, wb + base, sb + base, wmask, xr0 + kk, xr1 + kk, xr2 + kk, xr3 + kk,
                xok & (sl0 < S), xok & (sl1 < S), xok & (sl2 < S), xok & (sl3 < S), kk, K, BM)
            if GATED:
                u0, u1, u2, u3 = gv_group(
                    u0, u1, u2, u3, wb + base + N * 32, sb + base + N * 32, wmask, xr0 + kk, xr1 + kk, xr2 + kk,
                    xr3 + kk, xok & (sl0 < S), xok & (sl1 < S), xok & (sl2 < S), xok & (sl3 < S), kk, K, BM)
    if GATED:
        fg = tl.load(wf_ptr + e * 2)
        fu = tl.load(wf_ptr + e * 2 + 1)
    else:
        fg = tl.load(wf_ptr + e)
        fu = fg
    _moe_gv_store(out_ptr, acc0, u0, fg, fu, sl0, S, N, offs_n, nmask, rw_ptr, GATED, ROUTE_W)
    if BM > 1:
        _moe_gv_store(out_ptr, acc1, u1, fg, fu, sl1, S, N, offs_n, nmask, rw_ptr, GATED, ROUTE_W)
    if BM > 2:
        _moe_gv_store(out_ptr, acc2, u2, fg, fu, sl2, S, N, offs_n, nmask, rw_ptr, GATED, ROUTE_W)
    if BM > 3:
        _moe_gv_store(out_ptr, acc3, u3, fg, fu, sl3, S, N, offs_n, nmask, rw_ptr, GATED, ROUTE_W)


@triton.jit
def _moe_gv_store(out_ptr, acc, accu, fg, fu, slot, S, N, offs_n, nmask, rw_ptr, GATED: tl.constexpr,
                  ROUTE_W: tl.constexpr):
    y = tl.sum(tl.sum(acc, axis=2), axis=0) * fg
    if GATED:
        yu = tl.sum(tl.sum(accu, axis=2), axis=0) * fu
        y = y / (1.0 + tl.exp(-y)) * yu
    ok = slot < S
    if ROUTE_W:
        y = y * tl.load(rw_ptr + tl.where(ok, slot, 0))
    tl.store(out_ptr + slot.to(tl.int64) * N + offs_n, y.to(out_ptr.dtype.element_ty), mask=nmask & ok)


def moe_gemv(a, w: PreparedFP4Weight, sorted_slots, block_expert, S: int, *, a_div: int, gated: bool,
             route_w=None, BM=4, BN=32, U=1, num_warps=4, out_dtype=None):
    """Grouped decode GEMV launch over the GEMV layout (W4A16 only). a: activations [R, K]; row of slot s is
    s // a_div. sorted_slots/block_expert from moe_align(topk_ids, E, BM) with the same BM (<= 4)."""
    if w.gv_words is None:
        raise ValueError("expert weights were prepared without the GEMV layout")
    if BM > 4:
        raise ValueError("moe_gemv handles BM <= 4 slots per block")
    N = w.N // 2 if gated else w.N
    K = w.K
    G = w.gv_words.shape[1]
    out = torch.empty((S, N), dtype=out_dtype or a.dtype, device=a.device)
    nb = block_expert.numel()
    grid = (nb, triton.cdiv(N, BN))
    even = N % BN == 0 and K % GV_GK == 0 and G % U == 0
    _moe_gemv_kernel[grid](a, w.gv_words, w.gv_scales, w.factor, out, sorted_slots, block_expert,
                           route_w if route_w is not None else out, S, N, K, G, a.stride(0), a_div,
                           BN=BN, BM=BM, U=U, GATED=gated, ROUTE_W=route_w is not None, NIT=triton.cdiv(G, U),
                           EVEN=even, num_warps=num_warps, num_stages=1)
    return out


KINDS = ("mma", "gemv")


@dataclass(frozen=True)
class MoEConfig:
    BM: int = 16
    BN: int = 64
    BKW: int = 16
    num_warps: int = 4
    num_stages: int = 3
    BN_down: int = 64
    kind: str = "mma"  # "mma" (tensor cores, any T: one MMA per K-tile decoded in element order; W4A4 on the
    #                    activations' tile values) or "gemv" (the decode GEMV, BM <= 4; W4A4 on dequantized activations)
    U: int = 1  # gemv: K-groups of 256 per loop iteration
    bf16_decode: bool = True  # mma on a GPU: decode and scale in bf16 (interpreter: fp32)
    tma: bool = False  # mma: the weight words and scales by TMA (BKW a multiple of 32); level with or slower than the
    #                    pointer tile on the H200 (kernels/NOTES.md, "Dense FP4 GEMM and GEMV")
    maxnreg: int | None = None  # mma: register cap per thread of the gate/up launch (PTX .maxnreg; level to 23% slower on
    #                             the H200, kernels/NOTES.md, "Grouped MoE")
    maxnreg_down: int | None = None  # the same for the down launch; None: the compiler's choice
    dot_order: bool = False  # mma: the weights in the dot order (`kernels.gemm.PreparedFP4Weight.dotted`) where K and
    #                          the K-tile are multiples of 128 and without tma; else the pair / element order
    fuse_quant: bool = False  # mma with act_quant and no on_quant observer: both launches quantize their activation
    #                           rows themselves (x per token, h per slot; `_moe_gemm_kernel`'s FQ) instead of reading
    #                           `quantize_act_for_gemm`'s tile values: two launches fewer, the same output bit for bit;
    #                           NOT yet measured on a GPU (kernels/NOTES.md, "Fused activation quantize"). With on_quant
    #                           the unfused path runs (the fused kernels write no codes for the record)


# Relative time of one (expert, BM) block, each used expert taking one block: H200 medians, BM 32 / BM 16 = 1.05-1.09
# and BM 64 / BM 16 = 1.38-1.58 at Qwen3-30B-A3B T 16, T 64 and Mixtral-8x7B T 16 (1-4 rows per expert, where the
# routing gives every used expert one block of any BM; kernels/NOTES.md, "Grouped MoE").
_BLOCK_COST = {16: 1.0, 32: 1.07, 64: 1.47}


@functools.lru_cache(maxsize=256)
def moe_block_rows(T: int, topk: int, E: int) -> int:
    """BM for T tokens of top-k over E experts. A block decodes its expert's whole weight, so the time goes with the
    number of blocks (sum over experts of ceil(rows / BM)) times a block's cost at that BM (`_BLOCK_COST`). The
    rows of an expert are taken as Poisson with mean T*k/E (uniform routing, as the benchmark's; a skewed router
    gives more rows to a few experts and favours the larger BM earlier). At 16 rows per expert BM 16 decodes each
    used expert ~1.4 times, BM 32 once: 294 -> 230 us (Qwen3 T 256), 663 -> 487 us (Mixtral T 64; kernels/NOTES.md,
    "Grouped MoE")."""
    lam = T * topk / E
    if lam <= 0:
        return 16
    top = int(lam + 12 * math.sqrt(lam) + 30)
    pmf = [math.exp(n * math.log(lam) - lam - math.lgamma(n + 1)) for n in range(top)]

    def cost(bm: int) -> float:
        return _BLOCK_COST[bm] * sum(p * -(-n // bm) for n, p in enumerate(pmf))

    return min(_BLOCK_COST, key=cost)  # ties: the smaller BM (dict order)


def mma_moe_config(T: int, topk: int, E: int) -> MoEConfig:
    """The MMA tile for T tokens of top-k over E experts: BM by `moe_block_rows`; 3 stages, 64 weight rows, 4 warps,
    the bf16 decode of the weights in the dot order (no shared-memory trip of the decoded tile, ~22% fewer loop
    instructions per weight). K-tiles of 256 at BM 16, of 128 above: in the H200 sweep in the dot order (W4A16) 256 is
    faster at BM 16 (Qwen3 T16 / T64 117.8 -> 115.5 / 158.8 -> 153.2 us, Mixtral T16 378.6 -> 304.9) and slower at BM
    32-64 (Qwen3 T256 184.4 -> 213.0, Mixtral T256 758.8 -> 1033.4; Mixtral T64 at BM 32 3% faster); in the pair order
    256 is slower everywhere; the dot order cannot take 64 (its groups are 128). kernels/NOTES.md, "Grouped MoE"."""
    if INTERPRET:
        return MoEConfig(BM=16, BN=16, BKW=4, num_warps=1, num_stages=1, BN_down=16)
    bm = moe_block_rows(T, topk, E)
    return MoEConfig(BM=bm, BN=64, BKW=32 if bm == 16 else 16, num_warps=4, num_stages=3, BN_down=64,
                     bf16_decode=True, dot_order=True)


def default_moe_config(T: int, topk: int, E: int) -> MoEConfig:
    """The config `fused_moe` runs when it is given none: the decode GEMV below 1 (token, slot) row per expert
    (up to 4 in the interpreter, so that the tests reach the GEMV at their small sizes), else the MMA tile
    (`mma_moe_config`). H200, W4A4, same-run medians (kernels/NOTES.md, "Grouped MoE"; results/kernels/crossover.md):
    the GEMV 41.6 / 74.0 / 145.9 us against the MMA tile's 66.1 / 88.6 / 223.0 at 0.06-0.25 rows per expert (Qwen3 T1,
    T4; Mixtral T1); at 1 row per expert the MMA tile 174.7 / 347.6 against the GEMV's 184.8 / 395.5 (Qwen3 T16,
    Mixtral T4). No timed size lies between
    0.25 and 1. benchmarks/bench_kernels.py times the MMA tile where the GEMV is the default (rows fp4-w4a16-mma /
    fp4-w4a4-mma)."""
    per_expert = T * topk / E
    if INTERPRET:
        if per_expert <= 4:
            return MoEConfig(BM=min(4, max(1, T * topk)), BN=8, num_warps=1, num_stages=1, BN_down=8, kind="gemv")
        return mma_moe_config(T, topk, E)
    if per_expert < 1:  # decode: weight-streaming GEMV
        bm = 1 if per_expert <= 0.5 else 2
        bn = 16 if bm == 1 else 32  # BN=16 best at T=1 on the H200 (kernels/NOTES.md, "Grouped MoE")
        return MoEConfig(BM=bm, BN=bn, num_warps=4, num_stages=1, BN_down=bn, kind="gemv", U=1)
    return mma_moe_config(T, topk, E)


def moe_gemm(a, w: PreparedFP4Weight, sorted_slots, block_expert, S: int, *, a_div: int, gated: bool,
             route_w=None, a_factor=None, BM=16, BN=64, BKW=16, num_warps=4, num_stages=3, out_dtype=None,
             bf16_decode: bool = True, tma: bool = False, maxnreg: int | None = None, dot_order: bool = False,
             fuse_quant: bool = False):
    """One grouped launch of the MMA kernel. a: activations [R, K] (R = tokens or slots; row of slot s = s // a_div),
    or with a_factor [R] (W4A4) the activation's tile values from `quantize_act_for_gemm` and a_factor each row's
    2^7 / S_enc. fuse_quant (W4A4, without a_factor): a is the activation itself, quantized per row in the kernel
    (the same operands and output as a_factor's path). Returns [S, N] in out_dtype (default a.dtype).
    bf16_decode: the tile's decode in bf16 (GPU only; the interpreter decodes in fp32). tma: the weight tiles by TMA
    (`_moe_gemm_kernel`'s WDESC). maxnreg: the compiler's register cap per thread (None: its choice). dot_order: the
    weights in the dot order where `kernels.gemm.uses_dot_order` allows."""
    if fuse_quant and a_factor is not None:
        raise ValueError("fuse_quant quantizes the activation itself: a_factor is for tile values quantized before")
    N = w.N // 2 if gated else w.N
    KW = w.K // 8
    out = torch.empty((S, N), dtype=out_dtype or a.dtype, device=w.words.device)
    bf16d = bf16_decode and not INTERPRET
    grid = (block_expert.numel(), triton.cdiv(N, BN))
    dot = uses_dot_order(dot_order, w.K, BKW, tma)
    words, scales = w.dotted() if dot else (w.paired() if bf16d else w.words, w.scales)
    if tma:  # TMA rows are multiples of 16 bytes
        if w.K % 256 or BKW % 32:
            raise ValueError(f"tma needs K a multiple of 256 and BKW a multiple of 32, got K={w.K}, BKW={BKW}")
        words = TensorDescriptor.from_tensor(words.view(-1, KW), [BN, BKW])
        scales = TensorDescriptor.from_tensor(scales.view(-1, KW // 2), [BN, BKW // 2])
    _moe_gemm_kernel[grid](a, a if a_factor is None else a_factor, words, scales,
                           w.factor, out, sorted_slots, block_expert, route_w if route_w is not None else out, S, N, KW,
                           a.stride(0), a_div, AMAX_MIN, BM=BM, BN=BN, BKW=BKW, GATED=gated,
                           ROUTE_W=route_w is not None, INTERP=INTERPRET, NIT=triton.cdiv(KW, BKW), BF16D=bf16d,
                           XF=a_factor is not None, WDESC=tma, DOT=dot, FQ=fuse_quant, num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg)
    return out


def _tagged(on_quant, which: str):
    """on_quant(which, q) as a one-argument observer, or None; a mapping's entry for `which` as it is (an
    observer, a `kernels.quantize.RecordSink`, or None)."""
    if isinstance(on_quant, dict):
        return on_quant.get(which)
    return None if on_quant is None else (lambda q: on_quant(which, q))


def fused_moe(x: torch.Tensor, w: MoEWeights, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
              act_quant: bool = False, config: MoEConfig | None = None, align=None,
              check_finite: bool = True, on_quant=None) -> torch.Tensor:
    """Expert MLP of a MoE layer: out [T, H] = sum_j topk_weights[t, j] * MLP_{topk_ids[t, j]}(x[t]).
    x bf16/fp16/fp32 [T, H]; topk_ids int [T, k] in [0, E); topk_weights float [T, k].
    align: optional precomputed moe_align(topk_ids, E, config.BM) result (shared across layers).
    on_quant(which, QuantizedRows): with act_quant, sees each activation as the kernels use it:
    "gate_up" the per-token input [T, H], "down" the per-(token, slot) input [T*k, I] (row t*k + j). Or a dict
    {"gate_up": ..., "down": ...} of one-argument observers or `kernels.quantize.RecordSink`s (a sink's record
    written by the activation's quantize launch itself), either None."""
    check_tensor(x, "x", (torch.bfloat16, torch.float16, torch.float32), dim=2, finite=check_finite)
    check_tensor(topk_ids, "topk_ids", (torch.int32, torch.int64), dim=2)
    check_tensor(topk_weights, "topk_weights", (torch.float32, torch.bfloat16, torch.float16), dim=2,
                 finite=check_finite)
    if not isinstance(w, MoEWeights):
        raise TypeError("w must be MoEWeights from prepare_moe_weights")
    T, H = x.shape
    if H != w.H:
        raise ValueError(f"x has hidden size {H}, weights expect {w.H}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)} must be [T={T}, k]")
    if x.device != w.w13.words.device or topk_ids.device != x.device:
        raise ValueError("x, topk_ids and the weights must be on one device")
    if check_finite and topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= w.E):
        raise ValueError(f"topk_ids must lie in [0, {w.E})")
    k = topk_ids.shape[1]
    if T == 0:
        return torch.zeros_like(x)
    cfg = config or default_moe_config(T, k, w.E)
    if cfg.kind not in KINDS:
        raise ValueError(f"MoEConfig.kind must be one of {KINDS}, got {cfg.kind!r}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    sorted_slots, block_expert = align if align is not None else moe_align(topk_ids, w.E, cfg.BM)
    S = T * k
    rw = topk_weights.reshape(-1).to(torch.float32)
    if cfg.kind == "gemv":
        # W4A4 on the W4A16 GEMV kernels: gate/up input quantized per token, down input per (token, slot),
        # codes and scales the trainer's; the kernels read the dequantized values (one rounding to x.dtype)
        from kernels.quantize import fake_rows

        kw = dict(BM=cfg.BM, U=cfg.U, num_warps=cfg.num_warps)
        a = fake_rows(x, _tagged(on_quant, "gate_up")) if act_quant else x
        h = moe_gemv(a, w.w13, sorted_slots, block_expert, S, a_div=k, gated=True, BN=cfg.BN, **kw)
        if act_quant:
            h = fake_rows(h, _tagged(on_quant, "down"))
        y = moe_gemv(h, w.w2, sorted_slots, block_expert, S, a_div=1, gated=False, route_w=rw, BN=cfg.BN_down, **kw)
        return y.view(T, k, H).sum(1, dtype=torch.float32).to(x.dtype)
    kw = dict(BM=cfg.BM, BKW=cfg.BKW, num_warps=cfg.num_warps, num_stages=cfg.num_stages, bf16_decode=cfg.bf16_decode,
              out_dtype=x.dtype, tma=cfg.tma, dot_order=cfg.dot_order)
    if act_quant and cfg.fuse_quant and on_quant is None:  # each launch quantizes its activation rows in the kernel
        h = moe_gemm(x, w.w13, sorted_slots, block_expert, S, a_div=k, gated=True, fuse_quant=True, BN=cfg.BN,
                     maxnreg=cfg.maxnreg, **kw)
        y = moe_gemm(h, w.w2, sorted_slots, block_expert, S, a_div=1, gated=False, route_w=rw, fuse_quant=True,
                     BN=cfg.BN_down, maxnreg=cfg.maxnreg_down, **kw)
    elif act_quant:  # the MMA tile reads the activations' tile values, each row's 2^7 / S_enc applied after it
        xq, xf = quantize_act_for_gemm(x, check_finite=False, on_quant=_tagged(on_quant, "gate_up"))
        h = moe_gemm(xq, w.w13, sorted_slots, block_expert, S, a_div=k, gated=True, a_factor=xf, BN=cfg.BN,
                     maxnreg=cfg.maxnreg, **kw)
        hq, hf = quantize_act_for_gemm(h, check_finite=False, on_quant=_tagged(on_quant, "down"))
        y = moe_gemm(hq, w.w2, sorted_slots, block_expert, S, a_div=1, gated=False, route_w=rw, a_factor=hf,
                     BN=cfg.BN_down, maxnreg=cfg.maxnreg_down, **kw)
    else:
        h = moe_gemm(x, w.w13, sorted_slots, block_expert, S, a_div=k, gated=True, BN=cfg.BN, maxnreg=cfg.maxnreg, **kw)
        y = moe_gemm(h, w.w2, sorted_slots, block_expert, S, a_div=1, gated=False, route_w=rw, BN=cfg.BN_down,
                     maxnreg=cfg.maxnreg_down, **kw)
    return y.view(T, k, H).sum(1, dtype=torch.float32).to(x.dtype)
