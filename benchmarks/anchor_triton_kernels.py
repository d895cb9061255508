"""The `triton_kernels` provider of benchmarks/bench_kernels.py: OpenAI's Hopper MoE / dense kernels with
MXFP4 weights (W4A16), timed beside ours and BF16 in the same run.

`triton_kernels` is imported, never copied: install it with
    pip install "triton_kernels @ git+https://github.com/triton-lang/triton.git@v3.6.0#subdirectory=python/triton_kernels"
(the tag must match the installed triton; v3.6.0 for triton 3.6), or put a checkout of that folder on
PYTHONPATH. When the import fails, `load()` returns None and says why once; the benchmark then runs
without this provider.

Its `matmul_ogs` takes weights as [E, K, N] (MoE) or [K, N] (dense) swizzled offline into the Hopper
MXFP4 value/scale layouts; routing comes from its own `topk`, and the MoE layer is two calls (gather +
gate/up with fused SwiGLU, then down with the top-k scatter-sum), as vLLM runs gpt-oss on Hopper.
"""
from __future__ import annotations

import importlib

INSTALL = ('pip install "triton_kernels @ git+https://github.com/triton-lang/triton.git@v3.6.0'
           '#subdirectory=python/triton_kernels"')
_MSG: list[str] = []


def load():
    """-> the imported `triton_kernels` package, or None with a one-line reason (printed once)."""
    try:
        tk = importlib.import_module("triton_kernels")
        for m in ("matmul_ogs", "swiglu", "topk", "numerics", "numerics_details.mxfp", "tensor", "tensor_details.layout"):
            importlib.import_module(f"triton_kernels.{m}")
        return tk
    except Exception as e:  # missing, or built for another triton: either way not timeable here
        msg = (f"triton_kernels provider skipped ({type(e).__name__}: {str(e)[:160]}); install it with {INSTALL}")
        if not _MSG:
            print(msg, flush=True)
        _MSG[:] = [msg]
        return None


def skip_reason() -> str:
    return _MSG[0] if _MSG else ""


def _precision(scale):
    from triton_kernels.matmul_ogs import FlexCtx, PrecisionConfig
    from triton_kernels.numerics import InFlexData
    return PrecisionConfig(weight_scale=scale, flex_ctx=FlexCtx(rhs_data=InFlexData()))


def mxfp4_weight(w, mx_axis: int, num_warps: int):
    """w bf16 [..., K, N] -> (value tensor, scale tensor) in the Hopper layouts, and the dequantized bf16
    weight (for the correctness check); the MX blocks run along K."""
    import torch
    from triton_kernels.numerics_details.mxfp import downcast_to_mxfp, upcast_from_mxfp
    from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
    from triton_kernels.tensor_details import layout
    wq, ws = downcast_to_mxfp(w, torch.uint8, axis=mx_axis)
    deq = upcast_from_mxfp(wq, ws, torch.bfloat16, axis=mx_axis)
    vl, vlo = layout.make_default_matmul_mxfp4_w_layout(mx_axis=mx_axis)
    sl, slo = layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=mx_axis, num_warps=num_warps)
    return (convert_layout(wrap_torch_tensor(wq, dtype=FP4), vl, **vlo), convert_layout(wrap_torch_tensor(ws), sl, **slo),
            deq)


class MoELayer:
    """Routed-expert MLP of one MoE layer: y [T, H] = sum_k w_k * down(silu(gate x) * up x).

    w13: bf16 [E, H, 2I] (gate columns interleaved with up columns, as the fused SwiGLU reads them),
    w2: bf16 [E, I, H]; both quantized to MXFP4 here (`num_warps` picks the scale swizzle). The activation
    is gpt-oss's SwiGLU (g * sigmoid(g) * (u + 1), same cost as silu(g) * u) and the scatter sums the k
    expert outputs unweighted (no gate scaling passed): the cost of the layer, not Qwen's exact function.
    `reference(x, ids)` computes that same function in fp32 from the dequantized weights."""

    def __init__(self, w13, w2, topk: int, num_warps: int = 4):
        import triton_kernels.swiglu
        from triton_kernels.matmul_ogs import FnSpecs, FusedActivation
        self.E, self.k = w13.shape[0], topk
        self.w1, s1, self.deq1 = mxfp4_weight(w13, 1, num_warps)
        self.w2, s2, self.deq2 = mxfp4_weight(w2, 1, num_warps)
        self.p1, self.p2 = _precision(s1), _precision(s2)
        self.act = FusedActivation(FnSpecs("swiglu", triton_kernels.swiglu.swiglu_fn, ("alpha", "limit"),
                                           reduction_n=2), (1.0, 1e9))

    def route(self, logits):
        """logits [T, E] -> (routing state for `__call__`, topk ids int32 [T, k], topk weights fp32 [T, k])."""
        from triton_kernels.matmul_ogs import GatherIndx, RoutingData, ScatterIndx
        from triton_kernels.tensor import make_ragged_tensor_metadata
        from triton_kernels.topk import topk
        sp = topk(logits, self.k)
        disp, comb = sp.mask_metadata.row_sorted_indx, sp.mask_metadata.col_sorted_indx
        rag = make_ragged_tensor_metadata(sp.mask_metadata.col_sum, disp.shape[0])
        state = (RoutingData(None, rag.slice_sizes, self.E, self.k, rag), GatherIndx(comb, disp), ScatterIndx(disp, comb))
        return state, sp.indx.int(), sp.vals.float()

    def __call__(self, x, state):
        from triton_kernels.matmul_ogs import matmul_ogs
        rdata, gi, si = state
        h = matmul_ogs(x, self.w1, None, rdata, gather_indx=gi, precision_config=self.p1, fused_activation=self.act)
        return matmul_ogs(h, self.w2, None, rdata, scatter_indx=si, precision_config=self.p2)

    def reference(self, x, ids):
        """fp32 oracle of `__call__`: x [T, H], ids [T, k] -> [T, H]."""
        y = x.new_zeros(x.shape, dtype=x.new_empty(0).float().dtype)
        for t in range(x.shape[0]):
            for e in ids[t].tolist():
                h = x[t].float() @ self.deq1[e].float()  # [2I]
                g, u = h[0::2], h[1::2]
                y[t] += (g * __import__("torch").sigmoid(g) * (u + 1)) @ self.deq2[e].float()
        return y


class Dense:
    """y [M, N] = x [M, K] @ W [K, N] with W (bf16 [K, N]) quantized to MXFP4 along K."""

    def __init__(self, w_kn, num_warps: int = 4):
        self.w, s, self.deq = mxfp4_weight(w_kn, 0, num_warps)
        self.p = _precision(s)

    def __call__(self, x):
        from triton_kernels.matmul_ogs import matmul_ogs
        return matmul_ogs(x, self.w, None, precision_config=self.p)
