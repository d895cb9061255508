"""The rollout engine's path above its kernels' crossover as benchmarks/bench_kernels.py times it (the
quantize kernel's dequantized activations into BF16 GEMMs on the dequantized weights; the MoE through the
engine's own `routed_experts`) against the FP32 oracle, in float32 on the CPU (the quantize kernel under
TRITON_INTERPRET=1): they time the right thing. Measured: relative error 2.5e-7 (MoE), the dequantized copy's 1/S_enc multiply being the only difference."""
import torch

from benchmarks.bench_kernels import w4a4_bf16_linear, w4a4_bf16_moe
from kernels import reference as ref


def _relerr(a, b):
    return float((a - b).norm() / b.norm())


def test_moe_on_bf16_gemms_is_the_w4a4_oracle():
    g = torch.Generator().manual_seed(0)
    E, H, I, T, k = 4, 64, 32, 5, 2
    nv = lambda *s: ref.nvfp4_quantize(0.1 * torch.randn(*s, generator=g), outer="tensor")  # noqa: E731
    gate, up, down = nv(E, I, H), nv(E, I, H), nv(E, H, I)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int()
    tw = torch.rand(T, k, generator=g)
    w13 = torch.cat([ref.nvfp4_dequantize(*gate), ref.nvfp4_dequantize(*up)], 1)
    y = w4a4_bf16_moe(x, ids, tw, w13, ref.nvfp4_dequantize(*down))
    assert _relerr(y, ref.moe_fp4_reference(x, gate, up, down, ids, tw, act_quant=True)) < 1e-5


def test_linear_on_bf16_gemms_is_the_w4a4_oracle():
    g = torch.Generator().manual_seed(1)
    c, s, o = ref.nvfp4_quantize(0.1 * torch.randn(48, 64, generator=g), outer="tensor")
    x = torch.randn(3, 64, generator=g)
    y = w4a4_bf16_linear(x, ref.nvfp4_dequantize(c, s, o))
    assert _relerr(y, ref.fp4_linear(x, c, s, o, act_quant=True)) < 1e-5
