"""The TRACE alignment term of one site in two Triton kernels (forward, backward): the capped hinge of the
codes part and, for NVFP4, of the block-scale part (DESIGN.md §3), read straight from a site's operands.

Inputs, rows of K elements (any leading shape, flattened to M rows):
    x            [M, K] the trainer's activations (fp32 or bf16; the term is differentiable in x)
    scales       [M, K/B] the RECORDED block scales (E4M3 bytes for NVFP4, B = 16; E8M0 for MXFP4, B = 32)
    outer        [M] fp32 the recorded per-row outer scale S_enc (NVFP4; unused for MXFP4)
    own, target  [M, K] uint8 FP4 codes: the trainer's RTN under the recorded scales, the rollout's
    own_scales, target_scales [M, K/16] E4M3 bytes (the scale part: the trainer's RTN scales, the rollout's)

Forward (`alignment_site`): per row, one pass over the codes (a second read of x first, for the row amax, where
the scale part is on): the hinge sums and flip counts of both parts, and three numbers per row that the
backward needs of the scale part (the row amax, the number of blocks reaching it, and the sum over blocks of
the row amax's share of the gradient per unit of upstream gradient). Backward: one pass that recomputes each
element's and block's hinge from the same inputs and writes d(term)/dx in x's dtype. Nothing of size
O(elements) is saved beyond the inputs themselves.

The definitions are trace/guidance/align.py's (`alignment_terms`, `scale_terms`), the oracle; every operation
of its forward and of torch's autograd backward of it is made in the same order on the same fp32 values, so
flip counts are equal, each item's hinge and each element's gradient are bit-equal, except:
- the hinge sums, summed in another order (per row in the kernel, then over rows);
- the gradient reaching the row-amax element of a row through the row amax (a sum over the row's blocks,
  in another order and multiplied by the upstream gradient after the sum instead of before).
For bf16 x the two parts' gradients are rounded to bf16 each and then added and rounded again, as autograd
accumulates them (tests/kernels/test_align_kernel.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import INTERPRET, e2m1_grid, e4m3_value, round_as

E4M3_MAX = 448.0
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
CAP = 1.0  # trace/guidance/align.py's CAP (asserted equal by tests/kernels/test_align_kernel.py)
_R_MIN = 1e-30  # scale_terms' clamp of the row amax
# torch's fp32 division is correctly rounded and its products and sums are never contracted into FMAs; Triton's
# `/` on a GPU is an approximate division (div.full.f32) and its compiler fuses a*b + c into one FMA by default.
# So every division here is div_rn and every launch turns FP fusion off: the oracle's operations, bit for bit.
LAUNCH = dict(enable_fp_fusion=False)


@triton.jit
def _div(a, b):
    return tl.math.div_rn(a, b)


@triton.jit
def _block_div(sb, NV: tl.constexpr):
    """Recorded scale bytes [NB] -> (the divisor of x per block [NB, 1], zero-scale mask [NB, 1])."""
    if NV:
        s = e4m3_value(sb.to(tl.uint8))
        zero = s == 0.0
        return tl.where(zero, 1.0, s)[:, None], zero[:, None]
    else:  # E8M0: 2^(b - 127); 0 -> 2^-127 (subnormal), 255 -> NaN
        b = sb.to(tl.int32)
        s = tl.where(b == 0, tl.full(b.shape, 0x400000, tl.int32), b << 23).to(tl.float32, bitcast=True)
        s = tl.where(b == 255, float("nan"), s)
        return s[:, None], (b < 0)[:, None]


@triton.jit
def _codes_part(x, sdiv, zero, s_enc, own, tgt, valid, margin, NV: tl.constexpr):
    """The codes part of a tile x [NB, B] (fp32): (v, up, flipped, gap, d, r); the hinge is r^2 where flipped."""
    if NV:
        v = _div(x * s_enc, sdiv)
        v = tl.where(zero, 0.0, v)
    else:
        v = _div(x, sdiv)
    a = tl.abs(v)
    om = own.to(tl.int32) & 7
    tm = tgt.to(tl.int32) & 7
    flipped = (om != tm) & valid
    up = tm > om
    nb = tl.minimum(tl.maximum(tl.where(up, tm - 1, tm + 1), 0), 7)
    nb = tl.where(flipped, nb, tl.where(tm == 7, tm - 1, tm + 1))
    gt = e2m1_grid(tm)
    gn = e2m1_grid(nb)
    edge = _div(gt + gn, 2.0)
    gap = tl.abs(gt - gn)
    d = _div(tl.where(up, a - edge, edge - a), gap)
    r = tl.maximum(margin - tl.maximum(d, -1.0), 0.0)
    return v, up, flipped, gap, d, r


@triton.jit
def _scales_part(ax, R, ob, tb, bvalid, margin):
    """The scale part of a tile's |x| [NB, 16] under the row amax R (clamped): (amax per block, u, up,
    flipped, gap, d, r) per block [NB]."""
    A = tl.max(ax, axis=1)
    u = _div(448.0 * A, R)
    ob = ob.to(tl.int32)
    tb = tb.to(tl.int32)
    fl = (ob != tb) & bvalid
    up = tb > ob
    nb = tl.where(up, tb - 1, tb + 1)
    nb = tl.where(fl, nb, tl.where(tb > 0, tb - 1, tb + 1))
    vt = e4m3_value(tb.to(tl.uint8))
    vn = e4m3_value(nb.to(tl.uint8))
    edge = _div(vt + vn, 2.0)
    gap = tl.where(fl, tl.abs(vt - vn), 1.0)
    d = _div(tl.where(up, u - edge, edge - u), gap)
    r = tl.maximum(margin - tl.maximum(d, -1.0), 0.0)
    return A, u, up, fl, gap, d, r


@triton.jit
def _chunk_codes(x_ptr, s_ptr, own_ptr, tgt_ptr, row, c, K, KB, bo, eo, s_enc, margin, NV: tl.constexpr,
                 NB: tl.constexpr, B: tl.constexpr):
    """Chunk c of a row, loaded and run through the codes part (the forward's and the backward's shared start):
    (block ids [NB], their validity, the element offsets and validity [NB, B], x [NB, B] fp32, the block divisors, zero-scale mask, then `_codes_part`'s)."""
    k0 = c * NB * B
    blk = k0 // B + bo
    bvalid = blk < KB
    offs = k0 + bo[:, None] * B + eo[None, :]
    valid = offs < K
    x = tl.load(x_ptr + row * K + offs, mask=valid, other=0.0).to(tl.float32)
    sdiv, zero = _block_div(tl.load(s_ptr + row * KB + blk, mask=bvalid, other=0), NV)
    own = tl.load(own_ptr + row * K + offs, mask=valid, other=0)
    tgt = tl.load(tgt_ptr + row * K + offs, mask=valid, other=0)
    v, up, flipped, gap, d, r = _codes_part(x, sdiv, zero, s_enc, own, tgt, valid, margin, NV)
    return blk, bvalid, offs, valid, x, sdiv, zero, v, up, flipped, gap, d, r


@triton.jit
def _hinge_grad(gout, up, act, gap, r):
    """d(hinge)/d(the unrounded value), in the order torch's autograd takes it: pow, relu, rsub, clamp, div,
    where(up)."""
    g5 = _div(-(gout * (2.0 * r)), gap)
    return tl.where(act, tl.where(up, g5, -g5), 0.0)


@triton.jit
def _row_amax(x_ptr, row, K, NB: tl.constexpr, B: tl.constexpr, NCH: tl.constexpr):
    bo = tl.arange(0, NB)
    eo = tl.arange(0, B)
    m = tl.zeros([NB], tl.float32)
    for c in range(NCH):
        k0 = c * NB * B
        offs = k0 + bo[:, None] * B + eo[None, :]
        x = tl.load(x_ptr + row * K + offs, mask=offs < K, other=0.0).to(tl.float32)
        m = tl.maximum(m, tl.max(tl.abs(x), axis=1))
    return tl.max(m, axis=0)


@triton.jit
def _fwd_kernel(x_ptr, s_ptr, o_ptr, own_ptr, tgt_ptr, os_ptr, ts_ptr,
                hc_ptr, fc_ptr, hs_ptr, fs_ptr, rr_ptr, p_ptr, cr_ptr, K, margin,
                NV: tl.constexpr, SCALES: tl.constexpr, NB: tl.constexpr, B: tl.constexpr, NCH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    KB = K // B
    bo = tl.arange(0, NB)
    eo = tl.arange(0, B)
    s_enc = 1.0
    if NV:
        s_enc = tl.load(o_ptr + row)
    hc = tl.zeros([NB], tl.float32)
    fc = tl.zeros([NB], tl.int32)
    hs = tl.zeros([NB], tl.float32)
    fs = tl.zeros([NB], tl.int32)
    pp = tl.zeros([NB], tl.float32)
    cr = tl.zeros([NB], tl.int32)
    R_raw = 0.0
    R = 1.0
    if SCALES:
        R_raw = _row_amax(x_ptr, row, K, NB, B, NCH)
        R = tl.maximum(R_raw, 1e-30)
    for c in range(NCH):
        blk, bvalid, offs, valid, x, sdiv, zero, v, up, flipped, gap, d, r = _chunk_codes(
            x_ptr, s_ptr, own_ptr, tgt_ptr, row, c, K, KB, bo, eo, s_enc, margin, NV, NB, B)
        hc += tl.sum(tl.where(flipped, r * r, 0.0), axis=1)
        fc += tl.sum(flipped.to(tl.int32), axis=1)
        if SCALES:
            ob = tl.load(os_ptr + row * KB + blk, mask=bvalid, other=0)
            tb = tl.load(ts_ptr + row * KB + blk, mask=bvalid, other=0)
            A, u, sup, sfl, sgap, sd, sr = _scales_part(tl.abs(x), R, ob, tb, bvalid, margin)
            hs += tl.where(sfl, sr * sr, 0.0)
            fs += sfl.to(tl.int32)
            gu = _hinge_grad(1.0, sup, sfl & (sr > 0.0) & (sd >= -1.0), sgap, sr)
            pp += -gu * _div(u, R)  # the row amax's share per unit upstream gradient (torch's div backward)
            cr += ((A == R_raw) & bvalid).to(tl.int32)
    tl.store(hc_ptr + row, tl.sum(hc, axis=0))
    tl.store(fc_ptr + row, tl.sum(fc, axis=0))
    if SCALES:
        tl.store(hs_ptr + row, tl.sum(hs, axis=0))
        tl.store(fs_ptr + row, tl.sum(fs, axis=0))
        tl.store(rr_ptr + row, R_raw)
        tl.store(p_ptr + row, tl.sum(pp, axis=0))
        tl.store(cr_ptr + row, tl.sum(cr, axis=0))


@triton.jit
def _bwd_kernel(x_ptr, s_ptr, o_ptr, own_ptr, tgt_ptr, os_ptr, ts_ptr, rr_ptr, p_ptr, cr_ptr, gc_ptr, gs_ptr,
                gx_ptr, K, margin, NV: tl.constexpr, SCALES: tl.constexpr, NB: tl.constexpr, B: tl.constexpr,
                NCH: tl.constexpr, INTERP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    KB = K // B
    bo = tl.arange(0, NB)
    eo = tl.arange(0, B)
    s_enc = 1.0
    if NV:
        s_enc = tl.load(o_ptr + row)
    gout_c = tl.load(gc_ptr)
    R_raw = 0.0
    R = 1.0
    g_row = 0.0  # the gradient reaching each block at the row amax through it (after clamp and amax backward)
    if SCALES:
        gout_s = tl.load(gs_ptr)
        R_raw = tl.load(rr_ptr + row)
        R = tl.maximum(R_raw, 1e-30)
        g_row = tl.where(R_raw >= 1e-30, _div(gout_s * tl.load(p_ptr + row), tl.load(cr_ptr + row).to(tl.float32)), 0.0)
    for c in range(NCH):
        blk, bvalid, offs, valid, x, sdiv, zero, v, up, flipped, gap, d, r = _chunk_codes(
            x_ptr, s_ptr, own_ptr, tgt_ptr, row, c, K, KB, bo, eo, s_enc, margin, NV, NB, B)
        ga = _hinge_grad(gout_c, up, flipped & (r > 0.0) & (d >= -1.0), gap, r)
        gv = ga * tl.where(v > 0.0, 1.0, tl.where(v < 0.0, -1.0, 0.0))  # abs backward: grad * sgn(v)
        if NV:
            g = _div(tl.where(zero, 0.0, gv), sdiv) * s_enc
        else:
            g = _div(gv, sdiv)
        if SCALES:
            ax = tl.abs(x)
            ob = tl.load(os_ptr + row * KB + blk, mask=bvalid, other=0)
            tb = tl.load(ts_ptr + row * KB + blk, mask=bvalid, other=0)
            A, u, sup, sfl, sgap, sd, sr = _scales_part(ax, R, ob, tb, bvalid, margin)
            gu = _hinge_grad(gout_s, sup, sfl & (sr > 0.0) & (sd >= -1.0), sgap, sr)
            gA = _div(gu, R) * 448.0 + tl.where(A == R_raw, g_row, 0.0)
            at = (ax == A[:, None]) & valid  # amax backward: shared evenly by the elements reaching it
            cnt = tl.sum(at.to(tl.int32), axis=1).to(tl.float32)
            gs = tl.where(at, _div(gA, tl.maximum(cnt, 1.0))[:, None], 0.0)
            gs = gs * tl.where(x > 0.0, 1.0, tl.where(x < 0.0, -1.0, 0.0))
            g = round_as(round_as(g, gx_ptr, INTERP) + round_as(gs, gx_ptr, INTERP), gx_ptr, INTERP)
        else:
            g = round_as(g, gx_ptr, INTERP)
        tl.store(gx_ptr + row * K + offs, g.to(gx_ptr.dtype.element_ty), mask=valid)


def _nb(K: int, B: int) -> int:
    """Blocks per chunk: a power of two, at most 256 elements a chunk in the interpreter (small tiles, several
    chunks a row in the tests) and 512 on a GPU."""
    cap = (256 if INTERPRET else 512) // B
    return max(1, min(cap, triton.next_power_of_2(max(1, K // B))))


def _rows(x, scales, outer, own, target, own_scales, target_scales, fmt, with_scales):
    K = x.shape[-1]
    B = NVFP4_BLOCK if fmt == "nvfp4" else MXFP4_BLOCK
    if K % B:
        raise ValueError(f"the last dim ({K}) must be a multiple of the block ({B})")
    M = x.numel() // K
    flat = lambda t, n: t.reshape(M, n).contiguous()  # noqa: E731
    args = [flat(x, K), flat(scales, K // B),
            flat(outer.float().expand(*x.shape[:-1], 1), 1) if fmt == "nvfp4" else x.new_empty(1, dtype=torch.float32),
            flat(own, K), flat(target, K)]
    if with_scales:
        args += [flat(own_scales, K // NVFP4_BLOCK), flat(target_scales, K // NVFP4_BLOCK)]
    else:
        args += [args[1], args[1]]  # unread
    return args, M, K, B


class _AlignmentSite(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scales, outer, own, target, own_scales, target_scales, fmt, margin, with_scales):
        args, M, K, B = _rows(x, scales, outer, own, target, own_scales, target_scales, fmt, with_scales)
        dev = x.device
        hc = torch.empty(M, dtype=torch.float32, device=dev)
        fc = torch.empty(M, dtype=torch.int32, device=dev)
        n = M if with_scales else 1
        hs, rr, p = (torch.zeros(n, dtype=torch.float32, device=dev) for _ in range(3))
        fs, cr = (torch.zeros(n, dtype=torch.int32, device=dev) for _ in range(2))
        nv, nb = fmt == "nvfp4", _nb(K, B)
        if M:
            _fwd_kernel[(M,)](*args, hc, fc, hs, fs, rr, p, cr, K, float(margin),
                              NV=nv, SCALES=with_scales, NB=nb, B=B, NCH=triton.cdiv(K, nb * B), num_warps=4, **LAUNCH)
        # per-row numbers of the scale part, O(rows): the backward's row amax and its gradient share
        ctx.save_for_backward(*args, rr, p, cr)
        ctx.meta = (x.shape, x.dtype, nv, with_scales, float(margin), M, K, B, nb)
        out = (hc.sum(), fc.sum(dtype=torch.int64))
        if with_scales:
            out += (hs.sum(), fs.sum(dtype=torch.int64))
        ctx.mark_non_differentiable(*out[1::2])
        return out

    @staticmethod
    def backward(ctx, g_codes, _fc, g_scales=None, _fs=None):
        shape, dtype, nv, with_scales, margin, M, K, B, nb = ctx.meta
        x, scales, outer, own, target, own_scales, target_scales, rr, p, cr = ctx.saved_tensors
        dev = x.device
        zero = torch.zeros((), dtype=torch.float32, device=dev)
        gc = zero if g_codes is None else g_codes.float().reshape(())
        gs = zero if g_scales is None else g_scales.float().reshape(())
        gx = torch.empty(M, K, dtype=dtype, device=dev)
        if M:
            _bwd_kernel[(M,)](x, scales, outer, own, target, own_scales, target_scales, rr, p, cr, gc, gs, gx, K,
                              margin, NV=nv, SCALES=with_scales, NB=nb, B=B,
                              NCH=triton.cdiv(K, nb * B), INTERP=INTERPRET, num_warps=4, **LAUNCH)
        return gx.reshape(shape), None, None, None, None, None, None, None, None, None


def alignment_site(x: torch.Tensor, scales: torch.Tensor, outer: torch.Tensor, own: torch.Tensor,
                   target: torch.Tensor, own_scales: torch.Tensor | None, target_scales: torch.Tensor | None,
                   fmt: str = "nvfp4", margin: float = 0.1, with_scales: bool = True):
    """One site's alignment term: (codes hinge sum, items, flipped) and, where with_scales (NVFP4 only), the
    block scales' (hinge sum, items, flipped); each sum a 0-d fp32 tensor differentiable in x, items Python
    ints, flipped 0-d int64 tensors. No host sync. x [..., K]; scales / own_scales / target_scales [..., K/B];
    outer [..., 1] (NVFP4); own / target [..., K] uint8 codes (see the module docstring)."""
    if fmt not in ("nvfp4", "mxfp4"):
        raise ValueError(f"fmt must be nvfp4 or mxfp4, got {fmt!r}")
    if with_scales and fmt != "nvfp4":
        raise ValueError("the block-scale part is NVFP4's (E4M3 scales)")
    out = _AlignmentSite.apply(x, scales, outer, own, target, own_scales, target_scales, fmt, margin,
                               bool(with_scales))
    res = (out[0], own.numel(), out[1])
    if with_scales:
        res += (out[2], own_scales.numel(), out[3])
    return res


__all__ = ["alignment_site"]
