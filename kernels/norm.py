"""The rollout engine's norms in one launch each: residual add + RMSNorm, and the attention's q/k norm + RoPE.

What: `rms_norm(x [M, N], w [N], eps, residual=None)` is transformers' RMSNorm (float32 statistics, the
normalized row cast back to x's dtype, then weight * it), with the residual add before it fused as vLLM's
`fused_add_rms_norm` does (then it returns (x + residual, norm)). `norm_rope(t [M, Hh, D], cos [M, D],
sin [M, D], w [D] | None, eps)` applies Qwen3's per-head RMSNorm (w given) and then the rotary embedding in the
rotate-half convention (transformers' `apply_rotary_pos_emb`) to one row's heads per program. In torch each norm
is ~8 elementwise / reduction launches and each RoPE ~6 (a `cat` among them): at the engine's batch 256 the
attention spent more time on them and the projections' small GEMMs than in its FP4-KV kernel (kernels/NOTES.md,
"Fused norms, RoPE and routing"). Both engine modes use them on a GPU (`trace/rollout/forward.py`), so the BF16 baseline gains what
the FP4 engine gains.

Numerics: every rounding torch makes is made here in the same place (the residual sum, the normalized row cast to
the dtype, the weight product, each RoPE product and their sum, each rounded to the dtype), so given the same
inverse RMS the results are bit-identical. The inverse RMS itself is a float32 sum in another order than torch's
reduction, times 1/N as torch's mean, and a hardware rsqrt (torch's CUDA rsqrt is also `rsqrtf`): it can differ
in the last float32 bits, so a normed element can differ from torch's by one rounding of the dtype (at most two
ulps after the weight product). Nothing depends on bit-equality with the torch path: the engine records the
activation codes its kernels computed and the K/V codes its cache holds.

Compared against: `trace.rollout.forward.rms_norm` and the torch RoPE in tests/kernels/test_norm.py (interpreter;
GPU where present). Run: `TRITON_INTERPRET=1 python -m pytest tests/kernels/test_norm.py -q`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import INTERPRET, check_tensor, round_as

# Triton rewrites an fp32 op on values widened from fp16 / bf16 and rounded back into the narrow op, and with
# fp fusion on (its default) contracts a multiply and an add into one fma.rn.f16: one rounding where torch makes
# two, so the H200 gave RoPE values an ulp off torch's (sm_90 PTX: 4 fma.rn.f16; without fusion 6 mul.rn.f16 and
# 4 add.rn.f16, each rounded as torch rounds). tests/kernels/test_norm.py checks the PTX offline.
LAUNCH = dict(enable_fp_fusion=False)


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, N, inv_n, eps, RES: tl.constexpr, BLOCK: tl.constexpr,
                     INTERP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    xf = tl.load(x_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32)  # [BLOCK]
    if RES:  # x + residual, rounded to the dtype as torch's add rounds it, is the stream's next value
        xf = round_as(xf + tl.load(r_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32), sum_ptr, INTERP)
        tl.store(sum_ptr + row * N + offs, xf.to(sum_ptr.dtype.element_ty), mask=m)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) * inv_n + eps)  # torch: mean = sum * (1/N), then rsqrt(. + eps)
    y = round_as(xf * inv, out_ptr, INTERP)  # cast back before the weight, as transformers does
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + offs, round_as(w * y, out_ptr, INTERP).to(out_ptr.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x [..., N] and w [N] of one dtype -> w * (x / rms(x)) [..., N]; with residual [..., N] the norm is of
    s = x + residual and (s, norm) is returned."""
    check_tensor(x, "x", (torch.bfloat16, torch.float16, torch.float32))
    check_tensor(w, "w", (x.dtype,), dim=1)
    N = x.shape[-1]
    if w.shape[0] != N:
        raise ValueError(f"w has {w.shape[0]} elements, x rows {N}")
    x2 = x.reshape(-1, N).contiguous()  # [M, N]
    out = torch.empty_like(x2)
    s = r2 = None
    if residual is not None:
        check_tensor(residual, "residual", (x.dtype,))
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
        r2 = residual.reshape(-1, N).contiguous()
        s = torch.empty_like(x2)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, r2 if r2 is not None else x2, w.contiguous(), out,
                                         s if s is not None else out, N, 1.0 / N, float(eps),
                                         RES=residual is not None, BLOCK=triton.next_power_of_2(N),
                                         INTERP=INTERPRET, num_warps=4 if N <= 4096 else 8, **LAUNCH)
    if residual is None:
        return out.view(x.shape)
    return s.view(x.shape), out.view(x.shape)


@triton.jit
def _norm_rope_kernel(t_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, Hh, inv_d, eps, D: tl.constexpr, HB: tl.constexpr,
                      NORM: tl.constexpr, INTERP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = D // 2
    h = tl.arange(0, HB)[:, None]
    d = tl.arange(0, HALF)[None, :]
    m = (h < Hh) & (d < HALF)  # [HB, HALF]
    lo = row * Hh * D + h * D + d  # first halves of the row's heads; the second halves at + HALF
    x1 = tl.load(t_ptr + lo, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(t_ptr + lo + HALF, mask=m, other=0.0).to(tl.float32)
    if NORM:  # per-head RMSNorm over D, as rms_norm above
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) * inv_d + eps)[:, None]  # [HB, 1]
        w1 = tl.load(w_ptr + d).to(tl.float32)  # [1, HALF]
        w2 = tl.load(w_ptr + HALF + d).to(tl.float32)
        x1 = round_as(w1 * round_as(x1 * inv, out_ptr, INTERP), out_ptr, INTERP)
        x2 = round_as(w2 * round_as(x2 * inv, out_ptr, INTERP), out_ptr, INTERP)
    c1 = tl.load(cos_ptr + row * D + d).to(tl.float32)  # [1, HALF]
    c2 = tl.load(cos_ptr + row * D + HALF + d).to(tl.float32)
    s1 = tl.load(sin_ptr + row * D + d).to(tl.float32)
    s2 = tl.load(sin_ptr + row * D + HALF + d).to(tl.float32)
    # t * cos + rotate_half(t) * sin, rotate_half(t) = (-t2, t1): each product rounded to the dtype, then the sum
    y1 = round_as(x1 * c1, out_ptr, INTERP) + round_as(-x2 * s1, out_ptr, INTERP)
    y2 = round_as(x2 * c2, out_ptr, INTERP) + round_as(x1 * s2, out_ptr, INTERP)
    tl.store(out_ptr + lo, round_as(y1, out_ptr, INTERP).to(out_ptr.dtype.element_ty), mask=m)
    tl.store(out_ptr + lo + HALF, round_as(y2, out_ptr, INTERP).to(out_ptr.dtype.element_ty), mask=m)


def norm_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w: torch.Tensor | None = None,
              eps: float = 1e-6) -> torch.Tensor:
    """t [M, Hh, D], cos / sin [M, D], w [D] or None, all of t's dtype -> RoPE(norm_w(t)) [M, Hh, D] (the per-head
    norm only with w). D even."""
    check_tensor(t, "t", (torch.bfloat16, torch.float16, torch.float32), dim=3)
    M, Hh, D = t.shape
    if D % 2 or D & (D - 1):
        raise ValueError(f"head dim {D} must be a power of two")
    for name, c in (("cos", cos), ("sin", sin)):
        check_tensor(c, name, (t.dtype,), dim=2)
        if tuple(c.shape) != (M, D):
            raise ValueError(f"{name} {tuple(c.shape)} must be [{M}, {D}]")
    if w is not None:
        check_tensor(w, "w", (t.dtype,), dim=1)
        if w.shape[0] != D:
            raise ValueError(f"w has {w.shape[0]} elements, head dim {D}")
    t = t.contiguous()
    out = torch.empty_like(t)
    if M:
        _norm_rope_kernel[(M,)](t, w if w is not None else t, cos.contiguous(), sin.contiguous(), out, Hh, 1.0 / D,
                                float(eps), D=D, HB=triton.next_power_of_2(Hh), NORM=w is not None, INTERP=INTERPRET,
                                num_warps=4 if Hh * D <= 4096 else 8, **LAUNCH)
    return out
