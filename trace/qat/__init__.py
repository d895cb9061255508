"""FP4 QAT of Hugging Face MoE models (in-place patching). See trace/qat/patch.py."""
from trace.qat.patch import (  # noqa: F401
    MODES,
    QATRuntime,
    ReplayStats,
    fake_quant_weight,
    guided_layer_indices,
    patch_model,
    quantize_weight,
    recording,
    replay,
)
