"""NVFP4 dense and grouped-MoE GEMMs whose decoded weights are the wgmma A operand in registers (Gluon, Hopper
only; v4).

What: y [M, N] = x [M, K] @ dequant(W)^T (`fp4_linear_wgmma`) and the SiLU-gated expert MLP over
`kernels.moe.moe_align`'s expert-sorted blocks (`fused_moe_wgmma`, as `kernels.moe.fused_moe`), swap-AB (weights
are the MMA's M side: acc [64 weight rows, BM tokens]). The weight's nibbles are re-laid offline (`wgmma_layout`)
so that the 16 bytes a thread loads per K tile (8 from each of its two rows) are exactly the E2M1 codes of its
wgmma A fragment: the in-register decode (bf16x2 multiply by the block scale,
`_DECODE8_WG`) feeds `warpgroup_mma` with no shared-memory round trip (`gl.convert_layout(..., assert_trivial=True)`
fails the compile otherwise). The Triton-language MMA tile (`kernels.gemm._fp4_tile_dot_v3`) stores its decoded
tile to shared memory and reads it back with ldmatrix (kernels/NOTES.md, "Where the MoE tile's instructions go").
The activation tile goes through shared memory as the wgmma B operand. W4A4: with `act_quant`, x is first
quantized per row (`kernels.gemm.quantize_act_for_gemm`: the trainer's codes, the tile values q * s_b * 2^-7 that
are exact in bf16) and the row factor 2^7 / S_enc multiplies the output, as in the Triton tile.

How the loads are kept in flight (v4a measured latency-bound, kernels/NOTES.md): one kernel of each kind
(`_w4_wgmma_kernel`, `_moe_wgmma_kernel`), the same setup, decode, MMA and epilogue, with a K loop that prefetches
into registers (v4b: `_regs_loop`, two K tiles per iteration with the next two loading; `_moe_regs_loop`, one tile
with the next loading), reading the scales as int32 words (a row's 4 scale bytes of one K tile; each word of the A
fragment takes its half). Both split K (fp32 atomics) where the grid is small: the dense GEMM at decode sizes, the
MoE down projection (`moe_split`). A cp.async ring of 3-6 K tiles in shared memory instead (v4c, as
`triton_kernels` keeps its loads in flight) ran 1.5-2.9x slower than this loop at every depth, split and shape on the
H200 and was deleted (kernels/NOTES.md v4c).

Layout of a 64-wide K tile of row n (`wgmma_layout`): word c = 2 q + sh holds the 8 elements
k = 32 sh + 16 s0 + 8 h + 2 q + p (j = 4 s0 + 2 h + p), element j's code bit i at bit PAIR_BITS[j // 2][i] +
16 (j % 2) (the bf16 decode's pair layout, `kernels._common.PAIR_BITS`, as `kernels.gemm.pair_layout`). The
wgmma A fragment of a thread (lane 4 g + q, bf16, k_width 2) is rows g and g + 8 of its warp's 16, and
k = 2 q + {0, 1} + 8 h + 16 s (s = 0..3): 4 words per thread and K tile, two 8-byte loads.

Compared against: `kernels.reference.fp4_linear` and `moe_fp4_reference` (FP32 dequantize-then-matmul) in
tests/kernels/test_wgmma.py (GPU only: Gluon has no interpreter); the layouts against element-wise formulas and
the kernels' sm_90 compile on the CPU. Timing beside cuBLAS BF16 / `torch._grouped_mm`, our Triton kernels and
`triton_kernels` in benchmarks/bench_kernels.py (`--only dense,moe`). The engine takes them with TRACE_FP4_WGMMA=1.
Run: `python -m pytest tests/kernels/test_wgmma.py -q` (on an H200 for the oracle tests).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from kernels._common import SCALE_MAD, check_tensor, dot_layout, num_sms, pair_decode_ptx, wgmma_scales
from kernels.gemm import EPI_POW, quantize_act_for_gemm
from kernels.moe import _fields, moe_align, moe_block_rows

try:  # Gluon ships with Triton >= 3.5; its kernels compile for sm_90 only
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
except ImportError:  # pragma: no cover - older Triton
    gluon = None

BN = 64  # weight rows per program: one m64 wgmma
BK = 64  # K per tile: 4 k16 wgmmas, 4 words per thread


def wgmma_layout(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes uint8 [..., N, K] (K % 64 == 0) -> int32 words [..., N, K / 8] in the v4a layout (module
    docstring): `kernels._common.dot_layout` with groups of 64 (word 2 q + sh holds element 4 s0 + 2 h + p of
    k = 32 sh + 16 s0 + 8 h + 2 q + p)."""
    return dot_layout(codes, BK)


@dataclass
class WgmmaWeight:
    """A dense NVFP4 weight for `fp4_linear_wgmma`: words [N, K/8] (`wgmma_layout`), scales int16 [N, K/32]
    (`wgmma_scales`), factor [1] = 2^7 / S_enc."""

    words: torch.Tensor
    scales: torch.Tensor
    factor: torch.Tensor
    N: int
    K: int


def prepare_wgmma(codes: torch.Tensor, scales: torch.Tensor, outer: torch.Tensor) -> WgmmaWeight:
    """codes uint8 [N, K], scales uint8 [N, K/16], outer (S_enc) fp32 scalar: `trace.fp4.FP4Tensor` fields. N and
    K multiples of 64."""
    check_tensor(codes, "codes", (torch.uint8,), dim=2)
    check_tensor(scales, "scales", (torch.uint8,), dim=2)
    check_tensor(outer, "outer", (torch.float32,), finite=True)
    N, K = codes.shape
    if N % BN or K % BK:
        raise ValueError(f"N={N} and K={K} must be multiples of {BN} and {BK}")
    if tuple(scales.shape) != (N, K // 16):
        raise ValueError(f"scales must have shape {(N, K // 16)}, got {tuple(scales.shape)}")
    if outer.numel() != 1 or float(outer) <= 0:
        raise ValueError("outer must be one positive S_enc")
    factor = (EPI_POW / outer.reshape(1).to(torch.float64)).to(torch.float32)
    return WgmmaWeight(wgmma_layout(codes), wgmma_scales(scales), factor, N, K)


if gluon is not None:
    # One int32 word (v4a layout, `PAIR_BITS`) and the two v4a scale bytes of its blocks (s0 = 0, 1; `wgmma_scales`)
    # -> its 8 values * s_b * 2^-7 in bf16. Each byte becomes the bf16x2 (s_b * 2^119, s_b * 2^119) by one
    # multiply-add; the pairs decode as in the Triton tile (`kernels._common.pair_decode_ptx`: a shift and a mask
    # per pair 0-2, an E2M1 subnormal becoming a bf16 subnormal, which bf16 arithmetic keeps). Pairs 0-1 are block
    # s0 = 0, 2-3 s0 = 1.
    _DECODE8_WG = gl.constexpr("{\n.reg .b32 sa, sb, m, g;\ncvt.u32.u16 sa, $9;\nshr.u32 sb, sa, 8;\n"
                               f"and.b32 sa, sa, 255;\nmad.lo.u32 sa, sa, 0x100010, {SCALE_MAD};\n"
                               f"mad.lo.u32 sb, sb, 0x100010, {SCALE_MAD};\n"
                               + pair_decode_ptx(("sa", "sa", "sb", "sb")) + "}")

    # words [64, 8] of a K tile: word bit 0 (sh) and row bit 3 in registers, word bits 1-2 (q) and row bits 0-2 over
    # lanes, row bits 4-5 over warps: the wgmma A fragment's rows and k-quads (module docstring)
    _W_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [8, 0]], lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[BN, 8]))
    # the activation tile [BM, 64]: 16-byte loads along K
    _X_LAYOUT = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                              order=[1, 0]))

    _TILE_N = gl.constexpr(BN)
    _TILE_K = gl.constexpr(BK)

    @triton.constexpr_function
    def _b_smem_layout(BM):
        """The activation tile [BM, 64] in shared memory, the wgmma B operand (read K-major through a permuted view)."""
        return gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)

    @triton.constexpr_function
    def _mma_layout(BM):
        """acc [64 weight rows, BM tokens]: one m64nBMk16 wgmma per k16 over the 4 warps."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])

    @gluon.jit
    def _decode_a(w, sc, a_l: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
        """words [BN, 8] (v4a layout) and each word's two scale bytes (int16 [BN, 8], loaded with the words) -> the A
        operand [BN, BK] bf16 in the wgmma register layout, without data movement between threads."""
        n0, n1, n2, n3, n4, n5, n6, n7 = gl.inline_asm_elementwise(
            _DECODE8_WG, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [w, sc], dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)
        # element j = 4 s0 + 2 h + p: the first join's index is the last dim -> [BN, 8, 2 (p), 2 (h), 2 (s0)]
        v = gl.join(gl.join(gl.join(n0, n1), gl.join(n2, n3)), gl.join(gl.join(n4, n5), gl.join(n6, n7)))
        v = gl.reshape(v, [BN, 4, 2, 2, 2, 2])  # [n, q, sh, p, h, s0] (word c = 2 q + sh)
        v = gl.permute(v, (0, 2, 5, 4, 1, 3))  # [n, sh, s0, h, q, p]: k = 32 sh + 16 s0 + 8 h + 2 q + p
        return gl.convert_layout(gl.reshape(v, [BN, BK]), a_l, assert_trivial=True)

    @gluon.jit
    def _dense_epilogue(acc, xf_ptr, wf_ptr, out_ptr, M, N, pid_n, pid_m, mma: gl.constexpr, BM: gl.constexpr,
                        XF: gl.constexpr, SPLIT: gl.constexpr):
        """acc [64 weight rows, BM tokens] times 2^7 / S_enc (and the row factors with XF) into out [M, N]: stored, or
        added (fp32) when K is split."""
        on = pid_n * _TILE_N + gl.arange(0, _TILE_N, layout=gl.SliceLayout(1, mma))
        om = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
        acc = acc * gl.load(wf_ptr)
        if XF:
            acc = acc * gl.load(xf_ptr + om, mask=om < M, other=0.0)[None, :]
        o_ptrs = out_ptr + om[None, :].to(gl.int64) * N + on[:, None]  # out [M, N], the tile transposed
        omask = (om < M)[None, :] & (on < N)[:, None]
        if SPLIT > 1:
            gl.atomic_add(o_ptrs, acc, mask=omask, sem="relaxed")
        else:
            gl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask)

    @gluon.jit
    def _moe_epilogue(acc, acc_u, e, xf_ptr, wf_ptr, out_ptr, slots_ptr, rw_ptr, S, N, A_DIV, pid_b, pid_n,
                      mma: gl.constexpr, BM: gl.constexpr, GATED: gl.constexpr, ROUTE_W: gl.constexpr,
                      XF: gl.constexpr, SPLIT: gl.constexpr):
        """One block's acc (and acc_u, GATED) [64 rows, BM slots] into out [S, N]: the expert's 2^7 / S_enc, the
        activation rows' factors (XF), silu(gate) * up (GATED), the routing weight (ROUTE_W); stored, or added (fp32)
        when K is split."""
        on = pid_n * _TILE_N + gl.arange(0, _TILE_N, layout=gl.SliceLayout(1, mma))
        so = gl.load(slots_ptr + pid_b * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, mma)))
        smask = so < S
        if GATED:
            acc = acc * gl.load(wf_ptr + e * 2)
            acc_u = acc_u * gl.load(wf_ptr + e * 2 + 1)
        else:
            acc = acc * gl.load(wf_ptr + e)
        if XF:
            xf = gl.load(xf_ptr + gl.where(smask, so // A_DIV, 0), mask=smask, other=0.0)[None, :]
            acc = acc * xf
            if GATED:
                acc_u = acc_u * xf
        if GATED:
            acc = acc / (1.0 + gl.exp(-acc)) * acc_u  # silu(g) * u
        if ROUTE_W:
            acc = acc * gl.load(rw_ptr + so, mask=smask, other=0.0)[None, :]
        o_ptrs = out_ptr + so[None, :].to(gl.int64) * N + on[:, None]  # out [S, N]
        omask = smask[None, :] & (on < N)[:, None]
        if SPLIT > 1:
            gl.atomic_add(o_ptrs, acc, mask=omask, sem="relaxed")
        else:
            gl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask)

    @gluon.jit
    def _tile_scales(s32, s_shift):
        """A row's scale word of one K tile (int32 [BN, 8], the same for every word of the row) -> each word's two
        scale bytes (int16: the low half for words c with c & 1 = 0, the high half otherwise)."""
        return (s32 >> s_shift).to(gl.int16)

    @gluon.jit
    def _regs_loop(w_ptrs, s_ptrs, s_shift, x_ptrs, xmask, n_it, acc, a_l: gl.constexpr, BM: gl.constexpr):
        """Two K tiles per iteration from registers, the next two tiles' words, scale words and
        activations loaded before these are decoded (4 KB of weights in flight per program, no load waited on in
        the iteration that issued it: with one tile in flight and the scale bytes loaded where used the kernel was
        latency-bound, kernels/NOTES.md v4a). A tile past the range loads zeros (all-zero words decode to zeros)."""
        BN: gl.constexpr = _TILE_N
        BK: gl.constexpr = _TILE_K
        WT: gl.constexpr = BK // 8
        b0 = gl.allocate_shared_memory(gl.bfloat16, [BM, BK], _b_smem_layout(BM))
        b1 = gl.allocate_shared_memory(gl.bfloat16, [BM, BK], _b_smem_layout(BM))
        w0 = gl.load(w_ptrs)
        s0 = gl.load(s_ptrs)
        x0 = gl.load(x_ptrs, mask=xmask, other=0.0)
        m1 = n_it > 1
        w1 = gl.load(w_ptrs + WT, mask=m1, other=0)
        s1 = gl.load(s_ptrs + 1, mask=m1, other=0)
        x1 = gl.load(x_ptrs + BK, mask=xmask & m1, other=0.0)
        for it in range(0, n_it, 2):
            m2 = it + 2 < n_it
            m3 = it + 3 < n_it
            w2 = gl.load(w_ptrs + 2 * WT, mask=m2, other=0)
            s2 = gl.load(s_ptrs + 2, mask=m2, other=0)
            x2 = gl.load(x_ptrs + 2 * BK, mask=xmask & m2, other=0.0)
            w3 = gl.load(w_ptrs + 3 * WT, mask=m3, other=0)
            s3 = gl.load(s_ptrs + 3, mask=m3, other=0)
            x3 = gl.load(x_ptrs + 3 * BK, mask=xmask & m3, other=0.0)
            a0 = _decode_a(w0, _tile_scales(s0, s_shift), a_l, BN, BK)
            b0.store(x0.to(gl.bfloat16))
            a1 = _decode_a(w1, _tile_scales(s1, s_shift), a_l, BN, BK)
            b1.store(x1.to(gl.bfloat16))
            fence_async_shared()
            acc = warpgroup_mma(a0, b0.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma(a1, b1.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            w0, s0, x0, w1, s1, x1 = w2, s2, x2, w3, s3, x3
            w_ptrs += 2 * WT
            s_ptrs += 2
            x_ptrs += 2 * BK
        return acc

    @gluon.jit
    def _w4_wgmma_kernel(x_ptr, xf_ptr, w_ptr, s_ptr, wf_ptr, out_ptr, M, N, K, stride_xm, kt_per_split,
                         BM: gl.constexpr, SPLIT: gl.constexpr, XF: gl.constexpr, num_warps: gl.constexpr):
        """Grid (N / 64, M / BM, split-K): out[m, n] (+)= the program's K tiles of x @ dequant(W)^T, times 2^7 / S_enc
        and, with XF (x holds W4A4 tile values), the row's factor. s_ptr: int32 [N, K / 64], a row's 4 scale bytes
        of one K tile (the int16 view of `wgmma_scales` read two at a time)."""
        BN: gl.constexpr = _TILE_N
        BK: gl.constexpr = _TILE_K
        mma: gl.constexpr = _mma_layout(BM)
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        pid_k = gl.program_id(2)
        t0 = pid_k * kt_per_split
        n_it = gl.minimum(kt_per_split, K // BK - t0)
        rn = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, _W_LAYOUT))
        rc = gl.arange(0, 8, layout=gl.SliceLayout(0, _W_LAYOUT))
        w_ptrs = w_ptr + rn[:, None].to(gl.int64) * (K // 8) + (t0 * (BK // 8) + rc)[None, :]
        s_ptrs = s_ptr + rn[:, None].to(gl.int64) * (K // BK) + t0 + 0 * rc[None, :]  # every word of a row: its word
        s_shift = ((rc & 1) * 16)[None, :]
        rm = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, _X_LAYOUT))
        rk = gl.arange(0, BK, layout=gl.SliceLayout(0, _X_LAYOUT))
        x_ptrs = x_ptr + rm[:, None].to(gl.int64) * stride_xm + (t0 * BK + rk)[None, :]
        xmask = (rm < M)[:, None]
        acc = gl.zeros([BN, BM], gl.float32, layout=mma)
        acc = _regs_loop(w_ptrs, s_ptrs, s_shift, x_ptrs, xmask, n_it, acc, a_l, BM)
        _dense_epilogue(acc, xf_ptr, wf_ptr, out_ptr, M, N, pid_n, pid_m, mma, BM, XF, SPLIT)

    @gluon.jit
    def _moe_regs_loop(w_ptrs, s_ptrs, s_shift, x_ptrs, xmask, n_it, acc, up_w, up_s, acc_u, a_l: gl.constexpr,
                       BM: gl.constexpr, GATED: gl.constexpr):
        """The MoE kernel's K loop: one K tile per iteration (gate and up rows: two weight tiles), the
        next tile's words, scale words and activations loaded before this one is decoded."""
        BN: gl.constexpr = _TILE_N
        BK: gl.constexpr = _TILE_K
        WT: gl.constexpr = BK // 8
        b_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, BK], _b_smem_layout(BM))
        w = gl.load(w_ptrs)
        sc = gl.load(s_ptrs)
        w_u = gl.load(w_ptrs + up_w, mask=GATED, other=0)
        sc_u = gl.load(s_ptrs + up_s, mask=GATED, other=0)
        xv = gl.load(x_ptrs, mask=xmask, other=0.0)
        for it in range(n_it):
            more = it + 1 < n_it
            w_next = gl.load(w_ptrs + WT, mask=more, other=0)
            s_next = gl.load(s_ptrs + 1, mask=more, other=0)
            wu_next = gl.load(w_ptrs + up_w + WT, mask=more & GATED, other=0)
            su_next = gl.load(s_ptrs + up_s + 1, mask=more & GATED, other=0)
            x_next = gl.load(x_ptrs + BK, mask=xmask & more, other=0.0)
            a = _decode_a(w, _tile_scales(sc, s_shift), a_l, BN, BK)
            b_smem.store(xv.to(gl.bfloat16))
            fence_async_shared()
            acc = warpgroup_mma(a, b_smem.permute((1, 0)), acc, is_async=True)
            if GATED:
                a_u = _decode_a(w_u, _tile_scales(sc_u, s_shift), a_l, BN, BK)
                acc_u = warpgroup_mma(a_u, b_smem.permute((1, 0)), acc_u, is_async=True)
                acc, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_u))
            else:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            w, sc, w_u, sc_u, xv = w_next, s_next, wu_next, su_next, x_next
            w_ptrs += WT
            s_ptrs += 1
            x_ptrs += BK
        return acc, acc_u

    @gluon.jit
    def _moe_wgmma_kernel(x_ptr, xf_ptr, w_ptr, s_ptr, wf_ptr, out_ptr, slots_ptr, bexp_ptr, rw_ptr, S, N, K, stride_xm,
                          A_DIV, kt_per_split, BM: gl.constexpr, GATED: gl.constexpr, ROUTE_W: gl.constexpr,
                          XF: gl.constexpr, SPLIT: gl.constexpr, num_warps: gl.constexpr):
        """Grid (blocks of BM expert-sorted slots (`kernels.moe.moe_align`), N / 64, split-K): out[slot, n] for one
        block of one expert; with GATED, the gate rows [0, N) and up rows [N, 2N) of the expert read one activation
        tile and the SiLU product is written (SPLIT 1: the product needs the whole sum); ROUTE_W scales each slot by
        its routing weight (down); XF as the dense kernel; SPLIT > 1 adds the program's K tiles into an fp32 out.
        s_ptr: int32 [E, rows, K / 64]. Padding blocks (expert -1) exit at once."""
        BN: gl.constexpr = _TILE_N
        BK: gl.constexpr = _TILE_K
        mma: gl.constexpr = _mma_layout(BM)
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        pid_b = gl.program_id(0)
        pid_n = gl.program_id(1)
        pid_k = gl.program_id(2)
        e = gl.load(bexp_ptr + pid_b)
        if e >= 0:
            e64 = e.to(gl.int64)
            NW = 2 * N if GATED else N  # weight rows per expert
            t0 = pid_k * kt_per_split
            n_it = gl.minimum(kt_per_split, K // BK - t0)
            rn = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, _W_LAYOUT))
            rc = gl.arange(0, 8, layout=gl.SliceLayout(0, _W_LAYOUT))
            w_ptrs = w_ptr + (e64 * NW + rn[:, None]) * (K // 8) + (t0 * (BK // 8) + rc)[None, :]
            s_ptrs = s_ptr + (e64 * NW + rn[:, None]) * (K // BK) + t0 + 0 * rc[None, :]
            s_shift = ((rc & 1) * 16)[None, :]
            up_w = N * (K // 8)  # the up rows' offset from the gate rows'
            up_s = N * (K // BK)
            sl = gl.load(slots_ptr + pid_b * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, _X_LAYOUT)))
            rows = gl.where(sl < S, sl // A_DIV, 0)
            rk = gl.arange(0, BK, layout=gl.SliceLayout(0, _X_LAYOUT))
            x_ptrs = x_ptr + rows[:, None].to(gl.int64) * stride_xm + (t0 * BK + rk)[None, :]
            xmask = (sl < S)[:, None]
            acc = gl.zeros([BN, BM], gl.float32, layout=mma)
            acc_u = gl.zeros([BN, BM], gl.float32, layout=mma)
            acc, acc_u = _moe_regs_loop(w_ptrs, s_ptrs, s_shift, x_ptrs, xmask, n_it, acc, up_w, up_s, acc_u, a_l,
                                        BM, GATED)
            _moe_epilogue(acc, acc_u, e, xf_ptr, wf_ptr, out_ptr, slots_ptr, rw_ptr, S, N, A_DIV, pid_b, pid_n, mma,
                          BM, GATED, ROUTE_W, XF, SPLIT)


# the kernels' argument types as a launch passes them (scales as int32 words), for compiles without a GPU
# (tests/kernels/test_wgmma.py, benchmarks/bench_kernels.py --sass)
DENSE_SIG = {"x_ptr": "*bf16", "xf_ptr": "*fp32", "w_ptr": "*i32", "s_ptr": "*i32", "wf_ptr": "*fp32", "out_ptr": "*fp32",
             "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "kt_per_split": "i32", "BM": "constexpr",
             "SPLIT": "constexpr", "XF": "constexpr", "num_warps": "constexpr"}


def moe_sig(out: str) -> dict:
    """`_moe_wgmma_kernel`'s argument types; out: the output's type (*bf16, or *fp32 where K is split)."""
    return {"x_ptr": "*bf16", "xf_ptr": "*fp32", "w_ptr": "*i32", "s_ptr": "*i32", "wf_ptr": "*fp32", "out_ptr": out,
            "slots_ptr": "*i32", "bexp_ptr": "*i32", "rw_ptr": "*fp32", "S": "i32", "N": "i32", "K": "i32",
            "stride_xm": "i32", "A_DIV": "i32", "kt_per_split": "i32", "BM": "constexpr", "GATED": "constexpr",
            "ROUTE_W": "constexpr", "XF": "constexpr", "SPLIT": "constexpr", "num_warps": "constexpr"}


def usable(device) -> bool:
    """Gluon is importable and `device` is a Hopper GPU (the kernels' wgmma is sm_90's)."""
    device = torch.device(device)
    return gluon is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def wgmma_config(M: int, N: int, K: int, device) -> tuple[int, int]:
    """(BM, split-K): the token tile (16, 32 or 64: the wgmma's N) and enough K splits that the grid covers the SMs
    about four times at decode sizes (v4a's timing: split 4 beat 2 at 14336x4096, 10 beat 5 at 4096x14336, M 1-16;
    v4b's: within 6% of the best of half, this and twice as many splits at both shapes, M 1 and 16)."""
    bm = 16 if M <= 16 else 32 if M <= 32 else 64
    tiles = (N // BN) * triton.cdiv(M, bm)
    split = max(1, min(K // BK // 4, triton.cdiv(4 * num_sms(device), tiles)))
    return bm, split


def fp4_linear_wgmma(x: torch.Tensor, w: WgmmaWeight, *, act_quant: bool = False, out_dtype: torch.dtype | None = None,
                     config: tuple[int, int] | None = None, check_finite: bool = True,
                     on_quant=None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ dequant(W)^T on the v4 kernels (CUDA, sm_90). x bf16; act_quant: W4A4 (per-row NVFP4
    activations, the trainer's codes; on_quant sees them). config: (BM, split-K), default `wgmma_config`."""
    check_tensor(x, "x", (torch.bfloat16,), dim=2, finite=check_finite)
    if not usable(x.device):
        raise RuntimeError("fp4_linear_wgmma runs on Hopper GPUs with Triton's Gluon only (wgmma)")
    M, K = x.shape
    if K != w.K:
        raise ValueError(f"x has K={K}, weight has K={w.K}")
    out_dtype = out_dtype or x.dtype
    if M == 0:
        return torch.empty((0, w.N), dtype=out_dtype, device=x.device)
    if act_quant:
        xa, xf = quantize_act_for_gemm(x, check_finite=False, on_quant=on_quant)
    else:
        xa = x if x.stride(-1) == 1 else x.contiguous()
        xf = w.factor  # unread (XF=False)
    bm, split = config or wgmma_config(M, w.N, K, x.device)
    kt = K // BK
    per = triton.cdiv(kt, split)
    split = triton.cdiv(kt, per)
    out = (torch.zeros((M, w.N), dtype=torch.float32, device=x.device) if split > 1
           else torch.empty((M, w.N), dtype=out_dtype, device=x.device))
    _w4_wgmma_kernel[(w.N // BN, triton.cdiv(M, bm), split)](
        xa, xf, w.words, w.scales.view(torch.int32), w.factor, out, M, w.N, K, xa.stride(0), per, BM=bm, SPLIT=split,
        XF=act_quant, num_warps=4)
    return out if out.dtype == out_dtype else out.to(out_dtype)


@dataclass
class WgmmaMoE:
    """Expert weights for `fused_moe_wgmma`: w13 words [E, 2I, H/8] (gate rows [0, I), up rows [I, 2I)), scales
    [E, 2I, H/32] int16, factor [E, 2] (gate, up); w2 words [E, H, I/8], scales [E, H, I/32], factor [E]."""

    w13: torch.Tensor
    s13: torch.Tensor
    f13: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor
    f2: torch.Tensor
    E: int
    H: int
    I: int


def prepare_moe_wgmma(gate, up, down) -> WgmmaMoE:
    """gate, up: (codes [E, I, H], scale bytes [E, I, H/16], S_enc [E, 1, 1] or scalar); down: (codes [E, H, I], ...),
    as tuples or `trace.fp4.FP4Tensor`s, as `kernels.moe.prepare_moe_weights` takes them. H and I multiples of 64."""
    (gc, gs, go), (uc, us, uo), (dc, ds, do) = (_fields(t) for t in (gate, up, down))
    E, I, H = gc.shape
    if H % BK or I % BK:
        raise ValueError(f"H={H} and I={I} must be multiples of {BK}")
    if tuple(uc.shape) != (E, I, H) or tuple(dc.shape) != (E, H, I):
        raise ValueError(f"up must be {(E, I, H)} and down {(E, H, I)}, got {tuple(uc.shape)}, {tuple(dc.shape)}")

    def factor(o):
        o = o.reshape(-1).to(torch.float64)
        return (EPI_POW / o.expand(E) if o.numel() == 1 else EPI_POW / o).to(torch.float32)

    return WgmmaMoE(wgmma_layout(torch.cat([gc, uc], 1)), wgmma_scales(torch.cat([gs, us], 1)),
                    torch.stack([factor(go), factor(uo)], 1).contiguous(), wgmma_layout(dc), wgmma_scales(ds),
                    factor(do).contiguous(), E, H, I)


def moe_split(blocks: int, N: int, K: int, device) -> int:
    """K splits of an ungated (down) launch over `blocks` used blocks: enough that the grid covers the SMs about
    four times (as `wgmma_config`), at least 4 K tiles per split. At decode sizes the down projection has few
    programs (Mixtral-8x7B at T = 1: 2 blocks x 64 row tiles), each walking K = 14,336 in 224 dependent tiles
    without it."""
    return max(1, min(K // BK // 4, triton.cdiv(4 * num_sms(device), blocks * (N // BN))))


def moe_wgmma(a, words, scales, factor, N: int, K: int, sorted_slots, block_expert, S: int, BM: int, *, a_div: int,
              gated: bool, route_w=None, a_factor=None, out_dtype=None, split: int | None = None) -> torch.Tensor:
    """One grouped launch of the v4 MoE kernels over `kernels.moe.moe_align`'s blocks (BM slots each): [S, N].
    split: K splits (ungated only; default `moe_split`)."""
    out_dtype = out_dtype or a.dtype
    blocks = block_expert.numel()
    # at most S blocks hold a slot (moe_align pads to the worst case; its padding blocks exit at once)
    split = 1 if gated else (split or moe_split(min(blocks, S), N, K, a.device))
    kt = K // BK
    per = triton.cdiv(kt, split)
    split = triton.cdiv(kt, per)
    out = (torch.zeros((S, N), dtype=torch.float32, device=a.device) if split > 1
           else torch.empty((S, N), dtype=out_dtype, device=a.device))
    _moe_wgmma_kernel[(blocks, N // BN, split)](
        a, a if a_factor is None else a_factor, words, scales.view(torch.int32), factor, out, sorted_slots,
        block_expert, route_w if route_w is not None else factor, S, N, K, a.stride(0), a_div, per, BM=BM, GATED=gated,
        ROUTE_W=route_w is not None, XF=a_factor is not None, SPLIT=split, num_warps=4)
    return out if out.dtype == out_dtype else out.to(out_dtype)


def fused_moe_wgmma(x: torch.Tensor, w: WgmmaMoE, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                    act_quant: bool = False, BM: int | None = None, on_quant=None) -> torch.Tensor:
    """`kernels.moe.fused_moe` on the v4 kernels (CUDA sm_90, x bf16): gate/up with the SiLU product, then down
    with the routing weights, then the sum over each token's k slots. act_quant: W4A4 as `fused_moe`'s MMA path
    (the gate/up input per token, the down input per (token, slot); on_quant(which, q) sees them)."""
    check_tensor(x, "x", (torch.bfloat16,), dim=2)
    if not usable(x.device):
        raise RuntimeError("fused_moe_wgmma runs on Hopper GPUs with Triton's Gluon only (wgmma)")
    T, H = x.shape
    k = topk_ids.shape[1]
    if H != w.H or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != T:
        raise ValueError(f"x [T, {w.H}], topk_ids and topk_weights [T, k] expected")
    if T == 0:
        return torch.zeros_like(x)
    bm = BM or moe_block_rows(T, k, w.E)
    sorted_slots, block_expert = moe_align(topk_ids, w.E, bm)
    S = T * k
    rw = topk_weights.reshape(-1).to(torch.float32)
    x = x if x.stride(-1) == 1 else x.contiguous()
    tag = (lambda which: None) if on_quant is None else (lambda which: (lambda q: on_quant(which, q)))
    if act_quant:
        xq, xf = quantize_act_for_gemm(x, check_finite=False, on_quant=tag("gate_up"))
        h = moe_wgmma(xq, w.w13, w.s13, w.f13, w.I, H, sorted_slots, block_expert, S, bm, a_div=k, gated=True,
                      a_factor=xf, out_dtype=x.dtype)
        hq, hf = quantize_act_for_gemm(h, check_finite=False, on_quant=tag("down"))
        y = moe_wgmma(hq, w.w2, w.s2, w.f2, H, w.I, sorted_slots, block_expert, S, bm, a_div=1, gated=False,
                      route_w=rw, a_factor=hf, out_dtype=x.dtype)
    else:
        h = moe_wgmma(x, w.w13, w.s13, w.f13, w.I, H, sorted_slots, block_expert, S, bm, a_div=k, gated=True)
        y = moe_wgmma(h, w.w2, w.s2, w.f2, H, w.I, sorted_slots, block_expert, S, bm, a_div=1, gated=False, route_w=rw)
    return y.view(T, k, H).sum(1, dtype=torch.float32).to(x.dtype)
