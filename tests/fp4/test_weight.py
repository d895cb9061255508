"""The one weight quantizer (trace.fp4.quantize_weight) and its straight-through fake quant:
per-tensor outer scale for 2-D weights, per-expert for 3-D expert weights, codes equal to the oracle's,
gradient passed unchanged to the master weight."""
import pytest
import torch

from kernels import reference as ref
from trace import fp4
from trace.models import build_model


@pytest.mark.parametrize("name", ["qwen3_moe-tiny", "mixtral-tiny"])
def test_expert_weight_codes_are_per_expert_oracle_codes(name):
    w = build_model(name, seed=0).model.layers[0].mlp.experts.gate_up_proj
    t = fp4.quantize_weight(w)
    assert t.outer.shape == (w.shape[0], 1, 1)  # per expert
    for e in range(w.shape[0]):
        c, s, _ = ref.nvfp4_quantize(w[e].detach(), "tensor")
        assert torch.equal(t.codes[e], c) and torch.equal(t.scales[e], s)


def test_fake_quant_weight_is_the_dequantized_codes_with_identity_gradient():
    w = torch.randn(32, 64, requires_grad=True)
    y = fp4.fake_quant_weight(w)
    assert y.dtype == w.dtype
    assert torch.equal(y.detach(), fp4.quantize_weight(w).dequantize(w.dtype))
    assert fp4.quantize_weight(w).outer.dim() == 0  # per tensor
    g = torch.randn_like(w)
    y.backward(g)
    assert torch.equal(w.grad, g)
