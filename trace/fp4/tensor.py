"""FP4 formats library: NVFP4 / MXFP4 quantization with RTN, stochastic and TRACE-guided rounding.

The numerics are those of `kernels/reference.py` (the single oracle); this module adds the library
boundary (input validation with clear errors), the `FP4Tensor` value type and the straight-through
fake-quant used by QAT. Compared against torchao 0.18 `nvfp4_quantize` in tests/fp4.

    from trace import fp4
    t = fp4.quantize(w, fmt="nvfp4", outer="tensor")      # FP4Tensor: codes, scales, outer
    w_hat = t.dequantize()                                 # float32
    y = fp4.fake_quant(x, outer="row")                     # same dtype as x, STE gradient
    g = fp4.guided_quantize(x, t.mantissa(), t.scales, t.outer)   # TRACE replay
    wq = fp4.fake_quant_weight(w)                          # weights: per tensor / per expert, STE
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kernels import reference as ref
from trace.settings import switch

FORMATS = ("nvfp4", "mxfp4")
ROUNDINGS = ("rtn", "stochastic", "guided")
OUTERS = ("tensor", "row", "expert")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class FP4Tensor:
    """A quantized tensor. `codes` uint8 0..15 with the source shape (unpacked; see `packed()`);
    `scales` raw scale bytes, one per block (E4M3 for NVFP4, E8M0 for MXFP4), shape [..., K/block]
    or [..., N/16, K/16] for 16x16 tiles; `outer` the FP32 encode scale S_enc (NVFP4; shape [] per
    tensor, [..., 1] per row, [E, 1, ..] per expert; all ones for MXFP4)."""

    codes: torch.Tensor
    scales: torch.Tensor
    outer: torch.Tensor
    fmt: str = "nvfp4"
    block_2d: bool = False
    dtype: torch.dtype = torch.float32

    @property
    def block_size(self) -> int:
        return ref.NVFP4_BLOCK if self.fmt == "nvfp4" else ref.MXFP4_BLOCK

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        if self.fmt == "nvfp4":
            x = ref.nvfp4_dequantize(self.codes, self.scales, self.outer, self.block_2d)
        else:
            x = ref.mxfp4_dequantize(self.codes, self.scales)
        return x.to(dtype or self.dtype)

    def to(self, device) -> "FP4Tensor":
        return dataclasses.replace(self, codes=self.codes.to(device), scales=self.scales.to(device),
                                   outer=self.outer.to(device))

    def mantissa(self) -> torch.Tensor:
        """The mantissa bit of every code (uint8 0/1), what TRACE records."""
        return self.codes & 1

    def packed(self) -> torch.Tensor:
        return ref.pack_fp4(self.codes)

    def nbytes(self) -> int:
        """Storage bytes: packed codes + scale bytes + FP32 outer scales."""
        return self.codes.numel() // 2 + self.scales.numel() + 4 * self.outer.numel()


@dataclass(frozen=True)
class GuidedResult:
    """Output of `guided_quantize`. `unrecoverable` marks elements whose guided code differs from
    `ref_codes`; it is None when no reference codes were given, because the compact record
    (mantissa + scales) alone cannot tell a wrong pick from a right one."""

    tensor: FP4Tensor
    unrecoverable: torch.Tensor | None


# ----------------------------------------------------------------------------------------------
# Validation at the library boundary
# ----------------------------------------------------------------------------------------------
def check_finite(x: torch.Tensor, name: str = "input") -> None:
    """Raise ValueError saying how many values are non-finite and where the first one is."""
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        n_nan = int(torch.isnan(x).sum())
        n_inf = int(bad.sum()) - n_nan
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name} has {int(bad.sum())} non-finite values (NaN: {n_nan}, inf: {n_inf}) "
            f"of {x.numel()}; first at index {first}"
        )


def _check_input(x: torch.Tensor, fmt: str, block_2d: bool = False, outer="tensor", values: bool = True) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"FP4 quantization takes float32/bfloat16/float16 input, got {x.dtype}; cast explicitly")
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if isinstance(outer, torch.Tensor):
        if outer.dtype != torch.float32:
            raise TypeError(f"a given outer scale must be float32 (S_enc), got {outer.dtype}")
        try:
            torch.broadcast_shapes(outer.shape, x.shape)
        except RuntimeError as e:
            raise ValueError(f"outer of shape {tuple(outer.shape)} does not broadcast to {tuple(x.shape)}") from e
        check_finite(outer, "outer scale")
        if bool((outer <= 0).any()):
            raise ValueError("a given outer scale S_enc must be positive")
    elif outer not in OUTERS:
        raise ValueError(f"outer must be one of {OUTERS} or a float32 S_enc tensor, got {outer!r}")
    if x.dim() == 0:
        raise ValueError("cannot quantize a 0-d tensor: blocks run along the last dimension")
    block = ref.NVFP4_BLOCK if fmt == "nvfp4" else ref.MXFP4_BLOCK
    if x.shape[-1] % block:
        raise ValueError(
            f"last dimension {x.shape[-1]} is not a multiple of the {fmt} block size {block}; pad it first"
        )
    if block_2d:
        if fmt != "nvfp4":
            raise ValueError("16x16 weight blocks are an NVFP4 option only")
        if x.dim() < 2 or x.shape[-2] % 16:
            raise ValueError(f"16x16 blocks need the second-to-last dimension to be a multiple of 16, got {tuple(x.shape)}")
        if isinstance(outer, str) and outer == "row":
            raise ValueError("16x16 blocks need a per-tensor or per-expert outer scale, not per-row")
    if isinstance(outer, str) and outer == "expert" and x.dim() < 2:
        raise ValueError("outer='expert' needs a leading expert dimension")
    if values:
        check_finite(x)


def _make_generator(generator, seed, device) -> torch.Generator | None:
    if generator is not None:
        return generator
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(int(seed))
    return g


# ----------------------------------------------------------------------------------------------
# The Triton kernel (kernels/quantize.py) for RTN on a GPU
# ----------------------------------------------------------------------------------------------
def kernels_on(x: torch.Tensor) -> bool:
    """Whether RTN of `x` runs on the Triton quantize kernel: the switch `engine.fp4_kernels` (trace/settings.py;
    $TRACE_FP4_KERNELS overrides it) off (default: the reference ops), auto (CUDA tensors) or on (any device, e.g.
    the CPU interpreter in the tests). The kernel's codes,
    scales, outer scales and dequantized values are the reference's bit for bit in the tests
    (tests/fp4/test_kernel_path.py, tests/kernels/test_quantize.py); it is one pass over x where the reference
    is ~60 tensor ops per call. It is not the default because it made no train step faster
    (results/trainer/trainer_step.csv). The tile choice avoids a Triton miscompile of the kernel's fp32 tile at
    1024 < K <= 2048 (kernels/NOTES.md, "Correctness: what holds and what it took")."""
    mode = switch("engine.fp4_kernels")
    return mode == "on" or (mode == "auto" and x.is_cuda)


def _kernel_rtn(x: torch.Tensor, fmt: str, outer: str, mx_rule: str,
                fake_dtype: torch.dtype | None = None, codes: bool = True):
    """RTN of x [..., K] on the kernel -> (FP4Tensor or None without `codes`, dequantized values in
    fake_dtype or None). x's values are not checked here (its callers check them, `_check_input`).
    Per-tensor and per-expert NVFP4 outer scales are the reference's (its amax and S_enc ops), handed to the
    kernel row by row."""
    from trace.fp4.rows import quantize_rows

    s_rows = s = None
    if fmt == "nvfp4" and outer != "row":
        s = ref.nvfp4_outer_scale(ref.outer_amax(x, outer))  # [] or [E, 1, ..., 1]
        rows = x.numel() // x.shape[-1]
        s_rows = s.reshape(-1, 1).expand(s.numel(), rows // s.numel()).reshape(rows)
    q = quantize_rows(x, fmt, mx_rule=mx_rule, fake_dtype=fake_dtype, fake_exact=fake_dtype is not None,
                      check_finite=False, s_enc=s_rows)
    t = None
    if codes:
        if fmt == "nvfp4":
            s_enc = q.outer if s is None else s  # [..., 1] per row, as the reference's
        else:
            s_enc = torch.ones((), device=x.device)
        t = FP4Tensor(ref.unpack_fp4(q.packed), q.scales, s_enc, fmt, False, x.dtype)
    return t, q.fake


def _kernel_ok(x, rounding, outer, block_2d) -> bool:
    return rounding == "rtn" and not block_2d and isinstance(outer, str) and x.numel() > 0 and kernels_on(x)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def quantize(
    x: torch.Tensor,
    fmt: str = "nvfp4",
    outer: str | torch.Tensor = "tensor",
    rounding: str = "rtn",
    *,
    block_2d: bool = False,
    mx_rule: str = "floor",
    seed: int | None = None,
    generator: torch.Generator | None = None,
    check_values: bool = True,
) -> FP4Tensor:
    """Quantize `x` [..., K] along its last dimension.

    fmt: 'nvfp4' (16-element blocks, E4M3 scales, FP32 outer scale) or 'mxfp4' (32, E8M0).
    outer (NVFP4): 'tensor', 'row' (per token: batch-invariant), 'expert' (leading dim), or a
    float32 tensor holding a given S_enc (broadcastable to x), e.g. a calibrated or recorded scale.
    rounding: 'rtn' or 'stochastic' (seeded by `seed` or `generator`). For 'guided' use
    `guided_quantize`. block_2d: 16x16 weight tiles (NVFP4). mx_rule: 'floor' (OCP) or 'noclip'.
    check_values=False skips the finiteness check of x (a wait for the device on a GPU) for a hot-path
    caller that checks its outputs instead (the QAT trainer checks its logits and loss every step).
    """
    if rounding not in ("rtn", "stochastic"):
        raise ValueError(f"rounding must be 'rtn' or 'stochastic' here (guided: use guided_quantize), got {rounding!r}")
    _check_input(x, fmt, block_2d, outer, values=check_values)
    if _kernel_ok(x, rounding, outer, block_2d):
        return _kernel_rtn(x, fmt, outer, mx_rule)[0]
    gen = _make_generator(generator, seed, x.device)
    xf = x.float()
    if fmt == "nvfp4":
        given = outer if isinstance(outer, torch.Tensor) else None
        codes, sb, s_enc = ref.nvfp4_quantize(xf, "tensor" if given is not None else outer, rounding,
                                              block_2d, gen, s_enc=given)
    else:
        codes, sb = ref.mxfp4_quantize(xf, rounding, mx_rule, gen)
        s_enc = torch.ones((), device=x.device)
    return FP4Tensor(codes, sb, s_enc, fmt, block_2d, x.dtype)


def dequantize(t: FP4Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return t.dequantize(dtype)


def _check_record(x, mantissa, scales, outer, fmt, block_2d, values: bool = True):
    if mantissa.dtype != torch.uint8 or mantissa.shape != x.shape:
        raise ValueError(f"mantissa must be uint8 0/1 bits of shape {tuple(x.shape)}, got {mantissa.dtype} {tuple(mantissa.shape)}")
    if values and bool((mantissa > 1).any()):
        raise ValueError("mantissa bits must be 0 or 1 (unpack packed bits first with unpack_bits)")
    block = ref.NVFP4_BLOCK if fmt == "nvfp4" else ref.MXFP4_BLOCK
    if block_2d:
        want = (*x.shape[:-2], x.shape[-2] // 16, x.shape[-1] // 16)
    else:
        want = (*x.shape[:-1], x.shape[-1] // block)
    if scales.dtype != torch.uint8 or tuple(scales.shape) != want:
        raise ValueError(f"scales must be uint8 of shape {want}, got {scales.dtype} {tuple(scales.shape)}")
    if not isinstance(outer, torch.Tensor) or outer.dtype != torch.float32:
        raise ValueError("outer must be a float32 tensor (the encode scale S_enc)")
    try:
        torch.broadcast_shapes(outer.shape, x.shape)
    except RuntimeError as e:
        raise ValueError(f"outer of shape {tuple(outer.shape)} does not broadcast to {tuple(x.shape)}") from e


def scaled_values(x: torch.Tensor, scales: torch.Tensor, outer: torch.Tensor, fmt: str = "nvfp4", *,
                  block_2d: bool = False) -> torch.Tensor:
    """x in units of the E2M1 grid under GIVEN block scales (and outer scale for NVFP4): the value
    whose rounding to the grid is the FP4 code. Differentiable in x; no validation (callers pass
    scales a quantizer produced)."""
    return ref.nvfp4_scaled(x, scales, outer, block_2d) if fmt == "nvfp4" else ref.mxfp4_scaled(x, scales)


def rtn_codes_under(x: torch.Tensor, scales: torch.Tensor, outer: torch.Tensor, fmt: str = "nvfp4") -> torch.Tensor:
    """RTN codes of x [..., K] (1x16 blocks) under GIVEN block scales and outer scale: the codes x would take
    under a recorded quantization's scales (what TRACE's alignment term compares with the recorded codes)."""
    return ref.e2m1_encode(scaled_values(x, scales, outer, fmt))


def guided_quantize(
    x: torch.Tensor,
    mantissa: torch.Tensor,
    scales: torch.Tensor,
    outer: torch.Tensor,
    fmt: str = "nvfp4",
    *,
    block_2d: bool = False,
    ref_codes: torch.Tensor | None = None,
    check_values: bool = True,
) -> GuidedResult:
    """TRACE guided rounding (DESIGN.md §3): quantize `x` with the RECORDED block scales and outer
    scale, choosing between the two grid points around each element by its recorded mantissa bit.
    Reproduces the recorded code whenever x lies within one grid step of it. With `ref_codes`
    (the full recorded codes, available in tests and the full-codes ablation) the result reports
    which elements differ. check_values=False skips the checks that read values (x finite, bits 0/1),
    each a wait for the device on a GPU, for a caller that has just checked x and unpacked the bits
    itself (the replay runtime); dtypes and shapes are checked always."""
    _check_input(x, fmt, block_2d, "tensor", values=check_values)
    _check_record(x, mantissa, scales, outer, fmt, block_2d, values=check_values)
    v = scaled_values(x.float(), scales, outer, fmt, block_2d=block_2d)
    codes = ref.e2m1_guided(v, mantissa)
    t = FP4Tensor(codes, scales, outer, fmt, block_2d, x.dtype)
    unrec = None
    if ref_codes is not None:
        if ref_codes.shape != x.shape:
            raise ValueError(f"ref_codes shape {tuple(ref_codes.shape)} != input shape {tuple(x.shape)}")
        # -0 and +0 dequantize identically; compare magnitude for zero codes
        unrec = (codes != ref_codes) & ~(((codes & 7) == 0) & ((ref_codes & 7) == 0))
    return GuidedResult(t, unrec)


def guided_dequantize(x: torch.Tensor, mantissa: torch.Tensor, scales: torch.Tensor, outer: torch.Tensor,
                      fmt: str = "nvfp4", *, dtype: torch.dtype, rtn_codes: bool = False):
    """`guided_quantize` of x [..., K] (1x16 blocks, values unchecked: the replay runtime's hot path) with its
    values dequantized in `dtype` and, with rtn_codes, the RTN codes of x under the same recorded scales (what
    the alignment term compares). One kernel pass where `kernels_on(x)`, the reference ops elsewhere, bit for
    bit alike. -> (GuidedResult without ref codes, dequantized values, RTN codes or None)."""
    _check_input(x, fmt, False, "tensor", values=False)
    _check_record(x, mantissa, scales, outer, fmt, False, values=False)
    if kernels_on(x) and x.numel() > 0:
        from trace.fp4.rows import guided_rows

        codes, own, vals = guided_rows(x, mantissa, scales, outer, fmt, fake_dtype=dtype, own=rtn_codes)
        return GuidedResult(FP4Tensor(codes, scales, outer, fmt, False, x.dtype), None), vals, own
    res = guided_quantize(x, mantissa, scales, outer, fmt, check_values=False)
    own = rtn_codes_under(x, scales, outer, fmt) if rtn_codes else None
    return res, res.tensor.dequantize(dtype), own


class _STE(torch.autograd.Function):
    """Forward returns the quantized value exactly; backward passes the gradient unchanged
    (straight-through). Dynamic scaling keeps every element inside the representable range, so
    an identity STE is the clipped STE here (torchao's NVFP4 QAT does the same)."""

    @staticmethod
    def forward(ctx, x, xq):
        return xq

    @staticmethod
    def backward(ctx, g):
        return g, None


def straight_through(x: torch.Tensor, xq: torch.Tensor) -> torch.Tensor:
    """xq in the forward, the identity gradient to x in the backward."""
    return _STE.apply(x, xq)


def quantize_weight(w: torch.Tensor, fmt: str = "nvfp4", check_values: bool = True) -> FP4Tensor:
    """FP4 weight in [out, in] (or [E, out, in]) orientation, blocks along `in`; outer scale per
    tensor, per expert for 3-D expert weights (DESIGN.md §2). The trainer's fake quant and the
    rollout engine's weights both come from this function, so their codes are identical."""
    return quantize(w.detach(), fmt, "expert" if w.dim() == 3 else "tensor", check_values=check_values)


def fake_quant_weight(w: torch.Tensor, fmt: str = "nvfp4", check_values: bool = True) -> torch.Tensor:
    """`quantize_weight` dequantized in w's dtype, with a straight-through gradient to w."""
    return fake_quant(w, fmt, "expert" if w.dim() == 3 else "tensor", check_values=check_values)


@dataclass(frozen=True)
class Guide:
    """A guided site's record for one tensor: mantissa bits (uint8 0/1, x's shape), scale bytes
    and outer scales, as stored by the rollout."""

    mantissa: torch.Tensor
    scales: torch.Tensor
    outer: torch.Tensor


def fake_quant(
    x: torch.Tensor,
    fmt: str = "nvfp4",
    outer: str | torch.Tensor = "row",
    rounding: str = "rtn",
    *,
    block_2d: bool = False,
    mx_rule: str = "floor",
    guide: Guide | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    check_values: bool = True,
) -> torch.Tensor:
    """Quantize-dequantize `x` in its own dtype with a straight-through gradient. rounding='guided'
    requires `guide`. Default outer='row' (activations: batch-invariant). check_values: as in quantize."""
    if rounding == "guided":
        if guide is None:
            raise ValueError("rounding='guided' needs guide=Guide(mantissa, scales, outer)")
        q = guided_quantize(x.detach(), guide.mantissa, guide.scales, guide.outer, fmt, block_2d=block_2d,
                            check_values=check_values).tensor
    elif _kernel_ok(x, rounding, outer, block_2d):
        _check_input(x, fmt, block_2d, outer, values=check_values)
        return _STE.apply(x, _kernel_rtn(x.detach(), fmt, outer, mx_rule, x.dtype, codes=False)[1])
    else:
        q = quantize(x.detach(), fmt, outer, rounding, block_2d=block_2d, mx_rule=mx_rule, seed=seed,
                     generator=generator, check_values=check_values)
    return _STE.apply(x, q.dequantize(x.dtype))


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Unpacked codes [..., K] (uint8 0..15) -> [..., K/2] bytes, element 2i in the low nibble."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise ValueError(f"last dimension must be even to pack two codes per byte, got {codes.shape[-1]}")
    if bool((codes > 15).any()):
        raise ValueError("codes must be in 0..15")
    return ref.pack_fp4(codes)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed codes must be uint8, got {packed.dtype}")
    return ref.unpack_fp4(packed)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """0/1 values [..., K] (K multiple of 8) -> [..., K/8] bytes, element 8i+j in bit j."""
    if bits.shape[-1] % 8:
        raise ValueError(f"last dimension must be a multiple of 8 to pack bits, got {bits.shape[-1]}")
    return ref.pack_bits(bits)


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed bits must be uint8, got {packed.dtype}")
    return ref.unpack_bits(packed)
