"""The Triton row-quantize kernels (kernels/quantize.py) as the library's hot-path entry: per-row FP4
quantization in one pass, for callers that have validated their input themselves (the rollout engine's
activation and KV sites, the trainer's fake quantization where `kernels_on`).

Each function imports the kernel module on first use, so `trace.fp4` imports without Triton (CPU runs that
never take the kernel path). Their codes, scales and outer scales are `trace.fp4.reference`'s bit for bit
(tests/kernels/test_quantize.py, tests/fp4/test_kernel_path.py); the dequantized copies are within an ulp
unless asked for exactly (`fake_exact`).

    q = quantize_rows(x, "nvfp4", fake_dtype=torch.bfloat16)   # QuantizedRows: packed, scales, outer, fake
    y = fake_rows(x, on_quant=seen)                             # NVFP4 RTN of x [M, K], dequantized in x.dtype
    codes, own, vals = guided_rows(x, mantissa, scales, outer, fake_dtype=torch.bfloat16, own=True)
"""
from __future__ import annotations

import torch


def quantize_rows(x: torch.Tensor, fmt: str = "nvfp4", rounding: str = "rtn", **kw):
    """`kernels.quantize.quantize_rows`: x [..., K] quantized per row -> QuantizedRows (its docstring has the
    keywords: fake_dtype, fake_exact, out/dst_rows, s_enc, check_finite, ...)."""
    from kernels.quantize import quantize_rows as kernel

    return kernel(x, fmt, rounding, **kw)


def fake_rows(x: torch.Tensor, on_quant=None) -> torch.Tensor:
    """`kernels.quantize.fake_rows`: NVFP4 per-row RTN of x [M, K] dequantized in x.dtype; on_quant(QuantizedRows),
    if given, sees the codes."""
    from kernels.quantize import fake_rows as kernel

    return kernel(x, on_quant)


def guided_rows(x: torch.Tensor, mantissa: torch.Tensor, scales: torch.Tensor, outer: torch.Tensor,
                fmt: str = "nvfp4", *, fake_dtype: torch.dtype, own: bool = False):
    """`kernels.quantize.guided_rows`: TRACE's guided rounding of x [..., K] under recorded scales in one pass
    -> (codes, the RTN codes under the same scales or None, the dequantized guided values in fake_dtype)."""
    from kernels.quantize import guided_rows as kernel

    return kernel(x, mantissa, scales, outer, fmt, fake_dtype=fake_dtype, own=own)


def record_sink(make):
    """`kernels.quantize.RecordSink(make)`: a record destination the quantize launches write themselves (passed
    where an `on_quant` observer goes); make(M, K, fmt) -> (mantissa [steps, M, K/8], scales [steps, M, K/block],
    outer float32 [steps, M], packed codes [steps, M, K/2] or None, step [1] device tensor)."""
    from kernels.quantize import RecordSink

    return RecordSink(make)


def is_record_sink(obj) -> bool:
    """Whether obj is a `record_sink` (the kernels write it) rather than an observer of QuantizedRows."""
    if obj is None:
        return False
    from kernels.quantize import RecordSink

    return isinstance(obj, RecordSink)


__all__ = ["fake_rows", "guided_rows", "is_record_sink", "quantize_rows", "record_sink"]
