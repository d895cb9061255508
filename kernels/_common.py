"""Shared Triton helpers for the FP4 kernels (quantize, GEMM, MoE, attention).

Everything here is pure Triton and runs both on a Hopper GPU and under the CPU interpreter
(`TRITON_INTERPRET=1`). `INTERPRET` is read once from the environment and passed to kernels as a
constexpr: under the interpreter dots run in FP32 (`input_precision="ieee"`) on FP32 operands,
because the interpreter's BF16 dot operates on raw bit patterns (DESIGN.md §6a).

Decode trick (DESIGN.md §6a): for a nibble n, the FP32 bit pattern ((n & 7) << 22) | ((n & 8) << 28)
is E2M1(n) * 2^-126. Multiplying by s_b * 2^119 gives E2M1(n) * s_b * 2^-7 exactly (the product has
at most 6 significant bits and stays normal), which is also exact in BF16; the remaining 2^7 is folded
into the per-row / per-tensor outer factor applied after FP32 accumulation.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import reference as ref

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# 2^119 as an FP32 constant: block-scale factor of the decode trick; 2^7 goes to the epilogue.
TWO_POW_119 = 6.646139978924579e35
EPI_POW = 128.0  # 2^7


@triton.jit
def e2m1_rtn_idx(a):
    """|v| (fp32, >= 0) -> E2M1 magnitude index 0..7, round-to-nearest-even, saturating at 6."""
    idx = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    idx += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
    idx += (a > 5.0).to(tl.int32)
    return idx


@triton.jit
def _sat_fma_b40(a, c, ASM: tl.constexpr):
    """min(max(|a| * 2^40 + c, 0), 1), rounded once; NaN -> 0. ASM (GPU): `abs.f32` and one `fma.rn.sat.f32`, which
    ptxas makes one FFMA.SAT with an |a| operand (on the FMA pipe; a separate abs would be a LOP3 on the ALU pipe).
    Else |a| * 2^40, exact for |a| < 2^88, then one rounded add: the same value."""
    if ASM:
        return tl.inline_asm_elementwise("{\n.reg .f32 t;\nabs.f32 t, $1;\nfma.rn.sat.f32 $0, t, 0f53800000, $2;\n}",
                                         "=f,f,f", [a, c], dtype=tl.float32, is_pure=True, pack=1)
    else:
        y = tl.abs(a) * 1099511627776.0 + c
        return tl.where(y > 0.0, tl.minimum(y, 1.0), 0.0)


@triton.jit
def _neg_midpoint_b40(m, s, STRICT: tl.constexpr):
    """-(t * 2^40) with t = m * s (exact: m has at most 3 significant bits, s at most 4) for a `>` midpoint, or
    the float just below m * s for a `>=` one (a >= t exactly when a > that float); s = +inf gives -inf."""
    t = m * s
    if not STRICT:
        t = (t.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True)
    return t * -1099511627776.0


@triton.jit
def e2m1_rtn_idx_fma(a, s, ASM: tl.constexpr):
    """`e2m1_rtn_idx_scaled(|a|, s)` with the seven midpoint compares on the FMA pipe: index = the number of
    midpoints t (or the float below a `>=` midpoint) that |a| exceeds, each a saturating FMA sat((|a| - t) * 2^40)
    (the absolute value an operand modifier of the FMA on a GPU).
    Exact: a > t implies a - t >= ulp(min(a, t)) >= 2^-34 (t >= 0.25 * 2^-9, E4M3's smallest scale), so
    (a - t) * 2^40 >= 64 saturates to 1; a <= t gives <= 0. NaN -> 0, inf -> 7, as the compares. s: the block
    scale (fp32 > 0, broadcast to a's blocks), +inf for a zero-scale block (index 0, as the kernel's mask).
    The quantize kernel's default (`quantize_rows(..., fma_rtn=True)`); its PTX path runs on a GPU only, where
    tests/kernels/test_quantize.py's every_gpu_tile tests check it (kernels/NOTES.md, "Quantize")."""
    idx = _sat_fma_b40(a, _neg_midpoint_b40(0.25, s, True), ASM) + _sat_fma_b40(a, _neg_midpoint_b40(0.75, s, False), ASM)
    idx += _sat_fma_b40(a, _neg_midpoint_b40(1.25, s, True), ASM) + _sat_fma_b40(a, _neg_midpoint_b40(1.75, s, False), ASM)
    idx += _sat_fma_b40(a, _neg_midpoint_b40(2.5, s, True), ASM) + _sat_fma_b40(a, _neg_midpoint_b40(3.5, s, False), ASM)
    idx += _sat_fma_b40(a, _neg_midpoint_b40(5.0, s, True), ASM)
    return (idx + 8388608.0).to(tl.int32, bitcast=True) & 7  # 2^23 + idx: the index in the low bits


@triton.jit
def e2m1_rtn_idx_scaled(p, s):
    """E2M1 index of RN(p / s), p >= 0 and s > 0 fp32, without the division: RN(p / s) > m exactly when
    p > m * s, and RN(p / s) == m exactly when p == m * s, for every midpoint m of the grid (m has at
    most 3 significant bits and s, an E4M3 value, at most 4, so m * s is exact; the half-ulp intervals
    of RN around m, scaled by s, are narrower than the ulps around m * s). Same result as
    `e2m1_rtn_idx(div_rn(p, s))`; callers mask s == 0."""
    idx = (p > 0.25 * s).to(tl.int32) + (p >= 0.75 * s).to(tl.int32) + (p > 1.25 * s).to(tl.int32)
    idx += (p >= 1.75 * s).to(tl.int32) + (p > 2.5 * s).to(tl.int32) + (p >= 3.5 * s).to(tl.int32)
    idx += (p > 5.0 * s).to(tl.int32)
    return idx


@triton.jit
def e2m1_floor_idx(a):
    """Largest index whose grid value is <= a (a >= 0), 0..7."""
    idx = (a >= 0.5).to(tl.int32) + (a >= 1.0).to(tl.int32) + (a >= 1.5).to(tl.int32)
    idx += (a >= 2.0).to(tl.int32) + (a >= 3.0).to(tl.int32) + (a >= 4.0).to(tl.int32)
    idx += (a >= 6.0).to(tl.int32)
    return idx


@triton.jit
def e2m1_grid(idx):
    """E2M1 magnitude of index 0..7 (fp32)."""
    lo = tl.where(idx < 4, idx.to(tl.float32) * 0.5, 0.0)
    hi = tl.where(idx == 4, 2.0, tl.where(idx == 5, 3.0, tl.where(idx == 6, 4.0, 6.0)))
    return tl.where(idx < 4, lo, tl.where(idx <= 7, hi, 6.0))


@triton.jit
def e4m3_byte(s, INTERP: tl.constexpr):
    """Non-negative fp32 -> E4M3 byte (uint8), RNE, saturating at 448.
    GPU: the hardware cast (cvt.rn.satfinite). Interpreter: integer arithmetic, because its fp8 cast
    neither saturates nor rounds correctly across binade boundaries (126.7 -> 64 seen)."""
    s = tl.minimum(s, 448.0)
    if INTERP:
        sub = (s * 512.0 + 8388608.0) - 8388608.0  # rint(s / 2^-9): E4M3 subnormal grid (0..8)
        bits = s.to(tl.int32, bitcast=True)
        r = (bits + 0x7FFFF + ((bits >> 20) & 1)) & ~0xFFFFF  # RNE to 3 mantissa bits
        nrm = ((((r >> 23) - 120) << 3) | ((r >> 20) & 7))
        byte = tl.where(s < 0.015625, sub.to(tl.int32), nrm)
        return byte.to(tl.uint8)
    else:
        return s.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def round_as(g, ptr, INTERP: tl.constexpr):
    """fp32 g rounded (RNE) to ptr's element dtype and back to fp32: the rounding every torch op in that dtype
    makes. The interpreter's fp32 -> bf16 cast truncates, so there bf16 is rounded on the bits."""
    if INTERP and ptr.dtype.element_ty == tl.bfloat16:
        b = g.to(tl.int32, bitcast=True)
        return ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    else:
        return g.to(ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def e4m3_value(b):
    """E4M3 byte (uint8) -> fp32."""
    return b.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def nib_to_f32_scaled(n):
    """int32 tensor whose low 4 bits hold an E2M1 code -> fp32 value * 2^-126 (decode trick)."""
    bits = ((n & 7) << 22) | ((n & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def dequant_tile_words(wp, sp, wmask, smask, R: tl.constexpr, BK: tl.constexpr, BF16: tl.constexpr = False,
                       PAIRED: tl.constexpr = False):
    """NVFP4 tile of R rows x BK elements -> [R, BK] fp32 = q * s_b * 2^-7 (the decode trick: scale by the
    row's 2^7 / S_enc after the MMA). wp: [R, BK/8] pointers to int32 words (8 nibbles, element 8w + j at
    bits 4j), sp: [R, BK/16] pointers to E4M3 scale bytes; masked words and scales read 0. A thread decodes
    whole words, its 8 values joined back in element order in registers (three levels of `tl.join`: the
    last join's pair is the fastest index), so nothing crosses threads before the tile meets the MMA and a
    thread loads 4 bytes per 8 values (a byte-wise decode had the MMA kernels read their pipelined tile
    from shared memory one byte at a time; kernels/NOTES.md, "Dense FP4 GEMM and GEMV"). Used by the GEMM / MoE
    MMA tile and the KV decode attention.
    BF16 (GPU only: inline PTX, `DECODE8_ASM`): decode and scale in bf16 -> [R, BK] bf16, the same values
    (a code's 2 significant bits times a scale's 4 fit bf16's 8, and s_b * 2^119 <= 448 * 2^119 is below
    bf16's largest finite value), a bf16x2 multiply scaling two weights. PAIRED (with BF16): the words are
    in `kernels.gemm.pair_layout`."""
    return dequant_tile_loaded(tl.load(wp, mask=wmask, other=0), tl.load(sp, mask=smask, other=0), R, BK, BF16, PAIRED)


@triton.jit
def dequant_tile_loaded(w, sbytes, R: tl.constexpr, BK: tl.constexpr, BF16: tl.constexpr = False,
                        PAIRED: tl.constexpr = False):
    """`dequant_tile_words` on a tile already loaded: w [R, BK/8] int32 words, sbytes [R, BK/16] E4M3 scale bytes
    (e.g. a TMA tile of the words, `kernels.gemm` with `GemmConfig(tma=True)`)."""
    sc = e4m3_value(sbytes) * 6.646139978924579e35  # s_b * 2^119: exact
    if BF16:  # scaled inside the decode: the scale of each word's block, [R, BK/8]
        scw = tl.reshape(tl.broadcast_to(sc.to(tl.bfloat16)[:, :, None], [R, BK // 16, 2]), [R, BK // 8])
        n0, n1, n2, n3, n4, n5, n6, n7 = _decode8_bf16(w, scw, PAIRED)
    else:
        n0, n1, n2, n3 = nib_to_f32_scaled(w), nib_to_f32_scaled(w >> 4), nib_to_f32_scaled(w >> 8), nib_to_f32_scaled(w >> 12)
        n4, n5, n6, n7 = (nib_to_f32_scaled(w >> 16), nib_to_f32_scaled(w >> 20), nib_to_f32_scaled(w >> 24),
                          nib_to_f32_scaled(w >> 28))
    # [R, BK/8, 2, 2, 2] indexed (a, b, c) = element 8w + 4a + 2b + c
    vals = tl.join(tl.join(tl.join(n0, n4), tl.join(n2, n6)), tl.join(tl.join(n1, n5), tl.join(n3, n7)))
    if BF16:
        out = tl.reshape(vals, [R, BK])
    else:
        out = tl.reshape(tl.reshape(vals, [R, BK // 16, 16]) * sc[:, :, None], [R, BK])
    return out


# PTX: one int32 word of 8 E2M1 nibbles (element j at bits 4j) and a bf16 scale -> its 8 values * scale in bf16, each
# bf16x2 pairing elements p and p + 4 (nibbles 4p and 4p + 16: already 16 bits apart, as a bf16x2's halves are, so no
# byte extract and spread). Per pair: a shift and a mask put both magnitudes' three bits under the halves' exponent
# fields, one mul.rn.bf16x2 scales them, a shift, mask and xor set both signs (the scale is positive); 6 PTX
# instructions, 5 for pair 3 whose signs sit at bits 15 and 31 already (a byte-spread decode takes 8: kernels/NOTES.md,
# "FP4-KV decode attention"). Outputs ($2p, $2p + 1) = elements (p, p + 4). E2M1's subnormal 0.5 becomes a bf16
# subnormal (2^-127), which bf16 arithmetic keeps (no .ftz for bf16).
DECODE8_ASM = tl.constexpr("{\n.reg .b32 ss, m, g;\nmov.b32 ss, {$9, $9};\n" + "".join(
    (f"shl.b32 m, $8, {6 - 4 * p};\n" if p < 2 else f"shr.u32 m, $8, {4 * p - 6};\n")
    + "and.b32 m, m, 0x01C001C0;\nmul.rn.bf16x2 m, m, ss;\n"
    + (f"shl.b32 g, $8, {12 - 4 * p};\nand.b32 g, g, 0x80008000;\n" if p < 3 else "and.b32 g, $8, 0x80008000;\n")
    + f"xor.b32 m, m, g;\nmov.b32 {{${2 * p}, ${2 * p + 1}}}, m;\n" for p in range(4)) + "}")
DECODE8_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # the element each output of DECODE8_ASM holds


# Where the bf16 decode's layouts (`kernels.gemm.pair_layout`, `dot_layout`) put each bit of a word's
# element j = 2p + h (h: 0 low half, 1 high half), as code bit -> word bit (+ 16 h): pairs 0-2 keep a code's
# magnitude (bits 0-2) 9 bits below its sign (bit 3), as a bf16's exponent field sits below its sign, so one shift and
# one mask land both codes of the pair in bf16x2 position; pair 3 fills the four bits left over. The same split as
# `triton_kernels`' Hopper value layout (`_pack_bits` in triton_kernels/tensor_details/layout_details/hopper_value.py,
# v3.6.0).
PAIR_BITS = ((6, 7, 8, 15), (3, 4, 5, 12), (0, 1, 2, 9), (13, 10, 11, 14))  # [pair][code bit] -> word bit


def pack_pair_bits(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes [..., 8] (integer; element j of a word along the last dim) -> int32 words [...]: element j's code
    bit i at bit PAIR_BITS[j // 2][i] + 16 (j % 2)."""
    c = codes.to(torch.int64)
    w = torch.zeros(c.shape[:-1], dtype=torch.int64, device=c.device)
    for j in range(8):
        for i, bit in enumerate(PAIR_BITS[j // 2]):
            w |= ((c[..., j] >> i) & 1) << (bit + 16 * (j % 2))
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def dot_layout(codes: torch.Tensor, group: int) -> torch.Tensor:
    """E2M1 codes uint8 [..., N, K] (K % group == 0, group = 32 T for T = 2 or 4) -> int32 words [..., N, K / 8] whose
    8 values are one thread's registers of the MMA's bf16 left operand (kWidth 2): per group u of K elements, word
    T q + t (q = 0..3, t = 0..T-1) holds element e = 4 s0 + 2 h + c of k = group u + 32 t + 16 s0 + 8 h + 2 q + c, its
    code bit i at bit PAIR_BITS[e // 2][i] + 16 (e % 2). Group 128 is the Triton tile's dot order
    (`kernels.gemm.dot_decode`); group 64 is the wgmma operand's order (slower than the Triton tile: kernels/NOTES.md,
    "Dense FP4 GEMM and GEMV"). As `triton_kernels`' Hopper value layout (tensor_details/layout_details/
    hopper_value.py, v3.6.0), every bit that tells a word's 8 values apart is a register bit of the operand layout,
    so the compiler builds the decode in that layout back to the load and the decoded tile never passes through
    shared memory (kernels/NOTES.md, "Dense FP4 GEMM and GEMV")."""
    *lead, N, K = codes.shape
    T = group // 32
    if group not in (64, 128) or K % group:
        raise ValueError(f"K={K} must be a multiple of {group} (the group: 64 or 128)")
    c = codes.to(torch.int64).reshape(*lead, N, K // group, T, 2, 2, 4, 2)  # [..., u, t, s0, h, q, c]
    u = c.dim() - 6
    c = c.permute(*range(u + 1), u + 4, u + 1, u + 2, u + 3, u + 5)  # [..., u, q, t, s0, h, c]
    return pack_pair_bits(c.reshape(*lead, N, K // 8, 8)).contiguous()


# A dot-order scale byte: the exponent of s_b * 2^119 as a bf16, less 237, over its 3 mantissa bits (E4M3's subnormal
# scales m * 2^-9 are bf16 normals there: every E4M3 value from 2^-9 to 448 is exponent 237..254), so one integer
# multiply-add turns two bytes into the bf16x2 pair of their blocks' s_b * 2^119: (byte << 4) + 0x7680 in each half
# (`kernels.gemm._DOT_ASM`).
SCALE_EXP0 = 237
SCALE_MAD = (SCALE_EXP0 << 7) * 0x10001  # 0x76807680: the exponent offset under both halves


def dot_scales(scales: torch.Tensor) -> torch.Tensor:
    """E4M3 scale bytes uint8 [..., N, K/16] -> the dot order's scale bytes viewed as int16 [..., N, K/32] (blocks
    2i, 2i + 1 of a row in one 16-bit load, low byte first; `PreparedFP4Weight.dotted` reads them as int32). A zero scale (its block's codes are all zero) becomes byte 0."""
    s = ref.e4m3_decode(scales)
    bits = (s * 2.0**119).to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF  # exact: 4 significant bits
    exp, man = bits >> 7, (bits >> 4) & 7
    byte = torch.where(s > 0, ((exp - SCALE_EXP0) << 3) | man, torch.zeros_like(bits))
    if bool(((exp < SCALE_EXP0) & (s > 0)).any()) or bool((exp > SCALE_EXP0 + 31).any()):
        raise ValueError("a scale outside E4M3's positive range")
    return byte.to(torch.uint8).contiguous().view(torch.int16)


def pair_decode_ptx(scales) -> str:
    """PTX lines that decode word $8 (in the PAIR_BITS layout) into $0..$7, pair p times the bf16x2 register
    scales[p]: pairs 0, 1, 2 by a shift (0, 3, 6) and one mask that keeps both magnitudes under the bf16x2's
    exponent fields and both signs on its sign bits, then one mul.rn.bf16x2 (the sign goes through the multiply:
    round-to-nearest is symmetric, so (-m) * s = -(m * s) bit for bit, -0 included); pair 3's sign, exponent bits and
    mantissa bit each moved into place by a shift and a mask. 15 instructions per 8 values, against 20 with each
    pair's sign 3 bits above its magnitude (kernels/NOTES.md, "Grouped MoE"). Uses .b32 registers m and g."""
    out = "".join(("" if p == 0 else f"shl.b32 m, $8, {3 * p};\n")
                  + f"and.b32 m, {'$8' if p == 0 else 'm'}, 0x81C081C0;\n"
                  f"mul.rn.bf16x2 m, m, {scales[p]};\nmov.b32 {{${2 * p}, ${2 * p + 1}}}, m;\n" for p in range(3))
    return out + ("shl.b32 m, $8, 1;\nand.b32 m, m, 0x80008000;\nshr.u32 g, $8, 3;\nand.b32 g, g, 0x01800180;\n"
                  "or.b32 m, m, g;\nshr.u32 g, $8, 7;\nand.b32 g, g, 0x00400040;\nor.b32 m, m, g;\n"
                  f"mul.rn.bf16x2 m, m, {scales[3]};\nmov.b32 {{$6, $7}}, m;\n")


# The same for a word in `kernels.gemm.pair_layout` (PAIR_BITS), one scale for all 8 values.
DECODE8_PAIRED_ASM = tl.constexpr("{\n.reg .b32 ss, m, g;\nmov.b32 ss, {$9, $9};\n"
                                   + pair_decode_ptx(("ss",) * 4) + "}")


@triton.jit
def _decode8_bf16(w, scale, PAIRED: tl.constexpr):
    """GPU only: w int32 [...] (8 nibbles; PAIRED: in `pair_layout`) and scale bf16 [...] -> 8 bf16 tensors,
    element j = its E2M1 value * scale * 2^-126 (`DECODE8_ASM` / `DECODE8_PAIRED_ASM`)."""
    if PAIRED:
        out = tl.inline_asm_elementwise(DECODE8_PAIRED_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [w, scale],
                                        dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    else:
        e0, e4, e1, e5, e2, e6, e3, e7 = tl.inline_asm_elementwise(
            DECODE8_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [w, scale], dtype=(tl.bfloat16,) * 8, is_pure=True,
            pack=1)
        out = e0, e1, e2, e3, e4, e5, e6, e7
    return out


def num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def check_tensor(x, name, dtypes=None, dim=None, finite=False, device=None):
    """Python-side validation before a launch (raises TypeError/ValueError)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if dtypes is not None and x.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {x.dtype}")
    if dim is not None and x.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(x.shape)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name} is on {x.device}, expected {device}")
    if finite and x.is_floating_point() and x.numel() and not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"{name} has {bad} non-finite values of {x.numel()}")
