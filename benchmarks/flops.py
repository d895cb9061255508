"""Model FLOPs of a training forward+backward and the model FLOPs utilization (MFU) of a timed one.

MFU follows PaLM's definition (Chowdhery et al. 2022, Appendix B): the FLOPs the model needs, not what the
implementation happens to run (no recomputation, no padding, no fake quantization counted), over the time and the
device's peak rate. Per trained token of a sequence of T tokens:

    6 * N_active + 12 * L * H * d_head * T

N_active: the parameters of the matrix multiplies a token passes through (attention projections, the router, the
top-k experts' share of the expert weights, shared experts, the LM head; no embedding lookup, norms or biases);
the second term: the attention scores and their weighted sum (QK^T and AV, 2 FLOPs a multiply-add, forward plus
twice that backward, over the whole T as PaLM counts it, not the causal half).

The peak is measured, not quoted: `bf16_gemm_tflops` times a large BF16 matmul on the same device in the same run,
so MFU reads "share of what this card's GEMMs reach here" (H100 SXM data sheet, dense BF16: 989 TFLOP/s).

    from benchmarks.flops import train_flops, bf16_gemm_tflops, mfu
    f = train_flops(model.config, seq_lens)          # seq_lens: the trained sequences' lengths (no padding)
    u = mfu(f, fwd_bwd_s, bf16_gemm_tflops())        # f / fwd_bwd_s / (peak * 1e12); None without a peak
"""
from __future__ import annotations

import statistics
import time

import torch


def _get(config, *names, default=None):
    for n in names:
        v = getattr(config, n, None)
        if v is not None:
            return v
    return default


def active_params(config) -> int:
    """N_active of the module docstring from a Hugging Face MoE config (the four families of trace/models): per
    layer the attention projections (q, k, v, o), the router and the top-k experts' gated MLP (3 matrices each),
    plus a shared expert where the family has one (qwen2_moe: its MLP and its one-output gate), plus the LM head."""
    h = config.hidden_size
    layers = config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, _get(config, "num_key_value_heads", default=config.num_attention_heads)
    hd = _get(config, "head_dim", default=h // heads)
    attn = h * heads * hd * 2 + h * kv_heads * hd * 2  # q and o; k and v
    experts = _get(config, "num_experts", "num_local_experts")
    k = config.num_experts_per_tok
    width = _get(config, "moe_intermediate_size", "intermediate_size")
    mlp = k * 3 * h * width + h * experts  # the top-k experts' gate, up and down; the router
    shared = _get(config, "shared_expert_intermediate_size", default=0)
    if shared:
        mlp += 3 * h * shared + h  # the shared expert and its gate
    return layers * (attn + mlp) + h * config.vocab_size  # the LM head


def attention_flops_per_token(config, seq_len: int) -> int:
    """12 * L * H * d_head * T: the attention scores and their weighted sum of one token, forward and backward."""
    heads = config.num_attention_heads
    hd = _get(config, "head_dim", default=config.hidden_size // heads)
    return 12 * config.num_hidden_layers * heads * hd * seq_len


def train_flops(config, seq_lens) -> float:
    """Model FLOPs of one forward+backward over sequences of the given lengths (tokens each, padding excluded)."""
    n = active_params(config)
    return float(sum(t * (6 * n + attention_flops_per_token(config, t)) for t in seq_lens))


def mfu(flops: float, seconds: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilization: flops / seconds / (peak_tflops * 1e12). None without a peak (off a GPU) or a time."""
    if not peak_tflops or not seconds:
        return None
    return flops / seconds / (peak_tflops * 1e12)


def bf16_gemm_tflops(n: int = 8192, reps: int = 10, device: str = "cuda") -> float | None:
    """The device's BF16 matmul rate in TFLOP/s: the median of `reps` timed n x n x n matmuls after a warm-up
    (2 n^3 FLOPs each). None off a CUDA device."""
    if not (torch.cuda.is_available() and str(device).startswith("cuda")):
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e12
