"""Triton fast path of the rollout engine (W4A4 NVFP4 on a GPU): FP4 GEMMs, grouped MoE, FP4-KV decode attention.

What: `TritonPath.build(weights)` re-lays the engine's FP4 weights (the FP4Tensors that
`trace.fp4.quantize_weight` produced at sync) into the kernel layouts of `kernels.gemm.prepare_weight`
and `kernels.moe.prepare_moe_weights`; the engine forward then calls
  - `kernels.gemm.fp4_linear(x, w, act_quant=True)` for q/k/v/o and shared-expert / dense-MLP linears
    (the activation is quantized per row inside, bit-identical to `trace.fp4.quantize(x, "nvfp4", "row")`),
  - `kernels.moe.fused_moe(x, w, topk_ids, topk_weights, act_quant=True)` for the routed experts
    (per-token gate/up input, per-(token, slot) down input),
  - `kernels.attention.kv_store` + `decode_attention` for one-token decode steps with the FP4 KV cache
    (a zero-copy view of the engine's cache buffers).
It is used only when the device is CUDA (or forced for interpreter tests), mode is w4a4, fmt nvfp4, NO
recorder is attached (recording runs the torch reference path, which produces the same codes) and only
for one-token decode steps: prefill is compute-bound, and there the MMA kernels measured slower than BF16
GEMMs on the dequantized weights (same codes). `RolloutEngine(fp4_backend="torch")` or
TRACE_ROLLOUT_BACKEND=torch disables it (=triton forces it on a CPU under TRITON_INTERPRET=1).

Compared against: the engine's torch path (tests/rollout/test_fast.py runs it under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import os

import torch

from trace import fp4

BACKENDS = ("auto", "torch", "triton")


def available(device, dtype=torch.bfloat16, backend: str = "auto") -> bool:
    """Triton path on CUDA by default; on a CPU only when asked for (backend="triton" or
    TRACE_ROLLOUT_BACKEND=triton, with TRITON_INTERPRET=1, for tests). backend="torch" (or the
    environment variable, when backend is "auto") disables it everywhere."""
    if backend not in BACKENDS:
        raise ValueError(f"fp4_backend must be one of {BACKENDS}, got {backend!r}")
    want = backend if backend != "auto" else os.environ.get("TRACE_ROLLOUT_BACKEND", "")
    if want == "torch":
        return False
    if torch.device(device).type != "cuda" and want != "triton":
        return False
    if torch.device(device).type == "cuda" and dtype == torch.float32 and want != "triton":
        return False  # the GPU kernels take bf16/fp16 activations (a float32 run raised ValueError on the H200)
    try:
        import kernels.attention  # noqa: F401
        import kernels.gemm  # noqa: F401
        import kernels.moe  # noqa: F401
    except Exception:  # noqa: BLE001 - kernels missing or broken: use the torch path
        return False
    return True


class TritonPath:
    def __init__(self, dense: list[dict], moe: list):
        self.dense, self.moe = dense, moe

    @staticmethod
    def build(weights) -> "TritonPath":
        from kernels.gemm import prepare_weight
        from kernels.moe import prepare_moe_weights

        dense, moe = [], []
        for i in range(weights.arch.num_layers):
            pre = f"model.layers.{i}."
            d = {}
            for key, suffix in (("q", "self_attn.q_proj.weight"), ("k", "self_attn.k_proj.weight"),
                                ("v", "self_attn.v_proj.weight"), ("o", "self_attn.o_proj.weight"),
                                ("sg", "mlp.shared_expert.gate_proj.weight"), ("su", "mlp.shared_expert.up_proj.weight"),
                                ("sd", "mlp.shared_expert.down_proj.weight"), ("mg", "mlp.gate_proj.weight"),
                                ("mu", "mlp.up_proj.weight"), ("md", "mlp.down_proj.weight")):
                t = weights.fp4.get(pre + suffix)
                if t is not None:
                    d[key] = prepare_weight(t.codes, t.scales, t.outer)
            dense.append(d)
            gu = weights.fp4.get(pre + "mlp.experts.gate_up_proj")
            if gu is None:
                moe.append(None)
                continue
            dn = weights.fp4[pre + "mlp.experts.down_proj"]
            inter = gu.codes.shape[1] // 2
            gate = fp4.FP4Tensor(gu.codes[:, :inter].contiguous(), gu.scales[:, :inter].contiguous(), gu.outer)
            up = fp4.FP4Tensor(gu.codes[:, inter:].contiguous(), gu.scales[:, inter:].contiguous(), gu.outer)
            moe.append(prepare_moe_weights(gate, up, dn))  # gate and up share the per-expert outer scale
        return TritonPath(dense, moe)

    def linear(self, i: int, key: str, x: torch.Tensor, bias=None) -> torch.Tensor:
        """x [N, K] (unquantized) -> W4A4 x @ W^T [N, out] (+ bias)."""
        from kernels.gemm import fp4_linear

        y = fp4_linear(x, self.dense[i][key], act_quant=True, check_finite=False)
        return y if bias is None else y + bias

    def experts(self, i: int, x, topi, topv) -> torch.Tensor:
        from kernels.moe import fused_moe

        return fused_moe(x, self.moe[i], topi, topv, act_quant=True, check_finite=False)

    @staticmethod
    def decode_attention(cache, layer: int, rows, slots, start, q, k, v, max_len: int) -> torch.Tensor:
        """One-token decode with the FP4 KV cache: store k, v [R, 1, Hkv, D] at (rows, slots) and attend
        q [R, 1, Hq, D] over slots 0..start[r] of each row. Returns [R, Hq, D]."""
        from kernels.attention import FP4KVCache, decode_attention, kv_store

        per = cache.cap + 1
        R = q.shape[0]
        r = torch.arange(cache.batch, device=q.device) if rows is None else rows
        views = []
        for j in range(2):
            c, s, o = cache.codes[layer][j], cache.scales[layer][j], cache.outer[layer][j]  # [B, cap+1, Hkv, ..]
            views += [c.view(-1, *c.shape[2:]), s.view(-1, *s.shape[2:]), o.view(-1, o.shape[2])]
        view = FP4KVCache(views[0], views[1], views[2], views[3], views[4], views[5])
        flat_slots = r * per + slots[:, 0]  # [R]
        kv_store(view, k[:, 0], v[:, 0], flat_slots, check_finite=False)
        return decode_attention(q[:, 0], view, r * per, start + 1, max_len, check_finite=False).view(R, *q.shape[2:])
