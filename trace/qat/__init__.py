"""FP4 QAT of Hugging Face MoE models (in-place patching), the trainer's adapter of trace/guidance."""
from trace.qat.patch import MODES, QATRuntime, patch_model, recording, replay, runtime  # noqa: F401
from trace.qat.pin import pinned_inputs  # noqa: F401
