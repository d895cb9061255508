"""Triton FP4 weight GEMM (dense), decode and prefill: y = x @ W^T with W in NVFP4.

What: `prepare_weight` turns an NVFP4 weight (codes [N, K] or [E, N, K], 1x16 E4M3 block scales,
per-tensor / per-expert S_enc) into the kernel layout: int32 words [.., N, K/8] holding 8 consecutive
K-elements (nibble j = element 8i+j, i.e. `pack_fp4` bytes read as little-endian int32), scale
bytes [.., N, K/16] and an FP32 epilogue factor 2^7 / S_enc. `fp4_linear` multiplies BF16 (or FP32)
activations [M, K] by it; with `act_quant=True` the activation is first quantized per row to NVFP4 by
`kernels.quantize.quantize_rows` (W4A4 emulated exactly: both operands are E2M1 * E4M3 products, exact in
BF16, BF16 MMA with FP32 accumulation, outer scales applied after accumulation). For the MMA tile that pass
also writes each activation's tile value q * s_b * 2^-7 (exact in BF16), which the tile reads as it reads a
W4A16 activation, the row's 2^7 / S_enc applied after the MMA: the same operands as decoding the codes in
the tile, and on the H200 faster at every size where the tile runs (`quantize_act_for_gemm`). On the decode
GEMV path (M <= 2) the pass writes the dequantized activations instead (same codes and scales, one rounding
to the activation dtype) and the W4A16 kernel reads them.

MMA kernel ("swap AB", kernels/NOTES.md, "Dense FP4 GEMM and GEMV"): each program computes acc[BN, BM] =
W_tile[BN, K] @ x^T[K, BM], so the tiny decode batch is the MMA's N dimension. A K-tile of BK = 8 * BKW
elements is BKW words per weight row; each thread decodes whole words into their 8 values in element
order (`kernels._common.dequant_tile_words`, the bit trick E2M1 * 2^-126 times s_b * 2^119), so one MMA
covers the tile. On a GPU the decode runs in bf16 by inline PTX (`bf16_decode`, on by default) over the weight
in the dot order (`dot_order`, on by default: `dot_decode`, each word's 8 values one thread's registers of the
MMA's left operand, so the decoded tile never passes through shared memory; `PreparedFP4Weight.dotted`, built once
per weight), or in `pair_layout` where K is not a multiple of 128. Decode uses split-K (FP32 atomics) so that the
whole GPU streams the weights. The decode GEMV kernels (no tensor cores, their own `gemv_layout`) are the default
up to 2 rows only in the interpreter; on the H200 the dot-order tile beat them there (`auto_config`).

Compared against: `kernels.reference.fp4_linear` (FP32 dequantize-then-matmul); tests in
tests/kernels/test_gemm.py (interpreter), timing vs cuBLAS BF16 `F.linear` in benchmarks/bench_kernels.py.
Run: `python -m pytest tests/kernels/test_gemm.py -q`.

The decode GEMV's layout and kernel are in kernels/gemv.py (`fp4_linear` runs its `fp4_gemv2` for the "gemv2"
kind); `prepare_weight` builds both layouts of one weight, so a change to the weight's layout is made in both
modules at once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels import reference as ref
from kernels._common import (
    EPI_POW,
    INTERPRET,
    SCALE_MAD,
    check_tensor,
    dequant_tile_loaded,
    dequant_tile_words,
    dot_layout,
    dot_scales,
    e4m3_value,
    nib_to_f32_scaled,
    num_sms,
    pack_pair_bits,
    pair_decode_ptx,
)
from kernels.gemv import GV_GK, fp4_gemv2, gemv_layout
from kernels.quantize import nvfp4_row_senc, nvfp4_tile_values


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
    gv_words: torch.Tensor | None = None  # the decode GEMV's layout (kernels/gemv.py, `gemv_layout`)
    gv_scales: torch.Tensor | None = None
    pair_words: torch.Tensor | None = None  # `pair_layout(words)`, made by the first MMA call that decodes in bf16
    dot_words: tuple[torch.Tensor, torch.Tensor] | None = None  # `dotted()`, made by the first call in the dot order

    def nbytes(self) -> int:
        return self.words.numel() * 4 + self.scales.numel() + self.factor.numel() * 4

    def match_layouts(self, other: "PreparedFP4Weight") -> None:
        """Build the lazily made layouts (`paired`, `dotted`) that `other` has built, so that the two weights have
        the same tensors (an in-place weight refresh copies one into the other)."""
        if other.pair_words is not None:
            self.paired()
        if other.dot_words is not None:
            self.dotted()

    def paired(self) -> torch.Tensor:
        """words in `pair_layout` (built once, kept: the same bytes again)."""
        if self.pair_words is None:
            self.pair_words = pair_layout(self.words)
        return self.pair_words

    def dotted(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(words int32 [(E,) N, K/8] in the dot order, scales int32 [(E,) N, K/64]: dot-order scale bytes (kernels._common.SCALE_EXP0), blocks
        4i..4i+3 of a row in one int32) for the tile with `dot_order` (built once, kept). K % 128 == 0."""
        if self.dot_words is None:
            u = self.words.to(torch.int64) & 0xFFFFFFFF
            codes = torch.stack([(u >> (4 * j)) & 0xF for j in range(8)], -1).flatten(-2)  # [(E,) N, K]
            self.dot_words = (dot_layout(codes, DOT_GROUP), dot_scales(self.scales).view(torch.int32))
        return self.dot_words


def pair_layout(words: torch.Tensor) -> torch.Tensor:
    """int32 words of 8 nibbles (element j at bits 4j) -> the bf16 decode's layout (`DECODE8_PAIRED_ASM`):
    element 2p + h's code bit i at bit PAIR_BITS[p][i] + 16 h (`kernels._common.PAIR_BITS`). Pairs 0, 1, 2 then
    decode with a shift by 0, 3, 6 and one mask (magnitudes under both halves' exponent fields, signs on both sign
    bits), pair 3 with three shifts and masks. int32 -> same shape."""
    u = words.to(torch.int64) & 0xFFFFFFFF
    return pack_pair_bits(torch.stack([(u >> (4 * j)) & 0xF for j in range(8)], -1))


def prepare_weight(codes: torch.Tensor, scales: torch.Tensor, outer: torch.Tensor, gemv: bool = True) -> PreparedFP4Weight:
    """Offline re-layout of an NVFP4 weight (unpacked codes uint8 [(E,) N, K], E4M3 scale bytes
    [(E,) N, K/16], S_enc fp32 scalar or [E, 1, 1]). Accepts `trace.fp4.FP4Tensor` fields directly:
    `prepare_weight(t.codes, t.scales, t.outer)`. 16x16 blocks / MXFP4 weights are not supported.
    gemv: also build the decode GEMV's layout (`gemv_layout`, same bytes again) used for decode (M <= 16)."""
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
    gw, gs = gemv_layout(codes, scales) if gemv else (None, None)
    return PreparedFP4Weight(words, scales.contiguous(), factor, N, K, E, gw, gs)


@triton.jit
def act_tile(x_ptr, rows, mmask, stride_xm, k0, K, BK: tl.constexpr):
    """The activation's K-tile [BK, BM] of rows `rows` (bf16/fp32, row stride stride_xm) for `fp4_tile_dot`:
    x itself (W4A16) or the tile values its quantize pass wrote (W4A4, `quantize_act_for_gemm`). Loaded once per
    K-tile and shared by the dots that read it (the MoE kernel's gate and up weights)."""
    offs_k = k0 + tl.arange(0, BK)
    return tl.load(x_ptr + rows[None, :].to(tl.int64) * stride_xm + offs_k[:, None],
                   mask=(offs_k < K)[:, None] & mmask[None, :], other=0.0)


@triton.jit
def fused_act_senc(x_ptr, rows, mmask, stride_xm, K, amax_min, BM: tl.constexpr, BK: tl.constexpr,
                   NITA: tl.constexpr):
    """`fuse_quant`'s prologue: one pass over the whole of each of the BM activation rows (NITA K-tiles of BK, K
    itself, not a split-K share) -> each row's NVFP4 outer scale S_enc [BM] (`kernels.quantize.nvfp4_row_senc`, as
    `quantize_rows` computes it; 1 for masked rows)."""
    amax = tl.zeros([BM], tl.float32)
    for it in range(NITA):
        xv = act_tile(x_ptr, rows, mmask, stride_xm, it * BK, K, BK).to(tl.float32)  # [BK, BM]
        amax = tl.maximum(amax, tl.max(tl.abs(xv), axis=0))
    return nvfp4_row_senc(amax, amax_min)


@triton.jit
def act_tile_quant(x_ptr, rows, mmask, stride_xm, k0, K, s_enc, BM: tl.constexpr, BK: tl.constexpr,
                   INTERP: tl.constexpr):
    """`act_tile` for `fuse_quant`: the activation's K-tile read from x itself and NVFP4-quantized in registers
    (`kernels.quantize.nvfp4_tile_values`, per 16-element block: E4M3 scale, E2M1 RTN code) -> [BK, BM] fp32 tile
    values q * s_b * 2^-7, the values `quantize_act_for_gemm` writes for the unfused tile to read. K % 16 == 0, so
    the blocks past K are whole and read 0 (scale 0, values 0). The tile is loaded as `act_tile` loads it and
    comes back in that shape (its blocks permuted to the rows for the quantize and back), the load's mask applied
    once more (a no-op on the values): in the interpreter that select makes a fresh array in row-major order, so the
    dot's operand has the unfused tile's memory order as well as its values, and numpy's matmul, whose summation
    order follows its operands' strides, adds the same products in the same order (a permuted view did not)."""
    offs_k = k0 + tl.arange(0, BK)
    xv = act_tile(x_ptr, rows, mmask, stride_xm, k0, K, BK).to(tl.float32)  # [BK, BM]
    xb = tl.permute(tl.reshape(xv, [BK // 16, 16, BM]), (2, 0, 1))  # [BM, BK/16, 16]
    g = tl.reshape(tl.permute(nvfp4_tile_values(xb, s_enc, INTERP), (1, 2, 0)), [BK, BM])
    return tl.where((offs_k < K)[:, None] & mmask[None, :], g, 0.0)


# ------------------------------------------------------------------------------------------------
# The dot order: each word's 8 values are one thread's registers of the MMA's left operand
# ------------------------------------------------------------------------------------------------
DOT_GROUP = 128  # K elements per group of the dot order (`kernels._common.dot_layout`); the tile's BK a multiple

# word $8 (dot order), $9 four dot-order scale bytes (blocks 4i..4i+3 of the row), $10 a selector ptxas sees as a constant
# per register (0x4140: bytes 0 and 1, the word's blocks when t is even; 0x4342: bytes 2 and 3) -> $0..$7 = element
# e = 4 s0 + 2 h + c times its block's s_b * 2^-7 in bf16: one PRMT and one multiply-add make both blocks' bf16x2
# scales (`kernels._common.SCALE_MAD`), the pairs decode as in `pair_decode_ptx` (pairs 0, 1: block s0 = 0)
_DOT_ASM = tl.constexpr("{\n.reg .b32 x, sp, sa, sb, m, g;\n.reg .b16 lo, hi;\nprmt.b32 x, $9, 0, $10;\n"
                        f"mad.lo.u32 sp, x, 16, {SCALE_MAD};\n"
                        "mov.b32 {lo, hi}, sp;\nmov.b32 sa, {lo, lo};\nmov.b32 sb, {hi, hi};\n"
                        + pair_decode_ptx(("sa", "sa", "sb", "sb")) + "}")


@triton.jit
def _code_at(w, b0: tl.constexpr, b1: tl.constexpr, b2: tl.constexpr, b3: tl.constexpr):
    """The E2M1 code whose bits 0-3 sit at word bits b0..b3 -> its value * 2^-126 (fp32)."""
    n = ((w >> b0) & 1) | (((w >> b1) & 1) << 1) | (((w >> b2) & 1) << 2) | (((w >> b3) & 1) << 3)
    return nib_to_f32_scaled(n)


@triton.jit
def dot_decode(w, s, BN: tl.constexpr, BK: tl.constexpr, ASM: tl.constexpr):
    """w int32 [BN, BK/8] words in the dot order, s int32 [BN, BK/64] dot-order scale bytes (`PreparedFP4Weight.dotted`)
    -> [BN, BK] = E2M1 * s_b * 2^-7 in natural k order: bf16 by `_DOT_ASM` with ASM (GPU), else fp32 in plain
    Triton (the interpreter; the same values). The join / reshape / permute chain only renames registers on a GPU:
    a word's 8 values differ in register bits of the dot operand layout (`dot_layout`)."""
    U: tl.constexpr = BK // 128
    # per word (u, q, t = 2 t1 + t0): its row's scale int32 t1 of group u and t0, which half of it holds its blocks
    sw = tl.reshape(tl.broadcast_to(tl.reshape(s, [BN, U, 1, 2, 1]), [BN, U, 4, 2, 2]), [BN, BK // 8])
    t0 = tl.reshape(tl.broadcast_to(tl.reshape(tl.arange(0, 2), [1, 1, 1, 1, 2]), [BN, U, 4, 2, 2]), [BN, BK // 8])
    if ASM:
        o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
            _DOT_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [w, sw, 0x4140 + 0x202 * t0], dtype=(tl.bfloat16,) * 8,
            is_pure=True, pack=1)
    else:  # s_b * 2^119 as fp32: bf16 bits (byte << 4) + 0x7680 (`kernels._common.dot_scales`)
        sh = 16 * t0
        sa = (((((sw >> sh) & 0xFF) << 4) + 0x7680) << 16).to(tl.float32, bitcast=True)
        sb = (((((sw >> (sh + 8)) & 0xFF) << 4) + 0x7680) << 16).to(tl.float32, bitcast=True)
        # element e's code bits at PAIR_BITS[e // 2] + 16 (e % 2) (`kernels._common.PAIR_BITS`)
        o0, o1 = _code_at(w, 6, 7, 8, 15) * sa, _code_at(w, 22, 23, 24, 31) * sa
        o2, o3 = _code_at(w, 3, 4, 5, 12) * sa, _code_at(w, 19, 20, 21, 28) * sa
        o4, o5 = _code_at(w, 0, 1, 2, 9) * sb, _code_at(w, 16, 17, 18, 25) * sb
        o6, o7 = _code_at(w, 13, 10, 11, 14) * sb, _code_at(w, 29, 26, 27, 30) * sb
    v = tl.join(tl.join(tl.join(o0, o1), tl.join(o2, o3)), tl.join(tl.join(o4, o5), tl.join(o6, o7)))  # [.., c, h, s0]
    v = tl.reshape(v, [BN, U, 4, 4, 2, 2, 2])  # n, u, q, t, c, h, s0
    v = tl.permute(v, (0, 1, 3, 6, 5, 2, 4))  # n, u, t, s0, h, q, c: k = 128 u + 32 t + 16 s0 + 8 h + 2 q + c
    return tl.reshape(v, [BN, BK])


@triton.jit
def fp4_tile_dot(acc, wb, ws, offs_n, nmask, xv, k0, K, BN: tl.constexpr, BK: tl.constexpr,
                 INTERP: tl.constexpr, BF16D: tl.constexpr = False, WDESC: tl.constexpr = False, n0=0,
                 DOT: tl.constexpr = False, KMASK: tl.constexpr = True):
    """acc[BN, BM] += dequant(W[offs_n, k0 : k0+BK]) @ xv, one MMA per K-tile; xv [BK, BM] the
    activation tile (`act_tile`). wb / ws: the weight's words [N, K/8] and scale bytes [N, K/16] (rows
    offs_n). The tile is decoded in element order (`dequant_tile_words`), so one dot of K = BK covers it: no
    dot per nibble position, each with its own operand conversion through shared memory (kernels/NOTES.md,
    "Dense FP4 GEMM and GEMV"). BF16D: decode and scale in bf16 (GPU only; the weight words in `pair_layout`).
    WDESC: wb and ws are tensor descriptors over the words [N, K/8] and the scale bytes [N, K/16] with blocks
    [BN, BK/8] and [BN, BK/16], n0 the tile's first row: the tile comes by TMA (rows and columns past the ends read
    0), not by per-thread cp.async through L1 (kernels/NOTES.md, "Where the time goes").
    DOT: wb holds the words in the dot order and ws the scales as int32 [N, K/64] (`PreparedFP4Weight.dotted`;
    `dot_decode`, BK a multiple of 128); KMASK False: the tile lies inside K (no mask along K)."""
    offs_w = k0 // 8 + tl.arange(0, BK // 8)
    wkmask = offs_w < K // 8
    offs_s = k0 // 16 + tl.arange(0, BK // 16)
    smask = offs_s < K // 16
    n64 = offs_n[:, None].to(tl.int64)
    if DOT:
        offs_s = k0 // 64 + tl.arange(0, BK // 64)
        if KMASK:
            wmask, smask = nmask[:, None] & wkmask[None, :], nmask[:, None] & (offs_s < K // 64)[None, :]
        else:
            wmask, smask = nmask[:, None], nmask[:, None]
        wv = dot_decode(tl.load(wb + n64 * (K // 8) + offs_w[None, :], mask=wmask, other=0),
                        tl.load(ws + n64 * (K // 64) + offs_s[None, :], mask=smask, other=0), BN, BK, BF16D)
    elif WDESC:
        wv = dequant_tile_loaded(wb.load([n0, k0 // 8]), ws.load([n0, k0 // 16]), BN, BK, BF16D, BF16D)  # [BN, BK]
    else:
        wv = dequant_tile_words(wb + n64 * (K // 8) + offs_w[None, :], ws + n64 * (K // 16) + offs_s[None, :],
                                nmask[:, None] & wkmask[None, :], nmask[:, None] & smask[None, :], BN, BK, BF16D,
                                BF16D)  # [BN, BK]; with the bf16 decode the weight words are in pair_layout
    if INTERP:
        acc += tl.dot(wv, xv.to(tl.float32), input_precision="ieee")
    else:
        acc += tl.dot(wv.to(tl.bfloat16), xv.to(tl.bfloat16))
    return acc


@triton.jit
def _fp4_gemm_kernel(x_ptr, xf_ptr, w_ptr, ws_ptr, wf_ptr, out_ptr,
                     M, N, KW, stride_xm, kw_per_split, amax_min,
                     BM: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr,
                     SPLIT: tl.constexpr, INTERP: tl.constexpr, NIT: tl.constexpr, BF16D: tl.constexpr,
                     XF: tl.constexpr, WDESC: tl.constexpr = False, DOT: tl.constexpr = False,
                     KMASK: tl.constexpr = True, FQ: tl.constexpr = False, NITA: tl.constexpr = 1):
    """Grid (N / BN, M / BM, split-K): out[offs_m, offs_n] (+)= the tile's share of K (`fp4_tile_dot`),
    times the weight's 2^7 / S_enc and, with XF (W4A4: x holds the activation's tile values), the activation
    row's (xf_ptr). WDESC: w_ptr and ws_ptr are tensor descriptors over the words and scales (`GemmConfig.tma`).
    DOT / KMASK: the weight in the dot order, the tiles masked along K (`fp4_tile_dot`).
    FQ (W4A4, `GemmConfig.fuse_quant`): x is the activation itself; a first loop over the whole row (NITA K-tiles)
    gives each row's S_enc, each K-tile is quantized in registers to the tile values XF would read
    (`act_tile_quant`), and the epilogue multiplies by the row's 2^7 / S_enc, so the operands and the output are
    XF's, without the quantize launch and its tile values' round trip through memory."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)  # [BN]
    offs_m = pid_m * BM + tl.arange(0, BM)  # [BM]
    nmask = offs_n < N
    mmask = offs_m < M
    kw_lo = pid_k * kw_per_split
    acc = tl.zeros([BN, BM], tl.float32)
    if FQ:
        s_enc = fused_act_senc(x_ptr, offs_m, mmask, stride_xm, KW * 8, amax_min, BM, 8 * BKW, NITA)
    for it in range(NIT):  # constexpr trip count (the interpreter cannot loop to a runtime bound)
        k0 = (kw_lo + it * BKW) * 8
        if FQ:
            xv = act_tile_quant(x_ptr, offs_m, mmask, stride_xm, k0, KW * 8, s_enc, BM, 8 * BKW, INTERP)
        else:
            xv = act_tile(x_ptr, offs_m, mmask, stride_xm, k0, KW * 8, 8 * BKW)
        acc = fp4_tile_dot(acc, w_ptr, ws_ptr, offs_n, nmask, xv, k0, KW * 8, BN, 8 * BKW, INTERP, BF16D,
                           WDESC, pid_n * BN, DOT, KMASK)
    acc = acc * tl.load(wf_ptr)
    if XF:
        acc = acc * tl.load(xf_ptr + offs_m, mask=mmask, other=0.0)[None, :]
    elif FQ:  # 2^7 / S_enc, correctly rounded as quantize_act_for_gemm's division
        acc = acc * tl.math.div_rn(tl.full([BM], 128.0, tl.float32), s_enc)[None, :]
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


KINDS = ("mma", "gemv", "gemv2")


@dataclass(frozen=True)
class GemmConfig:
    kind: str = "mma"  # "mma" (tensor cores, any M: one MMA per K-tile decoded in element order; W4A4 on the
    #                    activation's tile values, `quantize_act_for_gemm`), "gemv" (FMA over `words`, one
    #                    row per program, W4A16 only) or "gemv2" (FMA over `gemv_layout`, BM <= 4 rows per program,
    #                    kernels/gemv.py; W4A4 through `fp4_linear(act_quant=True)` on dequantized activations)
    BN: int = 64
    BM: int = 16
    BKW: int = 16  # words per K-tile (BK = 8 * BKW elements); unused by gemv2
    split: int = 1
    num_warps: int = 4
    num_stages: int = 3
    U: int = 1  # gemv2: K-groups (256 elements) per loop iteration
    prefetch: bool = False  # gemv2: register double buffer (U must be 1); NOT yet measured on a GPU
    tma: bool = False  # mma: the weight words and scales by TMA (tensor descriptors, blocks [BN, BKW] and [BN, BKW/2];
    #                    BKW >= 32 for TMA's 16-byte rows of scales) instead of per-thread loads; level with or
    #                    slower than the pointer tile on the H200 (kernels/NOTES.md, "Dense FP4 GEMM and GEMV")
    bf16_decode: bool = True  # mma on a GPU: decode and scale the tile in bf16 (inline PTX, `dequant_tile_words`),
    #                           faster than the fp32 decode in every config timed on the H200; the interpreter, whose
    #                           bf16 arithmetic is not IEEE, always decodes in fp32
    maxnreg: int | None = None  # mma: registers per thread the compiler may use (PTX .maxnreg): fewer registers,
    #                             more resident warps, but not a higher issue rate: 2-12% slower on the H200
    #                             (kernels/NOTES.md, "Dense FP4 GEMM and GEMV"); None: the compiler's choice
    dot_order: bool = False  # mma: the weight in the dot order (`PreparedFP4Weight.dotted`, `dot_decode`) where K and
    #                          the K-tile are multiples of 128 and without tma; else the pair / element order
    fuse_quant: bool = False  # mma with act_quant and no on_quant observer: the kernel quantizes the activation rows
    #                           itself (per-row S_enc in a first pass over K, each K-tile to its NVFP4 tile values in
    #                           registers) instead of reading `quantize_act_for_gemm`'s tile values: one launch, the
    #                           same output bit for bit; NOT yet measured on a GPU (kernels/NOTES.md, "Fused activation
    #                           quantize"). With on_quant the unfused path runs (the fused kernel writes no codes)


def gemv2_config(M: int, N: int, K: int, device) -> GemmConfig:
    """The decode GEMV's config (best or within 1% of best in the H200 sweep: kernels/NOTES.md, "Dense FP4 GEMM and
    GEMV"): BN=32 rows (4 per warp, 2 per thread), U=2, up to 4 activation rows per program, split-K while N alone
    gives fewer than ~8 CTAs per SM (split 8 best for N=4096, K=14336)."""
    if INTERPRET:
        return GemmConfig(kind="gemv2", BN=8, BM=min(4, max(1, M)), split=2 if K > 256 else 1, num_warps=1,
                          num_stages=1, U=1)
    bm = 1 if M == 1 else (2 if M == 2 else 4)
    bn, nw = 32, 4
    G = triton.cdiv(K, GV_GK)
    ctas = triton.cdiv(N, bn)
    split = 1
    while ctas * split < 8 * num_sms(device) and G // (split * 2) >= 4:
        split *= 2
    u = 2 if (G // split) % 2 == 0 else 1
    return GemmConfig(kind="gemv2", BN=bn, BM=bm, split=split, num_warps=nw, num_stages=1, U=u)


def default_config(M: int, N: int, K: int, device) -> GemmConfig:
    """The MMA tile for M rows: BM covers the batch up to 64; 64 weight rows, 4 warps, 3 stages, the bf16 decode (the
    best of the variants timed at 14336x4096, M=16, on the H200) of the weight in the dot order (no shared-memory
    trip of the decoded tile, ~16% fewer loop instructions per weight); K-tiles of 256 elements at BM 16 (the best of
    the tiles timed at M 1 and 2, which run the same BM 16 tile as M up to 16: 24.7 / 23.4
    us at 14336x4096 / 4096x14336 against 28.0-28.5 / 26.2-26.5 for K-tiles of 128 at M 4-16), else 128; split-K until
    ~4 waves of CTAs while each split keeps >= 1024 elements (kernels/NOTES.md, "Dense FP4 GEMM and GEMV")."""
    if INTERPRET:
        return GemmConfig(BN=16, BM=16, BKW=4, split=2 if K >= 128 else 1, num_warps=1, num_stages=1)
    bm = 16 if M <= 16 else (32 if M <= 32 else 64)
    bn = 64
    tiles = triton.cdiv(N, bn) * triton.cdiv(M, bm)
    kw = K // 8
    split = 1
    target = 4 * num_sms(device)
    while tiles * split < target and kw // (split * 2) >= 128 and M <= 64:
        split *= 2
    return GemmConfig(BN=bn, BM=bm, BKW=32 if bm == 16 else 16, split=split, num_warps=4, num_stages=3,
                      bf16_decode=True, dot_order=True)


def auto_config(M: int, N: int, K: int, device, gemv: bool = True) -> GemmConfig:
    """The config `fp4_linear` runs when it is given none: on a GPU the MMA tile at every M (`default_config`): with
    the weight in the dot order it beats the decode GEMV at M 1 and 2 at both timed shapes (H200, 14336x4096 /
    4096x14336: W4A16 24.7 / 23.4 us against 28.0 / 29.1 at M 1, 25.4 / 23.4 against 34.7 / 34.9 at M 2; W4A4 32.4 /
    33.4 against 32.5 / 36.0 at M 1; kernels/NOTES.md, "Dense FP4 GEMM and GEMV"). In the
    interpreter the GEMV up to 2 rows (`gemv2_config`; gemv: the weight has the GEMV layout), so that the CPU tests
    reach both kernels through the default. benchmarks/bench_kernels.py still times both (rows fp4-w4a16 /
    fp4-w4a16-mma, and the same for W4A4)."""
    if INTERPRET and gemv and M <= 2:
        return gemv2_config(M, N, K, device)
    return default_config(M, N, K, device)


def uses_dot_order(dot_order: bool, K: int, BKW: int, tma: bool) -> bool:
    """Whether an MMA launch (dense or MoE) reads the weight in the dot order: asked for, K and the K-tile (8 BKW)
    multiples of 128, no TMA."""
    return dot_order and not tma and K % DOT_GROUP == 0 and (8 * BKW) % DOT_GROUP == 0


def quantize_act_for_gemm(x: torch.Tensor, check_finite: bool = True, on_quant=None):
    """Per-row NVFP4 quantize of x [M, K] for the W4A4 MMA tile -> (tile values [M, K], factor fp32 [M] =
    2^7 / S_enc). The tile values q * s_b * 2^-7 (bf16, fp32 for an fp32 x; exact in both) are written by the
    pass that computes the codes, and the tile reads them as it reads a W4A16 activation: the same MMA operands
    as decoding the codes in the tile, without that decode in the GEMM's loop (W4A4 on the tile 11-26% faster at
    every MoE size timed on the H200 and 4-21% dense; kernels/NOTES.md, "Dense FP4 GEMM and GEMV").
    on_quant(QuantizedRows), if given, sees the codes, scales and S_enc; a `kernels.quantize.RecordSink` there gets their record form
    written by the same launch."""
    from kernels.quantize import RecordSink, quantize_rows

    fd = torch.float32 if x.dtype == torch.float32 else torch.bfloat16
    sink = on_quant if isinstance(on_quant, RecordSink) else None
    q = quantize_rows(x, "nvfp4", fake_dtype=fd, fake_tile=True, check_finite=check_finite, record=sink)
    if on_quant is not None and sink is None:
        on_quant(q)
    return q.fake, EPI_POW / q.outer.reshape(-1)


def fp4_linear(x: torch.Tensor, w: PreparedFP4Weight, *, act_quant: bool = False, out_dtype: torch.dtype | None = None,
               config: GemmConfig | None = None, check_finite: bool = True, on_quant=None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ dequant(W)^T. x: bf16/fp16/fp32 (fp32 under the interpreter).
    act_quant: W4A4 emulation (per-row NVFP4 activations; on the decode GEMV path the activation is
    quantized and dequantized in one pass and the W4A16 kernel runs on it). out_dtype defaults to x.dtype.
    on_quant(QuantizedRows [M, ...]): with act_quant, called once with the activation's codes, scales and
    outer scales as the kernel uses them (a rollout recorder keeps them: no second quantization); a
    `kernels.quantize.RecordSink` instead has the quantize launch write their record form itself."""
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
    cfg = config or auto_config(M, N, K, x.device, w.gv_words is not None)
    if cfg.kind not in KINDS:
        raise ValueError(f"GemmConfig.kind must be one of {KINDS}, got {cfg.kind!r}")
    if M == 0:
        return torch.empty((0, N), dtype=out_dtype, device=x.device)
    if x.stride(-1) != 1:
        x = x.contiguous()
    fuse = False
    if act_quant and cfg.kind == "gemv2":
        # W4A4 on the W4A16 kernel: the activation's NVFP4 codes and scales are the trainer's (same
        # quantize kernel); the kernel reads their dequantized values (one rounding to x.dtype)
        from kernels.quantize import fake_rows

        x, act_quant = fake_rows(x, on_quant), False
    elif act_quant and cfg.fuse_quant and cfg.kind == "mma" and on_quant is None:  # the MMA kernel quantizes x (FQ)
        xa, xf, stride_xm, fuse = x, x, x.stride(0), True
    elif act_quant:
        xa, xf = quantize_act_for_gemm(x, check_finite=False, on_quant=on_quant)
        stride_xm = K
    else:
        xa, xf, stride_xm = x, x, x.stride(0)
    KW = K // 8
    split = max(1, min(cfg.split, triton.cdiv(KW, cfg.BKW)))
    kw_per_split = triton.cdiv(triton.cdiv(KW, split), cfg.BKW) * cfg.BKW
    split = triton.cdiv(KW, kw_per_split)
    if split > 1:
        out = torch.zeros((M, N), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if cfg.kind == "gemv2" and not act_quant:
        if w.gv_words is None:
            raise ValueError("this weight was prepared with gemv=False; the gemv2 kernel needs gemv_layout")
        return fp4_gemv2(x, w.gv_words, w.gv_scales, w.factor, N, K, cfg, out_dtype)
    if cfg.kind == "gemv" and not act_quant:
        grid = (triton.cdiv(N, cfg.BN), M, split)
        _fp4_gemv_kernel[grid](xa, w.words, w.scales, w.factor, out, M, N, KW, stride_xm, kw_per_split,
                               BN=cfg.BN, BKW=cfg.BKW, SPLIT=split, NIT=kw_per_split // cfg.BKW,
                               num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return out if out.dtype == out_dtype else out.to(out_dtype)
    grid = (triton.cdiv(N, cfg.BN), triton.cdiv(M, cfg.BM), split)
    bf16d = cfg.bf16_decode and not INTERPRET
    dot = uses_dot_order(cfg.dot_order, K, cfg.BKW, cfg.tma)
    words, scales = w.dotted() if dot else (w.paired() if bf16d else w.words, w.scales)
    if cfg.tma:  # TMA rows (global strides and block rows) are multiples of 16 bytes
        if K % 256 or cfg.BKW % 32:
            raise ValueError(f"tma needs K a multiple of 256 and BKW a multiple of 32, got K={K}, BKW={cfg.BKW}")
        words = TensorDescriptor.from_tensor(words, [cfg.BN, cfg.BKW])
        scales = TensorDescriptor.from_tensor(scales, [cfg.BN, cfg.BKW // 2])
    _fp4_gemm_kernel[grid](xa, xf, words, scales, w.factor, out, M, N, KW, stride_xm, kw_per_split, ref.AMAX_MIN,
                           BM=cfg.BM, BN=cfg.BN, BKW=cfg.BKW, SPLIT=split,
                           INTERP=INTERPRET, NIT=kw_per_split // cfg.BKW, BF16D=bf16d, XF=act_quant and not fuse, WDESC=cfg.tma,
                           DOT=dot, KMASK=split * kw_per_split != KW, FQ=fuse, NITA=triton.cdiv(KW, cfg.BKW),
                           num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.maxnreg)
    return out if out.dtype == out_dtype else out.to(out_dtype)
