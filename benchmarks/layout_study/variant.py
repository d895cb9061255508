"""Study, not library code (kernels/NOTES.md, "The MoE / dense tile without the shared-memory trip"): an NVFP4 variant
of our Triton MMA tile whose decoded weights reach `tl.dot` as the LEFT operand with no
shared-memory trip (swap-AB: acc [BN, BM]).

Offline order (`variant_words`, `variant_scales` below; a CPU statement of it): per row n and per group of G K
elements (G = 64 or 128, a multiple of 32; the tile's BK is a multiple of G), word j = (G/32) q + t (q = 0..3,
t = 0..G/32-1) of the group holds the 8 elements

    k = 32 t + 16 s0 + 8 h + 2 q + c          (element e = 4 s0 + 2 h + c of the word, pair p = 2 s0 + h)

each in the bf16 pair layout of kernels._common.PAIR_BITS (element e's code bit i at bit PAIR_BITS[e // 2][i] +
16 (e % 2)). These are exactly the 8 values that the wgmma A fragment (bf16, kWidth 2) gives lane 4 g + q for one
row: k = 2 q + {0, 1} (the halves of a bf16x2 register, c) + 8 h + 16 s with s = 2 t + s0. So every bit that
distinguishes the 8 values of a word is a REGISTER bit of the dot-operand layout, and a thread's G/32 words of a
group are adjacent in memory (one 8- or 16-byte load). With G = 64 it is `kernels.wgmma.wgmma_layout` (v4a's).
Scales: a row's E4M3 block scales re-encoded as v4a's bytes (`kernels.wgmma.wgmma_scales`: the bf16 exponent of
s * 2^119 less 237 over its 3 mantissa bits) in natural block order, read as int16 pairs (blocks 2i, 2i + 1): word
(q, t) of group u takes pair i = (G/32) u + t: s0 picks the byte. bf16(s * 2^119) = (byte << 4) + 0x7680.
S32 (the kept variant): the same bytes read as int32 (blocks 4i..4i+3); the asm gets a per-register constant
selector (t even: low pair, odd: high pair), so a word's two multipliers cost one PRMT + one LEA.
K is padded offline to a multiple of BK (zero codes, scale byte 0); the kernel masks rows only on W (x on K).
"""
import torch
import triton
import triton.language as tl

from kernels._common import PAIR_BITS, pair_decode_ptx

# word $8, scale pair $9 (16 bits: low byte block 2i, high byte block 2i + 1) -> $0..$7 (element e = 2 p + c).
# pairs 0, 1 (s0 = 0) times block 2i's scale, pairs 2, 3 times block 2i + 1's.
_VAR_ASM = tl.constexpr(
    "{\n.reg .b32 x, sp, sa, sb, m, g;\n.reg .b16 lo, hi;\n"
    "mov.b32 x, {$9, $9};\n"
    "prmt.b32 x, x, 0, 0x4140;\n"           # [b0, 0, b1, 0]
    "mad.lo.u32 sp, x, 16, 0x76807680;\n"   # bf16x2 (S(b0), S(b1)) = s * 2^119
    "mov.b32 {lo, hi}, sp;\n"
    "mov.b32 sa, {lo, lo};\n"
    "mov.b32 sb, {hi, hi};\n"
    + pair_decode_ptx(("sa", "sa", "sb", "sb")) + "}")


# the same with the scale operand a 32-bit word of 4 scale bytes (pairs 2i, 2i + 1) and a per-register selector $10
# (0x4140: low pair, 0x4342: high pair) that ptxas sees as a constant: one PRMT + one LEA per word
_VAR_ASM32 = tl.constexpr(
    "{\n.reg .b32 x, sp, sa, sb, m, g;\n.reg .b16 lo, hi;\n"
    "prmt.b32 x, $9, 0, $10;\n"
    "mad.lo.u32 sp, x, 16, 0x76807680;\n"
    "mov.b32 {lo, hi}, sp;\n"
    "mov.b32 sa, {lo, lo};\n"
    "mov.b32 sb, {hi, hi};\n"
    + pair_decode_ptx(("sa", "sa", "sb", "sb")) + "}")


@triton.jit
def _variant_decode32(w, s32, BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr):
    """as _variant_decode with s32 int32 [BN, BK/64] (4 scale bytes, blocks 4i..4i+3); G >= 64."""
    U: tl.constexpr = BK // G
    T: tl.constexpr = G // 32
    sw = tl.reshape(tl.broadcast_to(tl.reshape(s32, [BN, U, 1, T // 2, 1]), [BN, U, 4, T // 2, 2]), [BN, BK // 8])
    sel = 0x4140 + 0x202 * tl.arange(0, 2)
    sel = tl.reshape(tl.broadcast_to(tl.reshape(sel, [1, 1, 1, 1, 2]), [BN, U, 4, T // 2, 2]), [BN, BK // 8])
    o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
        _VAR_ASM32, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [w, sw, sel], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    v = tl.join(tl.join(tl.join(o0, o1), tl.join(o2, o3)), tl.join(tl.join(o4, o5), tl.join(o6, o7)))
    v = tl.reshape(v, [BN, U, 4, T, 2, 2, 2])        # n, u, q, t, c, h, s0
    v = tl.permute(v, (0, 1, 3, 6, 5, 2, 4))          # n, u, t, s0, h, q, c
    return tl.reshape(v, [BN, BK])


@triton.jit
def _variant_decode(w, s16, BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr):
    """w int32 [BN, BK/8] (the variant order), s16 int16 [BN, BK/32] -> bf16 [BN, BK] in natural k order."""
    U: tl.constexpr = BK // G if G > 0 else BK // 32
    T: tl.constexpr = G // 32 if G > 0 else 1
    sw = tl.reshape(tl.broadcast_to(tl.reshape(s16, [BN, U, 1, T]), [BN, U, 4, T]), [BN, BK // 8])
    o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
        _VAR_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [w, sw], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    # [BN, BK/8, c, h, s0]: the innermost join's new dim comes first
    v = tl.join(tl.join(tl.join(o0, o1), tl.join(o2, o3)), tl.join(tl.join(o4, o5), tl.join(o6, o7)))
    if G == 0:  # control: a word holds 8 consecutive k (our current order's content), k = 8 j + 4 s0 + 2 h + c
        v = tl.permute(v, (0, 1, 4, 3, 2))
        return tl.reshape(v, [BN, BK])
    v = tl.reshape(v, [BN, U, 4, T, 2, 2, 2])        # n, u, q, t, c, h, s0
    v = tl.permute(v, (0, 1, 3, 6, 5, 2, 4))          # n, u, t, s0, h, q, c
    return tl.reshape(v, [BN, BK])


@triton.jit
def variant_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn, NIT,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr, MASK: tl.constexpr,
                   S32: tl.constexpr = False):
    """out[M, N] (fp32) = x[M, K] (bf16) @ dequant(W)^T * 2^-7 (the row factor 2^7 / S_enc left out), swap-AB:
    acc [BN, BM] += W_tile [BN, BK] @ x_tile^T [BK, BM]. w_ptr: int32 words [N, K/8] (variant order), s_ptr:
    int16 [N, K/32]. stride_wn / stride_sn: their row strides (K/8, K/32; multiples of 16 at the launch
    so that Triton specializes them as aligned: the scale tile then comes by cp.async like the words)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = pid_m * BM + tl.arange(0, BM)
    nmask = offs_n < N
    mmask = offs_m < M
    acc = tl.zeros([BN, BM], tl.float32)
    for it in range(NIT):
        k0 = it * BK
        offs_k = k0 + tl.arange(0, BK)
        offs_w = k0 // 8 + tl.arange(0, BK // 8)
        SD: tl.constexpr = 64 if S32 else 32  # K per scale element (int32: 4 bytes, int16: 2)
        offs_s = k0 // SD + tl.arange(0, BK // SD)
        xp = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None]
        wp = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_w[None, :]
        sp = s_ptr + offs_n[:, None].to(tl.int64) * stride_sn + offs_s[None, :]
        if MASK:
            xv = tl.load(xp, mask=(offs_k < K)[:, None] & mmask[None, :], other=0.0)
            # rows only: the weight is padded offline to a multiple of BK along K (zero codes), x reads 0 past K
            w = tl.load(wp, mask=nmask[:, None], other=0)
            s16 = tl.load(sp, mask=nmask[:, None], other=0)
        else:
            xv = tl.load(xp)
            w = tl.load(wp)
            s16 = tl.load(sp)
        if S32:
            wv = _variant_decode32(w, s16, BN, BK, G)
        else:
            wv = _variant_decode(w, s16, BN, BK, G)
        acc = tl.dot(wv, xv, acc)
    o_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
    tl.store(o_ptrs, acc, mask=nmask[:, None] & mmask[None, :])


# ---------------------------------------------------------------------------------------------------------------
# CPU statement of the offline order, and a numpy emulation of the decode + the tensor chain above
# ---------------------------------------------------------------------------------------------------------------
def variant_codes_order(N: int, K: int, G: int):
    """-> int64 [N, K/8, 8]: for word (n, w) and element e, the k of the code it holds (n is unchanged)."""
    import numpy as np
    T = G // 32
    k = np.zeros((K // 8, 8), np.int64)
    for w in range(K // 8):
        u, j = divmod(w, G // 8)
        q, t = divmod(j, T)
        for e in range(8):
            s0, h, c = e >> 2, (e >> 1) & 1, e & 1
            k[w, e] = G * u + 32 * t + 16 * s0 + 8 * h + 2 * q + c
    return np.broadcast_to(k, (N, K // 8, 8))


def variant_words(codes: torch.Tensor, G: int = 128) -> torch.Tensor:
    """E2M1 codes uint8 [N, K] (K % G == 0) -> int32 words [N, K/8] in the variant order (module docstring)."""
    N, K = codes.shape
    T = G // 32
    c = codes.to(torch.int64).reshape(N, K // G, T, 2, 2, 4, 2)  # n, u, t, s0, h, q, c
    c = c.permute(0, 1, 5, 2, 3, 4, 6).reshape(N, K // 8, 8)  # n, (u, q, t), (s0, h, c)
    w = torch.zeros(N, K // 8, dtype=torch.int64)
    for e in range(8):
        for i, bit in enumerate(PAIR_BITS[e // 2]):
            w |= ((c[..., e] >> i) & 1) << (bit + 16 * (e % 2))
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def variant_scales(scales: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes uint8 [N, K/16] -> int16 [N, K/32] (v4a's re-encoded bytes, natural order, pairs)."""
    from kernels.wgmma import wgmma_scales
    return wgmma_scales(scales)
