"""FP4 formats (NVFP4, MXFP4), rounding modes and fake quantization: the library's one entry to the FP4
numerics of kernels/. See trace/fp4/tensor.py.

kernels/ is standalone (it imports nothing of trace/); `kernels/reference.py` is the normative definition of
every FP4 number (DESIGN.md §2). Inside trace/ the rule is:

- Formats, the E2M1 / E4M3 tables, packing, quantization and fake quantization are reached through
  `trace.fp4` only, never by importing `kernels.reference` or `kernels.quantize`:
    - the validated API (`quantize`, `fake_quant`, `guided_quantize`, `quantize_weight`, `pack`, ...);
    - the tables (`E2M1_GRID`, `E4M3_MAX`, `NVFP4_BLOCK`, `MXFP4_BLOCK`);
    - `trace.fp4.reference`, the reference module itself, for hot paths that validated their inputs once
      (record packing, the KV cache) and for checks of kernels against the oracle;
    - `trace.fp4.rows`, the Triton row-quantize kernels (imported on first use);
    - `trace.fp4.align`, the fused TRACE alignment term of a site (`kernels.align`, imported on first use).
- The rollout engine's compute kernels (`kernels.gemm`, `kernels.moe`, `kernels.attention`,
  `kernels.attention_mma`, `kernels.norm`, `kernels.routing`, `kernels.sampling`) are launched by the engine
  (trace/rollout) alone: fast.py (the Triton path and its self-test), forward.py (fused norms and routing),
  engine.py (fused sampling).
- No other module of trace/ imports kernels/. tests/test_layers.py enforces both.
"""
from kernels import reference  # noqa: F401
from kernels.reference import E2M1_GRID, E4M3_MAX, MXFP4_BLOCK, NVFP4_BLOCK  # noqa: F401
from trace.fp4 import rows  # noqa: F401
from trace.fp4.tensor import (  # noqa: F401
    FORMATS,
    OUTERS,
    ROUNDINGS,
    FP4Tensor,
    Guide,
    GuidedResult,
    check_finite,
    dequantize,
    fake_quant,
    fake_quant_weight,
    guided_dequantize,
    guided_quantize,
    kernels_on,
    pack,
    pack_bits,
    quantize,
    quantize_weight,
    rtn_codes_under,
    scaled_values,
    straight_through,
    unpack,
    unpack_bits,
)
