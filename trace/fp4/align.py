"""The fused TRACE alignment term (kernels/align.py) as the library's entry: the FP4 numerics of kernels/ reach
trace/ through trace.fp4 alone (trace/fp4/__init__.py). The kernel module is imported on first use, so
`trace.fp4` imports without Triton.

    if align_kernel_on(xv):
        terms = alignment_site(xv, scales, outer, own, target, own_scales, target_scales, "nvfp4", 0.1, True)

Its definitions are trace/guidance/align.py's (the oracle): equal item and flip counts, hinge sums within fp32
summation order, gradients bit-equal but at each row's amax element under the scale part
(tests/kernels/test_align_kernel.py, tests/guidance/test_replay.py).
"""
from __future__ import annotations

import torch

from trace.settings import switch


def align_kernel_on(x: torch.Tensor) -> bool:
    """Whether the alignment term of a site whose activations are `x` runs on the fused kernels
    (`alignment_site`): the switch `engine.fp4_align` (trace/settings.py; $TRACE_FP4_ALIGN overrides it) off (default: trace/guidance/align.py's torch ops, recomputed in the
    backward; the fused kernels are not yet timed nor checked on a GPU), auto (CUDA tensors) or on (any device, e.g.
    the CPU interpreter in the tests)."""
    mode = switch("engine.fp4_align")
    return mode == "on" or (mode == "auto" and x.is_cuda)


def alignment_site(xv: torch.Tensor, scales: torch.Tensor, outer: torch.Tensor, own: torch.Tensor,
                   target: torch.Tensor, own_scales: torch.Tensor | None, target_scales: torch.Tensor | None,
                   fmt: str = "nvfp4", margin: float = 0.1, with_scales: bool = True):
    """`kernels.align.alignment_site`: one site's alignment term (`alignment_terms` of the codes, then
    `scale_terms` of the NVFP4 block scales where with_scales) in one forward and one backward kernel pass ->
    (sum, items, flipped) per part, the sums differentiable in xv; no host sync."""
    from kernels.align import alignment_site as kernel

    return kernel(xv, scales, outer, own, target, own_scales, target_scales, fmt, margin, with_scales)


__all__ = ["align_kernel_on", "alignment_site"]
