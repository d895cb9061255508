"""The decode GEMV of the dense FP4 GEMM (no tensor cores, up to a few rows): its weight layout and kernel.

What: `gemv_layout` re-lays NVFP4 codes and scale bytes for the GEMV (groups of 256 K-elements, 16-byte chunks
whose nibble slots (`GV_BITS`) decode in 2-4 integer ops); `fp4_gemv2` launches the kernel that reads it
(`kernels.gemm.fp4_linear` calls it for the "gemv2" config kind); `gv_group` is the kernel's inner loop, shared
with the grouped MoE GEMV of kernels/moe.py. `kernels.gemm.prepare_weight` builds the layout next to the MMA
tile's words (the same weight), and `kernels.gemm` re-exports the layout's public names.

Compared against: `kernels.reference.fp4_linear` in tests/kernels/test_gemv_v1.py (interpreter).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

GV_TK = 8  # 32-element chunks per K-group (threads along K per weight row)
GV_GK = 32 * GV_TK  # K elements per group
# Bit positions (magnitude field start, sign bit) of element slot j = 0..7 in a GEMV word. Slots
# 0-3 have the sign 9 bits above the magnitude, so one shift by 22 - mpos puts the magnitude at FP32
# bits 22-24 and the sign at bit 31 and one AND with 0x81C00000 finishes the decode (2 ops); slot 5
# has its magnitude at 22 already (3 ops); the others need a shift each for magnitude and sign
# (4 ops). 23 ops per 8 weights instead of 32 with plain nibbles (a brute-force search over
# placements found no layout with more than 6 two-op slots, and none better than 23 overall).
GV_BITS = ((0, 9), (3, 12), (6, 15), (16, 25), (19, 10), (22, 11), (26, 13), (29, 14))


def gemv_layout(codes: torch.Tensor, scales: torch.Tensor):
    """Offline GEMV layout of NVFP4 codes [(E,) N, K] and scale bytes [(E,) N, K/16].

    K is padded with zero codes / zero scales to a multiple of 256 (G = K_pad/256 groups); each group
    holds 8 chunks of 32 elements (= 2 NVFP4 blocks). Chunk t of group g of row n is 4 int32 words
    (16 bytes) stored at words[(e,) g, n, t, 0:4]; word w, nibble j (bits 4j..4j+3) holds element
    g*256 + 32t + 4j + w (bit positions of slot j: GV_BITS, not plain nibbles). So one thread's 16-byte load covers one chunk, the x-values multiplied
    with nibble j of the 4 words are contiguous (x[.. + 4j : .. + 4j + 4], a vector load), nibbles
    j < 4 belong to the chunk's first block and j >= 4 to its second, and a warp's 32 loads
    (4 rows x 8 chunks) are 512 contiguous bytes. Scales: uint8 [(E,) G, N, 8, 4] = the chunk's two
    E4M3 block-scale bytes and two zero bytes: the same [rows, chunks, 4] shape and address pattern
    as the words, so Triton gives both loads the same register layout (a separate [rows, chunks]
    scale tile gets its own layout and a shared-memory conversion per iteration; measured offline
    in the TTGIR). Costs 4 instead of 2 scale bytes per 32 weights (0.625 instead of 0.5625 B/weight).
    Returns (words int32 [(E,) G, N, 8, 4], scales uint8 [(E,) G, N, 8, 4])."""
    *lead, N, K = codes.shape
    G = -(-K // GV_GK)
    Kp = G * GV_GK
    c = codes
    s = scales
    if Kp != K:
        c = torch.nn.functional.pad(c, (0, Kp - K))
        s = torch.nn.functional.pad(s, (0, (Kp - K) // 16))
    c = c.reshape(*lead, N, G, GV_TK, 8, 4).to(torch.int64)  # [.., N, g, t, j, w]
    words = torch.zeros(c.shape[:-2] + (4,), dtype=torch.int64, device=c.device)
    for j, (mpos, spos) in enumerate(GV_BITS):
        cj = c[..., j, :]
        words |= (cj & 7) << mpos  # magnitude bits (m, e0, e1) at mpos..mpos+2
        words |= ((cj >> 3) & 1) << spos  # sign bit
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    nd = len(lead)
    perm = list(range(nd)) + [nd + 1, nd, nd + 2, nd + 3]  # -> [.., g, N, t, w]
    words = words.permute(*perm).contiguous()
    sb = s.reshape(*lead, N, G, GV_TK, 2)
    sb = torch.cat([sb, torch.zeros_like(sb)], -1)  # [.., N, g, t, 4]
    sb = sb.permute(*perm).contiguous()
    return words, sb


@triton.jit
def _gv_decode(w, j: tl.constexpr):
    """Slot j of `gemv_layout` words -> fp32 E2M1 * 2^-126 (bit trick of kernels._common with the
    GV_BITS placement: magnitude to bits 22-24, sign to bit 31)."""
    if j == 0:
        b = (w << 22) & -2118123520  # 0x81C00000
    elif j == 1:
        b = (w << 19) & -2118123520
    elif j == 2:
        b = (w << 16) & -2118123520
    elif j == 3:
        b = (w << 6) & -2118123520
    elif j == 4:
        b = ((w << 3) & 0x01C00000) | ((w << 21) & -2147483648)
    elif j == 5:
        b = (w & 0x01C00000) | ((w << 20) & -2147483648)
    elif j == 6:
        b = ((w >> 4) & 0x01C00000) | ((w << 18) & -2147483648)
    else:
        b = ((w >> 7) & 0x01C00000) | ((w << 17) & -2147483648)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _gv_load(w_ptrs, s_ptrs, wmask):
    """Raw tiles of one K-group: words [8, BN, 4] int32 and scale bytes [8, BN, 4] uint8."""
    if wmask is None:
        return tl.load(w_ptrs), tl.load(s_ptrs)
    else:
        return tl.load(w_ptrs, mask=wmask, other=0), tl.load(s_ptrs, mask=wmask, other=0)


@triton.jit
def _gv_scales(sb, w3):
    """[8, rows, 4] scale bytes (lo, hi, 0, 0) -> (s_lo, s_hi) [8, rows, 1] fp32 times 2^119 (the
    decode-trick factor). The selects are over the in-thread dimension and fold to register picks."""
    sf = sb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    lo = tl.sum(tl.where(w3 == 0, sf, 0.0), axis=2) * 6.646139978924579e35
    hi = tl.sum(tl.where(w3 == 1, sf, 0.0), axis=2) * 6.646139978924579e35
    return lo[:, :, None], hi[:, :, None]


@triton.jit
def _gv_row(acc, wv, x_ptrs, xmask):
    x = tl.load(x_ptrs, mask=xmask, other=0.0).to(tl.float32)
    return acc + wv * x


@triton.jit
def gv_group(acc0, acc1, acc2, acc3, w_ptrs, s_ptrs, wmask, xp0, xp1, xp2, xp3, xm0, xm1, xm2, xm3,
             kk, K, BM: tl.constexpr):
    """One K-group of the `gemv_layout` weight (words and scales at w_ptrs / s_ptrs [8, BN, 4], masked by wmask)
    against up to BM <= 4 activation rows (pointers xp*, masks xm*, element indices kk [8, 1, 4] of nibble 0):
    acc_m [8, BN, 4] += their products. The inner loop of the dense decode GEMV and of kernels/moe.py's."""
    w, sb = _gv_load(w_ptrs, s_ptrs, wmask)
    return _gv_compute(acc0, acc1, acc2, acc3, w, sb, xp0, xp1, xp2, xp3, xm0, xm1, xm2, xm3, kk, K, BM)


@triton.jit
def _gv_compute(acc0, acc1, acc2, acc3, w, sb, xp0, xp1, xp2, xp3, xm0, xm1, xm2, xm3, kk, K,
                BM: tl.constexpr):
    """One K-group (8 chunks of 32 per row) of up to 4 activation rows: acc_m [8, BN, 4] +=
    dequant(W chunk) * x_m. The E2M1*s_b*2^-7 product is exact, so each FMA sees exact weights.
    Tile dims are (chunk t, row n, word w): Triton's coalescing pass orders equally-contiguous dims
    by position, so t before n puts the 8 chunks of a row on adjacent lanes (512 B per warp load)."""
    s_lo, s_hi = _gv_scales(sb, tl.arange(0, 4)[None, None, :])  # [8, BN, 1]
    # slots 4..7 read the chunk's second 16-block, which lies past K when K % 32 == 16
    hi_ok = kk + 16 < K
    for j in tl.static_range(8):
        if j < 4:
            wv = _gv_decode(w, j) * s_lo
            m0, m1, m2, m3 = xm0, xm1, xm2, xm3
        else:
            wv = _gv_decode(w, j) * s_hi
            m0, m1, m2, m3 = xm0 & hi_ok, xm1 & hi_ok, xm2 & hi_ok, xm3 & hi_ok
        acc0 = _gv_row(acc0, wv, xp0 + 4 * j, m0)
        if BM > 1:
            acc1 = _gv_row(acc1, wv, xp1 + 4 * j, m1)
        if BM > 2:
            acc2 = _gv_row(acc2, wv, xp2 + 4 * j, m2)
        if BM > 3:
            acc3 = _gv_row(acc3, wv, xp3 + 4 * j, m3)
    return acc0, acc1, acc2, acc3


@triton.jit
def _gv_store(out_ptr, acc, f, o_ptrs, omask, SPLIT: tl.constexpr):
    y = tl.sum(tl.sum(acc, axis=2), axis=0) * f
    if SPLIT > 1:
        tl.atomic_add(o_ptrs, y, mask=omask, sem="relaxed")
    else:
        tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _fp4_gemv2_kernel(x_ptr, w_ptr, s_ptr, wf_ptr, out_ptr, M, N, K, G, stride_xm, g_per_split,
                      BN: tl.constexpr, BM: tl.constexpr, U: tl.constexpr, SPLIT: tl.constexpr,
                      NIT: tl.constexpr, EVEN: tl.constexpr, PREFETCH: tl.constexpr = False):
    """Decode GEMV over the `gemv_layout` weight: grid (row groups of BM <= 4, N / BN, split-K).
    Program tile [8 chunks, BN rows, 4 words]: a thread owns one 16-byte chunk (32 weights) of a
    row per K-group; U groups per loop iteration are independent loads in flight. Rows of x stay in
    registers (BM accumulators), so each decoded weight is used BM times. One cross-thread reduction
    over the 8 chunk lanes at the end."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < N
    n3 = offs_n[None, :, None]
    t3 = tl.arange(0, 8)[:, None, None]
    w3 = tl.arange(0, 4)[None, None, :]
    m0 = pid_m * BM
    r0 = m0.to(tl.int64) * stride_xm
    acc0 = tl.zeros([8, BN, 4], tl.float32)
    acc1 = tl.zeros([8, BN, 4], tl.float32)
    acc2 = tl.zeros([8, BN, 4], tl.float32)
    acc3 = tl.zeros([8, BN, 4], tl.float32)
    g_lo = pid_k * g_per_split
    g_hi = tl.minimum(g_lo + g_per_split, G)
    if PREFETCH:  # U == 1, register double buffer: load group g+1 before decoding group g
        wn, sn = _gv_load(w_ptr + (g_lo.to(tl.int64) * N + n3) * 32 + t3 * 4 + w3,
                          s_ptr + (g_lo.to(tl.int64) * N + n3) * 32 + t3 * 4 + w3, (n3 < N) & (g_lo < g_hi))
        for it in range(NIT):
            g = g_lo + it
            wc = wn
            sc = sn
            nb = ((g + 1).to(tl.int64) * N + n3) * 32 + t3 * 4 + w3
            wn, sn = _gv_load(w_ptr + nb, s_ptr + nb, (n3 < N) & (g + 1 < g_hi))
            kk = g * 256 + t3 * 32 + w3
            xok = (kk < K) & (g < g_hi)
            xp = x_ptr + r0 + kk
            acc0, acc1, acc2, acc3 = _gv_compute(
                acc0, acc1, acc2, acc3, wc, sc, xp, xp + stride_xm, xp + 2 * stride_xm, xp + 3 * stride_xm,
                xok & (m0 < M), xok & (m0 + 1 < M), xok & (m0 + 2 < M), xok & (m0 + 3 < M), kk, K, BM)
    else:
        for it in range(NIT):
            for u in tl.static_range(U):
                g = g_lo + it * U + u
                base = (g.to(tl.int64) * N + n3) * 32 + t3 * 4 + w3  # [8, BN, 4]
                kk = g * 256 + t3 * 32 + w3  # [8, 1, 4] element index of nibble 0
                if EVEN:  # N % BN == 0, K % 256 == 0, every program has whole U-steps: no masks
                    wmask = None
                    xok = kk >= 0
                else:
                    gok = g < g_hi
                    wmask = (n3 < N) & gok
                    xok = (kk < K) & gok
                xp = x_ptr + r0 + kk
                acc0, acc1, acc2, acc3 = gv_group(
                    acc0, acc1, acc2, acc3, w_ptr + base, s_ptr + base, wmask,
                    xp, xp + stride_xm, xp + 2 * stride_xm, xp + 3 * stride_xm,
                    xok & (m0 < M), xok & (m0 + 1 < M), xok & (m0 + 2 < M), xok & (m0 + 3 < M), kk, K, BM)
    f = tl.load(wf_ptr)
    o_ptrs = out_ptr + m0.to(tl.int64) * N + offs_n
    _gv_store(out_ptr, acc0, f, o_ptrs, nmask & (m0 < M), SPLIT)
    if BM > 1:
        _gv_store(out_ptr, acc1, f, o_ptrs + N, nmask & (m0 + 1 < M), SPLIT)
    if BM > 2:
        _gv_store(out_ptr, acc2, f, o_ptrs + 2 * N, nmask & (m0 + 2 < M), SPLIT)
    if BM > 3:
        _gv_store(out_ptr, acc3, f, o_ptrs + 3 * N, nmask & (m0 + 3 < M), SPLIT)


def fp4_gemv2(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, factor: torch.Tensor, N: int, K: int,
              cfg, out_dtype: torch.dtype) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T for W in `gemv_layout` (words, scales) with epilogue factor `factor` (fp32 [1],
    2^7 / S_enc): the "gemv2" kind of `kernels.gemm.fp4_linear`, which checks the operands. cfg: its
    `kernels.gemm.GemmConfig` (BN, BM rows per program (at most 4), U groups per loop step, split-K, prefetch,
    num_warps, num_stages)."""
    M = x.shape[0]
    G = words.shape[0]
    split = max(1, min(cfg.split, G))
    gps = triton.cdiv(G, split)
    split = triton.cdiv(G, gps)
    bm = max(1, min(cfg.BM, 4))
    if cfg.prefetch and cfg.U != 1:
        raise ValueError("gemv2 prefetch needs U=1")
    if split > 1:
        out = torch.zeros((M, N), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((M, N), dtype=out_dtype, device=x.device)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, cfg.BN), split)
    _fp4_gemv2_kernel[grid](x, words, scales, factor, out, M, N, K, G, x.stride(0), gps,
                            BN=cfg.BN, BM=bm, U=cfg.U, SPLIT=split, NIT=triton.cdiv(gps, cfg.U),
                            EVEN=(N % cfg.BN == 0 and K % GV_GK == 0 and gps % cfg.U == 0 and G % gps == 0),
                            PREFETCH=cfg.prefetch,
                            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out if out.dtype == out_dtype else out.to(out_dtype)
