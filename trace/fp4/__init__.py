"""FP4 formats (NVFP4, MXFP4), rounding modes and fake quantization. See trace/fp4/tensor.py."""
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
    guided_quantize,
    pack,
    pack_bits,
    quantize,
    unpack,
    unpack_bits,
)
