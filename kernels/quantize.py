"""Triton activation / KV quantize kernel: rows -> packed FP4 codes, block scales, outer scales.

What: per-row NVFP4 (16-element blocks, E4M3 block scales, FP32 per-row outer scale S_enc, so the
result is batch-invariant) or MXFP4 (32-element blocks, E8M0 scales), with round-to-nearest-even
('rtn') or seeded stochastic rounding. Optionally emits TRACE's guidance record in the same pass:
the mantissa bit of every code, packed 8 per byte (element 8i+j in bit j of byte i), next to the
block-scale bytes and outer scales that the kernel writes anyway. With `dst_rows` the outputs are
scattered to given rows of caller-owned buffers (the FP4 KV-cache store uses this).

Compared against: `kernels.reference.nvfp4_quantize(x, outer="row")` / `mxfp4_quantize` and
`pack_fp4` / `pack_bits`; codes and scale bytes are bit-exact for 'rtn' (tests/kernels/test_quantize.py).
Stochastic contract: u = Philox uniform `tl.rand(seed, row * K + col)`; the code rounds up from the
grid point below |v| to the one above with probability (|v| - lo) / (hi - lo), so the result is
unbiased within [-6, 6], always one of the two bracketing codes, deterministic for a given seed and
independent of the launch configuration (not bit-identical to torch's generator in the reference).

Run: `python -m pytest tests/kernels/test_quantize.py -q` (CPU interpreter without a GPU);
GPU timing in `benchmarks/bench_kernels.py`.

    from kernels.quantize import quantize_rows
    q = quantize_rows(x_bf16, fmt="nvfp4", guidance=True)   # q.packed [M, K/2] uint8, q.scales [M, K/16]
                                                            # q.outer [M, 1] fp32 S_enc, q.mantissa [M, K/8]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import reference as ref
from kernels._common import (
    INTERPRET,
    check_tensor,
    e2m1_floor_idx,
    e2m1_grid,
    e2m1_rtn_idx,
    e2m1_rtn_idx_fma,
    e2m1_rtn_idx_scaled,
    e4m3_byte,
    e4m3_value,
    round_as,
)

# S_enc = 2688 / amax and s_b = amax_blk * S_enc / 6 are correctly rounded divisions (div_rn) in
# the kernel and in the reference (which divides tensor by tensor for that reason).


@dataclass
class QuantizedRows:
    """Kernel output. `packed` uint8 [..., K/2] (element 2i low nibble); `scales` uint8 [..., K/block]
    (E4M3 for NVFP4, E8M0 for MXFP4); `outer` fp32 [..., 1] S_enc (ones for MXFP4); `mantissa`
    uint8 [..., K/8] packed mantissa bits or None; `fake` the dequantized values e2m1 * s_b * (1/S_enc)
    in fp32 (within 1 ulp of the reference's division), cast once to `fake_dtype`, or None."""

    packed: torch.Tensor
    scales: torch.Tensor
    outer: torch.Tensor
    mantissa: torch.Tensor | None
    fmt: str
    fake: torch.Tensor | None = None  # [..., K] dequantized values (fake_dtype), when asked for

    def codes(self) -> torch.Tensor:
        return ref.unpack_fp4(self.packed)

    def dequantize(self) -> torch.Tensor:
        if self.fmt == "nvfp4":
            return ref.nvfp4_dequantize(self.codes(), self.scales, self.outer)
        return ref.mxfp4_dequantize(self.codes(), self.scales)


@dataclass
class RecordTargets:
    """Where a quantize launch of M rows writes the record form of its rows, step-major: row r of x goes to row
    `step * M + r` of each buffer, step read from the device tensor `step` [1] (int) when the kernel runs, so a
    CUDA graph replays the launch into the row of whatever step the tensor holds. mantissa uint8 [steps, M, K/8]
    (element 8i+j in bit j of byte i: `kernels.reference.pack_bits(codes & 1)`), scales uint8 [steps, M, K/block],
    outer float32 [steps, M] (the rows' S_enc; ones for MXFP4), codes uint8 [steps, M, K/2] (`pack_fp4`) or None.
    All contiguous."""

    mantissa: torch.Tensor
    scales: torch.Tensor
    outer: torch.Tensor
    codes: torch.Tensor | None
    step: torch.Tensor


class RecordSink:
    """A record destination that `quantize_rows(record=...)`, `fake_rows` and `kernels.gemm.quantize_act_for_gemm`
    (hence `fp4_linear` / `fused_moe` where their `on_quant` observer goes, and `kernels.attention.kv_store`)
    recognize: instead of handing the launch's QuantizedRows to an observer, the quantize launch itself writes the
    record form of its rows into the sink's buffers, at no cost beyond those bytes. make(M, K, fmt) gives the
    buffers for a launch of M rows of width K (RecordTargets, or its fields as a tuple); the owner allocates them
    on the first call and returns the same ones after (a captured CUDA graph writes to those addresses). A code
    path that only knows observers calls the sink with the QuantizedRows, which writes the same bytes with torch
    ops (`__call__`)."""

    def __init__(self, make):
        self.make = make

    def targets(self, M: int, K: int, fmt: str) -> RecordTargets:
        t = self.make(M, K, fmt)
        return t if isinstance(t, RecordTargets) else RecordTargets(*t)

    def __call__(self, q: QuantizedRows) -> None:
        K = q.packed.shape[-1] * 2
        M = q.packed.numel() // (K // 2)
        t = self.targets(M, K, fmt=q.fmt)
        codes = q.codes().reshape(M, K)
        parts = [(t.mantissa, ref.pack_bits(codes & 1)), (t.scales, q.scales.reshape(M, -1)),
                 (t.outer, q.outer.reshape(M).float())]
        if t.codes is not None:
            parts.append((t.codes, q.packed.reshape(M, K // 2)))
        for buf, x in parts:
            buf.index_copy_(0, t.step, x.unsqueeze(0))


@triton.jit
def _load_chunk(x_ptr, rows, rmask, stride_xm, k0, K, NB: tl.constexpr, BLOCK: tl.constexpr):
    # -> [BM, NB, BLOCK] fp32 tile of x and its element offsets within the row
    kk = k0 + tl.arange(0, NB)[None, :, None] * BLOCK + tl.arange(0, BLOCK)[None, None, :]
    mask = rmask[:, None, None] & (kk < K)
    x = tl.load(x_ptr + rows[:, None, None].to(tl.int64) * stride_xm + kk, mask=mask, other=0.0)
    return x.to(tl.float32), kk, mask


@triton.jit
def _store_values(ptr, offs, g, mask, INTERP: tl.constexpr):
    """Store fp32 values g in ptr's dtype (one RNE cast)."""
    tl.store(ptr + offs, round_as(g, ptr, INTERP).to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def nvfp4_row_senc(amax, amax_min):
    """Per-row NVFP4 outer scale S_enc = div_rn(2688, amax) from each row's amax (fp32; amax floored at amax_min so
    that S_enc stays finite), 1 for an all-zero row (DESIGN.md §2)."""
    return tl.where(amax == 0.0, 1.0, tl.math.div_rn(2688.0, tl.maximum(amax, amax_min)))


@triton.jit
def nvfp4_block_scales(xb, s_enc, INTERP: tl.constexpr):
    """xb [BM, NB, 16] fp32 blocks, s_enc [BM] -> (E4M3 scale bytes [BM, NB], their values s_b [BM, NB], the
    scaled values p = x * S_enc [BM, NB, 16] (v = RN(p / s_b) is the element on the E2M1 grid), zero [BM, NB, 1]:
    the blocks whose scale is 0). s_b = E4M3(div_rn(amax_blk * S_enc, 6)), saturating at 448."""
    amax_blk = tl.max(tl.abs(xb), axis=2)  # [BM, NB]
    sb = tl.minimum(tl.math.div_rn(amax_blk * s_enc[:, None], 6.0), 448.0)
    sbyte = e4m3_byte(sb, INTERP)  # [BM, NB] uint8
    s_b = e4m3_value(sbyte)
    p = xb * s_enc[:, None, None]
    return sbyte, s_b, p, s_b[:, :, None] == 0.0


@triton.jit
def nvfp4_rtn_idx(p, s_b, zero, INTERP: tl.constexpr, FMA_RTN: tl.constexpr):
    """E2M1 magnitude index (0..7) of RN(p / s_b), round-to-nearest-even, without the division; a zero-scale
    block's indices 0. FMA_RTN: the compares as saturating FMAs (`e2m1_rtn_idx_fma`), else threshold compares
    (`e2m1_rtn_idx_scaled`): the same indices."""
    if FMA_RTN:  # the compares on the FMA pipe; a zero scale's block gets +inf midpoints (index 0)
        idx = e2m1_rtn_idx_fma(p, tl.where(zero, float("inf"), s_b[:, :, None]), not INTERP)  # |p| inside
    else:
        idx = tl.where(zero, 0, e2m1_rtn_idx_scaled(tl.abs(p), s_b[:, :, None]))
    return idx


@triton.jit
def e2m1_signed_value(idx, sign8):
    """Index 0..7 and its sign bit at bit 3 (sign8: 0 or 8) -> the signed E2M1 value (fp32)."""
    return tl.where(sign8 != 0, -e2m1_grid(idx), e2m1_grid(idx))


@triton.jit
def nvfp4_tile_values(xb, s_enc, INTERP: tl.constexpr, FMA_RTN: tl.constexpr = True):
    """In-register NVFP4 RTN of xb [BM, NB, 16] (fp32 blocks of BM rows whose outer scales are s_enc [BM]) ->
    the tile values q * s_b * 2^-7 [BM, NB, 16] fp32, exact: what `quantize_rows(..., fake_tile=True)` writes for
    the same elements (the same helpers, the same operations), read by the GEMM / MoE tile with
    `fuse_quant` (kernels/NOTES.md, "Fused activation quantize"). Times the row's 2^7 / S_enc they are the
    dequantized values."""
    _, s_b, p, zero = nvfp4_block_scales(xb, s_enc, INTERP)
    idx = nvfp4_rtn_idx(p, s_b, zero, INTERP, FMA_RTN)
    sign8 = (p.to(tl.uint32, bitcast=True) >> 28).to(tl.int32) & tl.where(zero, 0, 8)
    return e2m1_signed_value(idx, sign8) * s_b[:, :, None] * 0.0078125


@triton.jit
def _quant_chunk(xb, kk, mask, rows, drow, rmask, s_enc, k0, K, seed,
                 codes_ptr, scales_ptr, mbits_ptr, fq_ptr, rrow, rec_m_ptr, rec_s_ptr, rec_c_ptr,
                 BM: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr, IS_NV: tl.constexpr,
                 NOCLIP: tl.constexpr, STOCH: tl.constexpr, GUIDE: tl.constexpr, FAKE: tl.constexpr,
                 FAKE_EXACT: tl.constexpr, FAKE_TILE: tl.constexpr, INTERP: tl.constexpr, FMA_RTN: tl.constexpr,
                 REC: tl.constexpr, REC_CODES: tl.constexpr):
    CH: tl.constexpr = NB * BLOCK
    if IS_NV:
        sbyte, s_b, p, zero = nvfp4_block_scales(xb, s_enc, INTERP)  # p: the dividend of v = RN(p / s_b)
        if STOCH:
            v = tl.where(zero, 0.0, tl.math.div_rn(p, s_b[:, :, None]))
        else:
            v = p  # v's sign; the RTN code compares |p| with midpoints * s_b (no division)
        signbit = tl.where(zero, 0, 8)  # [BM, NB, 1]: a zero-scale block's codes are +0 (its index is 0 below)
    else:
        amax_blk = tl.max(tl.abs(xb), axis=2)  # [BM, NB]
        bits = amax_blk.to(tl.int32, bitcast=True)
        expf = (bits >> 23) & 0xFF
        fl = expf - 127
        if NOCLIP:
            e = tl.where((bits & 0x7FFFFF) <= 0x400000, fl - 2, fl - 1)
        else:
            e = fl - 2
        e = tl.where(expf == 0, -127, e)
        e = tl.minimum(tl.maximum(e, -127), 127)
        sbyte = (e + 127).to(tl.uint8)
        inv = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e, exact (field 2..254)
        v = xb * inv[:, :, None]
        s_b = 1.0 / inv  # 2^e, exact
        signbit = 8
    a = tl.abs(v)
    if STOCH:
        a = tl.minimum(a, 6.0)
        lo = tl.minimum(e2m1_floor_idx(a), 6)
        glo = e2m1_grid(lo)
        ghi = e2m1_grid(lo + 1)
        p_up = (a - glo) / (ghi - glo)
        u = tl.rand(seed, rows[:, None, None] * K + kk)
        idx = lo + (u < p_up).to(tl.int32)
    elif IS_NV:
        idx = nvfp4_rtn_idx(v, s_b, zero, INTERP, FMA_RTN)
    elif FMA_RTN:
        idx = e2m1_rtn_idx_fma(v, tl.full([BM, NB, 1], 1.0, tl.float32), not INTERP)  # |v| inside
    else:
        idx = e2m1_rtn_idx(a)
    # [BM, NB, BLOCK] int32 0..15: v's sign bit moved to bit 3, masked per block (no per-element select)
    sign8 = (v.to(tl.uint32, bitcast=True) >> 28).to(tl.int32) & signbit
    code = idx | sign8
    if FAKE:  # dequantized value e2m1 * s_b / S_enc (the product is exact), then one cast
        g = e2m1_signed_value(idx, sign8) * s_b[:, :, None]
        if FAKE_TILE:  # what the MMA tile decodes from the codes: q * s_b * 2^-7, exact (S_enc left to its epilogue)
            g = g * 0.0078125
        elif IS_NV and FAKE_EXACT:  # the reference's formula, a correctly rounded division per element
            g = tl.math.div_rn(g, tl.broadcast_to(s_enc[:, None, None], g.shape))
        elif IS_NV:  # times the row's reciprocal, not a per-element division (that doubled the kernel's time)
            g = g * tl.math.div_rn(1.0, s_enc)[:, None, None]
        _store_values(fq_ptr, drow[:, None, None].to(tl.int64) * K + kk, g, mask, INTERP)
    # scales [BM, NB]
    sk = k0 // BLOCK + tl.arange(0, NB)
    nblk = K // BLOCK
    smask = rmask[:, None] & (sk[None, :] < nblk)
    tl.store(scales_ptr + drow[:, None].to(tl.int64) * nblk + sk[None, :], sbyte, mask=smask)
    # packed codes [BM, CH/2]: element 2i low nibble
    pair = tl.reshape(code, [BM, CH // 2, 2])
    lo_n, hi_n = tl.split(pair)
    byte = (lo_n | (hi_n << 4)).to(tl.uint8)
    pk = k0 // 2 + tl.arange(0, CH // 2)
    cmask = rmask[:, None] & (pk[None, :] < K // 2)
    tl.store(codes_ptr + drow[:, None].to(tl.int64) * (K // 2) + pk[None, :], byte, mask=cmask)
    if REC:  # the record form at the record's row (step * M + row): scale bytes, packed codes if wanted
        tl.store(rec_s_ptr + rrow[:, None] * nblk + sk[None, :], sbyte, mask=smask)
        if REC_CODES:
            tl.store(rec_c_ptr + rrow[:, None] * (K // 2) + pk[None, :], byte, mask=cmask)
    if GUIDE or REC:
        m8 = tl.reshape(code & 1, [BM, CH // 8, 8])
        w = 1 << tl.arange(0, 8)
        mb = tl.sum(m8 * w[None, None, :], axis=2).to(tl.uint8)
        mk = k0 // 8 + tl.arange(0, CH // 8)
        mmask = rmask[:, None] & (mk[None, :] < K // 8)
        if GUIDE:
            tl.store(mbits_ptr + drow[:, None].to(tl.int64) * (K // 8) + mk[None, :], mb, mask=mmask)
        if REC:  # the mantissa bits packed as `kernels.reference.pack_bits` packs them
            tl.store(rec_m_ptr + rrow[:, None] * (K // 8) + mk[None, :], mb, mask=mmask)


@triton.jit
def _quant_rows_kernel(x_ptr, codes_ptr, scales_ptr, outer_ptr, mbits_ptr, dst_ptr, fq_ptr,
                       M, K, stride_xm, seed, amax_min,
                       BM: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr, IS_NV: tl.constexpr,
                       NOCLIP: tl.constexpr, STOCH: tl.constexpr, GUIDE: tl.constexpr, FAKE: tl.constexpr,
                       FAKE_EXACT: tl.constexpr, FAKE_TILE: tl.constexpr, HAS_DST: tl.constexpr, SINGLE: tl.constexpr,
                       CH: tl.constexpr, NCH: tl.constexpr, INTERP: tl.constexpr, GIVEN: tl.constexpr = False,
                       FMA_RTN: tl.constexpr = True, rec_m_ptr=None, rec_s_ptr=None, rec_o_ptr=None, rec_c_ptr=None,
                       step_ptr=None, REC: tl.constexpr = False, REC_CODES: tl.constexpr = False):
    pid = tl.program_id(0)
    rows = pid * BM + tl.arange(0, BM)  # [BM]
    rmask = rows < M
    if HAS_DST:
        drow = tl.load(dst_ptr + rows, mask=rmask, other=0)
    else:
        drow = rows
    rrow = rows.to(tl.int64)
    if REC:  # the record's row of x's row: step-major buffers [steps, M, ...], the step read on the device
        rrow = tl.load(step_ptr).to(tl.int64) * M + rrow
    s_enc = tl.full([BM], 1.0, tl.float32)
    if GIVEN:  # the caller's S_enc per row (a tensor's or an expert's outer scale), read from outer
        s_enc = tl.load(outer_ptr + drow, mask=rmask, other=1.0)
    if SINGLE:
        xb, kk, mask = _load_chunk(x_ptr, rows, rmask, stride_xm, 0, K, NB, BLOCK)
        if IS_NV and not GIVEN:
            amax = tl.max(tl.max(tl.abs(xb), axis=2), axis=1)
            s_enc = nvfp4_row_senc(amax, amax_min)
            tl.store(outer_ptr + drow, s_enc, mask=rmask)
        if REC:
            tl.store(rec_o_ptr + rrow, s_enc, mask=rmask)
        _quant_chunk(xb, kk, mask, rows, drow, rmask, s_enc, 0, K, seed, codes_ptr, scales_ptr, mbits_ptr, fq_ptr,
                     rrow, rec_m_ptr, rec_s_ptr, rec_c_ptr,
                     BM, NB, BLOCK, IS_NV, NOCLIP, STOCH, GUIDE, FAKE, FAKE_EXACT, FAKE_TILE, INTERP, FMA_RTN,
                     REC, REC_CODES)
    else:
        if IS_NV and not GIVEN:
            amax = tl.zeros([BM], tl.float32)
            for c in range(NCH):
                k0 = c * CH
                xb, kk, mask = _load_chunk(x_ptr, rows, rmask, stride_xm, k0, K, NB, BLOCK)
                amax = tl.maximum(amax, tl.max(tl.max(tl.abs(xb), axis=2), axis=1))
            s_enc = nvfp4_row_senc(amax, amax_min)
            tl.store(outer_ptr + drow, s_enc, mask=rmask)
        if REC:
            tl.store(rec_o_ptr + rrow, s_enc, mask=rmask)
        for c in range(NCH):
            k0 = c * CH
            xb, kk, mask = _load_chunk(x_ptr, rows, rmask, stride_xm, k0, K, NB, BLOCK)
            _quant_chunk(xb, kk, mask, rows, drow, rmask, s_enc, k0, K, seed, codes_ptr, scales_ptr, mbits_ptr, fq_ptr,
                         rrow, rec_m_ptr, rec_s_ptr, rec_c_ptr,
                         BM, NB, BLOCK, IS_NV, NOCLIP, STOCH, GUIDE, FAKE, FAKE_EXACT, FAKE_TILE, INTERP, FMA_RTN,
                         REC, REC_CODES)


def _config(M: int, K: int, block: int, interpret: bool = INTERPRET):
    """Tile choice: whole rows in one chunk when K <= 4096 (one read of x), else 2048-wide chunks; a
    few rows (decode) of up to 16384 also go in one chunk, with one warp per 1024 elements, so a
    single long row is not two serial passes of one small program. -> (rows, blocks per chunk,
    single chunk, warps). interpret=False gives the GPU's choice (tests force it in the interpreter,
    whose own choice keeps programs small)."""
    ch = max(block, triton.next_power_of_2(K))
    single = ch <= 4096 or (ch <= 16384 and M <= 64 and not interpret)
    if not single:
        ch = 2048
    nw = max(4, ch // 1024)
    if ch == 2048:
        # 8 warps, not 4: at 2048-wide chunks and 4 warps (16 elements per thread) Triton 3.6 miscompiles the
        # fp32-input kernel on an H200 (the first 1024 columns' codes 0 or saturated, scales exact; 2, 8 and 16
        # warps are exact; kernels/NOTES.md, "Correctness: what holds and what it took")
        nw = 8
    # one row per program on a GPU: with several rows per program and 32 elements per thread, Triton 3.6
    # miscompiled the bf16-input kernel on an H200 (every nonzero code saturated; fp32 input, one row, or
    # 16 elements per thread were exact; kernels/NOTES.md)
    bm = 1 if not interpret else max(1, min(32, 4096 // ch))
    bm = min(bm, triton.next_power_of_2(max(M, 1)))
    return bm, ch // block, single, nw


def quantize_rows(x: torch.Tensor, fmt: str = "nvfp4", rounding: str = "rtn", *, seed: int = 0,
                  guidance: bool = False, mx_rule: str = "floor", out: QuantizedRows | None = None,
                  dst_rows: torch.Tensor | None = None, fake_dtype: torch.dtype | None = None,
                  fake_exact: bool = False, fake_tile: bool = False, check_finite: bool = True,
                  s_enc: torch.Tensor | None = None, fma_rtn: bool = True,
                  record: RecordSink | None = None) -> QuantizedRows:
    """Quantize x [..., K] (fp32/bf16/fp16) per row. Returns QuantizedRows (see class docstring).

    out/dst_rows: write into caller-owned flat buffers (packed [R, K/2], scales [R, K/b], outer [R],
    mantissa [R, K/8] or None) at rows dst_rows [M] (int32/int64) instead of allocating.
    fake_dtype: also write the dequantized rows (QuantizedRows.fake, [..., K]) in this dtype in the same
    pass, so a W4A16 kernel can run W4A4 on them (kernels.gemm / kernels.moe decode path); NVFP4 divides by
    S_enc as the reference does only with fake_exact (bit-identical to `kernels.reference.nvfp4_dequantize`
    cast to fake_dtype, at twice the kernel's time), else multiplies by its reciprocal (within an ulp).
    fake_tile (NVFP4): the fake rows are instead q * s_b * 2^-7, exact in bf16 and fp32, the values the MMA
    tile decodes from the codes (`kernels._common.dequant_tile_words`); times the row's 2^7 / S_enc they are
    the dequantized values.
    s_enc (NVFP4): the outer scale S_enc of each row given, float32 [M] (rows of x flattened), instead of each
    row's own 2688 / amax: a per-tensor or per-expert scale spread over the rows (trace/fp4's weights); the
    returned `outer` holds it.
    fma_rtn ('rtn'; the default): the E2M1 rounding as saturating FMAs (`kernels._common.e2m1_rtn_idx_fma`), the
    same codes as the seven threshold compares (`e2m1_rtn_idx_scaled`, fma_rtn=False) with the work on the FMA pipe
    instead of the ALU pipe (NVFP4 8192x4096 on an H200: 59.0 -> 46.7 us; kernels/NOTES.md, "Quantize").
    record: a RecordSink; the same launch also writes the record form of x's rows (mantissa bits packed, scale
    bytes, S_enc, packed codes if the sink has a buffer for them) at the sink's current step (RecordTargets),
    row r of x (not its dst_rows row) at record row step * M + r."""
    check_tensor(x, "x", (torch.float32, torch.bfloat16, torch.float16), finite=check_finite)
    if fmt not in ("nvfp4", "mxfp4"):
        raise ValueError(f"fmt must be 'nvfp4' or 'mxfp4', got {fmt!r}")
    if rounding not in ("rtn", "stochastic"):
        raise ValueError(f"rounding must be 'rtn' or 'stochastic', got {rounding!r}")
    if mx_rule not in ("floor", "noclip"):
        raise ValueError(f"mx_rule must be 'floor' or 'noclip', got {mx_rule!r}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension")
    block = ref.NVFP4_BLOCK if fmt == "nvfp4" else ref.MXFP4_BLOCK
    K = x.shape[-1]
    if K == 0 or K % block:
        raise ValueError(f"last dimension {K} must be a positive multiple of the {fmt} block size {block}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    dev = x.device
    if out is None:
        if dst_rows is not None:
            raise ValueError("dst_rows needs out= buffers")
        packed = torch.empty((M, K // 2), dtype=torch.uint8, device=dev)
        scales = torch.empty((M, K // block), dtype=torch.uint8, device=dev)
        outer = torch.ones((M,), dtype=torch.float32, device=dev)
        mant = torch.empty((M, K // 8), dtype=torch.uint8, device=dev) if guidance else None
    else:
        packed, scales, outer, mant = out.packed, out.scales, out.outer, out.mantissa
        for name, t, w, dt in (("packed", packed, K // 2, torch.uint8), ("scales", scales, K // block, torch.uint8)):
            if t.dtype != dt or t.shape[-1] != w or not t.is_contiguous():
                raise ValueError(f"out.{name} must be contiguous {dt} with last dim {w}, got {t.dtype} {tuple(t.shape)}")
        if outer.dtype != torch.float32 or not outer.is_contiguous():
            raise ValueError("out.outer must be contiguous float32")
        if guidance and (mant is None or mant.shape[-1] != K // 8):
            raise ValueError("guidance=True needs out.mantissa with last dim K/8")
        rows_avail = packed.numel() // (K // 2)
        if dst_rows is None and rows_avail != M:
            raise ValueError(f"out buffers hold {rows_avail} rows, x has {M}")
        if dst_rows is not None:
            check_tensor(dst_rows, "dst_rows", (torch.int32, torch.int64), dim=1)
            if dst_rows.shape[0] != M:
                raise ValueError(f"dst_rows has {dst_rows.shape[0]} entries, x has {M} rows")
            if scales.numel() // (K // block) != rows_avail or outer.numel() != rows_avail:
                raise ValueError("out buffers disagree on the number of rows")
    if s_enc is not None:
        if fmt != "nvfp4" or out is not None:
            raise ValueError("s_enc is for NVFP4 without out= buffers")
        if s_enc.dtype != torch.float32 or s_enc.numel() != M or s_enc.device != dev:
            raise ValueError(f"s_enc must be float32 with one value per row ({M}) on {dev}")
        outer = s_enc.reshape(M).contiguous()
    if fake_dtype is not None and dst_rows is not None:
        raise ValueError("fake_dtype is not supported with dst_rows")
    if fake_tile and (fmt != "nvfp4" or fake_dtype not in (torch.bfloat16, torch.float32)):
        raise ValueError("fake_tile needs fmt='nvfp4' and fake_dtype bfloat16 or float32")
    fq = torch.empty((M, K), dtype=fake_dtype, device=dev) if fake_dtype is not None else None
    if M == 0:
        return QuantizedRows(packed.reshape(*lead, K // 2), scales.reshape(*lead, K // block),
                             outer.reshape(*lead, 1), None if mant is None else mant.reshape(*lead, K // 8), fmt,
                             None if fq is None else fq.reshape(*lead, K))
    rec = None if record is None else record.targets(M, K, fmt)
    if rec is not None:
        rec_bufs = [rec.mantissa, rec.scales, rec.outer] + ([] if rec.codes is None else [rec.codes])
        widths = [K // 8, K // block, 1, K // 2]
        for b, w in zip(rec_bufs, widths, strict=False):
            if not b.is_contiguous() or b.numel() % (M * w) or b.device != dev:
                raise ValueError(f"record buffers must be contiguous [steps, {M}, ...] on {dev}")
    bm, nb, single, nw = _config(M, K, block)
    grid = (triton.cdiv(M, bm),)
    _quant_rows_kernel[grid](
        x2, packed, scales, outer, mant if guidance else packed, dst_rows if dst_rows is not None else packed,
        fq if fq is not None else x2, M, K, x2.stride(0), int(seed), ref.AMAX_MIN,
        BM=bm, NB=nb, BLOCK=block, IS_NV=fmt == "nvfp4", NOCLIP=mx_rule == "noclip",
        STOCH=rounding == "stochastic", GUIDE=guidance, FAKE=fq is not None, FAKE_EXACT=fake_exact, FAKE_TILE=fake_tile, HAS_DST=dst_rows is not None, SINGLE=single, CH=nb * block, NCH=triton.cdiv(K, nb * block), INTERP=INTERPRET,
        GIVEN=s_enc is not None, FMA_RTN=fma_rtn and rounding == "rtn",
        rec_m_ptr=packed if rec is None else rec.mantissa, rec_s_ptr=packed if rec is None else rec.scales,
        rec_o_ptr=outer if rec is None else rec.outer,
        rec_c_ptr=packed if rec is None or rec.codes is None else rec.codes,
        step_ptr=outer if rec is None else rec.step, REC=rec is not None, REC_CODES=rec is not None and rec.codes is not None,
        num_warps=nw,
    )
    if out is not None:
        return out
    return QuantizedRows(packed.reshape(*lead, K // 2), scales.reshape(*lead, K // block),
                         outer.reshape(*lead, 1), None if mant is None else mant.reshape(*lead, K // 8), fmt,
                         None if fq is None else fq.reshape(*lead, K))


def fake_rows(x: torch.Tensor, on_quant=None) -> torch.Tensor:
    """NVFP4 per-row RTN of x [M, K] dequantized in x.dtype, in one pass: what the W4A16 decode kernels
    read to run W4A4 (their codes and scales are the trainer's). on_quant(QuantizedRows), if given, sees
    the codes; a RecordSink there gets them written by the same launch (quantize_rows(record=...))."""
    sink = on_quant if isinstance(on_quant, RecordSink) else None
    q = quantize_rows(x, "nvfp4", fake_dtype=x.dtype, check_finite=False, record=sink)
    if on_quant is not None and sink is None:
        on_quant(q)
    return q.fake


@triton.jit
def _guided_rows_kernel(x_ptr, m_ptr, s_ptr, o_ptr, codes_ptr, own_ptr, fq_ptr, M, K, stride_xm,
                        BM: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr, IS_NV: tl.constexpr,
                        OWN: tl.constexpr, INTERP: tl.constexpr):
    # program (row block, K chunk): the scales and S_enc are given, so chunks are independent
    CH: tl.constexpr = NB * BLOCK
    rows = tl.program_id(0) * BM + tl.arange(0, BM)  # [BM]
    rmask = rows < M
    k0 = tl.program_id(1) * CH
    xb, kk, mask = _load_chunk(x_ptr, rows, rmask, stride_xm, k0, K, NB, BLOCK)  # [BM, NB, BLOCK] fp32
    sk = k0 // BLOCK + tl.arange(0, NB)
    smask = rmask[:, None] & (sk[None, :] < K // BLOCK)
    sbyte = tl.load(s_ptr + rows[:, None].to(tl.int64) * (K // BLOCK) + sk[None, :], mask=smask, other=0)
    if IS_NV:
        s_enc = tl.load(o_ptr + rows, mask=rmask, other=1.0)
        s_b = e4m3_value(sbyte)[:, :, None]  # [BM, NB, 1]
        zero = s_b == 0.0
        v = tl.where(zero, 0.0, tl.math.div_rn(xb * s_enc[:, None, None], tl.where(zero, 1.0, s_b)))
    else:
        inv = ((254 - sbyte.to(tl.int32)) << 23).to(tl.float32, bitcast=True)[:, :, None]  # 2^-e, exact
        v = xb * inv
        s_b = 1.0 / inv
    off = rows[:, None, None].to(tl.int64) * K + kk
    m = tl.load(m_ptr + off, mask=mask, other=0).to(tl.int32)
    a = tl.abs(v)
    lo = tl.minimum(e2m1_floor_idx(a), 6)
    idx = tl.where((lo & 1) == m, lo, lo + 1)  # the grid neighbour with the recorded mantissa bit
    sign = (v.to(tl.int32, bitcast=True) < 0).to(tl.int32)
    tl.store(codes_ptr + off, (idx | (sign << 3)).to(tl.uint8), mask=mask)
    if OWN:  # this forward's own RTN under the recorded scales (what the alignment term compares)
        tl.store(own_ptr + off, (e2m1_rtn_idx(a) | (sign << 3)).to(tl.uint8), mask=mask)
    g = tl.where(sign == 1, -e2m1_grid(idx), e2m1_grid(idx)) * s_b
    if IS_NV:
        g = tl.math.div_rn(g, tl.broadcast_to(s_enc[:, None, None], g.shape))
    _store_values(fq_ptr, off, g, mask, INTERP)


def guided_rows(x: torch.Tensor, mantissa: torch.Tensor, scales: torch.Tensor, outer: torch.Tensor,
                fmt: str = "nvfp4", *, fake_dtype: torch.dtype, own: bool = False):
    """TRACE's guided rounding of x [..., K] under recorded scale bytes [..., K/block] and (NVFP4) per-row
    S_enc `outer` (broadcastable to [..., 1]), each element taking the grid neighbour whose mantissa bit is
    `mantissa` [..., K] (uint8 0/1), in one pass: -> (codes uint8 [..., K], the RTN codes of x under the same
    scales or None, the dequantized guided values [..., K] in fake_dtype). Bit for bit
    `kernels.reference.e2m1_guided` / `e2m1_encode` of the reference's scaled values and its dequantization
    (tests/fp4/test_kernel_path.py)."""
    check_tensor(x, "x", (torch.float32, torch.bfloat16, torch.float16))
    if fmt not in ("nvfp4", "mxfp4"):
        raise ValueError(f"fmt must be 'nvfp4' or 'mxfp4', got {fmt!r}")
    block = ref.NVFP4_BLOCK if fmt == "nvfp4" else ref.MXFP4_BLOCK
    K = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    m2 = mantissa.reshape(M, K).to(torch.uint8).contiguous()
    s2 = scales.reshape(M, K // block).contiguous()
    o2 = (outer.to(torch.float32).expand(*lead, 1).reshape(M).contiguous() if fmt == "nvfp4" else s2)
    codes = torch.empty((M, K), dtype=torch.uint8, device=x.device)
    own_c = torch.empty((M, K), dtype=torch.uint8, device=x.device) if own else codes
    fq = torch.empty((M, K), dtype=fake_dtype, device=x.device)
    if M:
        bm, nb, _, nw = _config(M, K, block)  # the quantize kernel's tiles (its chunks: the grid's second axis)
        grid = (triton.cdiv(M, bm), triton.cdiv(K, nb * block))
        _guided_rows_kernel[grid](x2, m2, s2, o2, codes, own_c, fq, M, K, x2.stride(0), BM=bm, NB=nb, BLOCK=block,
                                  IS_NV=fmt == "nvfp4", OWN=own, INTERP=INTERPRET, num_warps=nw)
    shape = (*lead, K)
    return codes.reshape(shape), own_c.reshape(shape) if own else None, fq.reshape(shape)
