"""FP4 KV-cache store (bit-exact to the reference quantizer, per token and head) and split-K decode
attention (GQA, variable lengths incl. 0) vs kernels.reference.decode_attention_reference over the
dequantized cache. Interpreter tolerance 1e-5 (FP32); the GPU benchmark checks 2e-2 (BF16 P)."""
import pytest
import torch

from kernels import reference as ref
from kernels.attention import FP4KVCache, decode_attention, kv_store


@pytest.mark.parametrize("splits", [1, 3])
def test_store_and_decode(splits):
    torch.manual_seed(splits)
    B, Hq, Hkv, D, L = 3, 8, 2, 32, 40
    lens = torch.tensor([40, 0, 17])
    starts = torch.tensor([0, 40, 80])
    cache = FP4KVCache.allocate(B * L, Hkv, D, "cpu")
    k = torch.randn(B * L, Hkv, D) * 4
    v = torch.randn(B * L, Hkv, D)
    perm = torch.randperm(B * L)
    kv_store(cache, k[perm], v[perm], perm)  # scattered slots
    c, s, o = ref.nvfp4_quantize(k, outer="row")
    assert torch.equal(cache.k_packed, ref.pack_fp4(c)) and torch.equal(cache.k_scales, s)
    assert torch.equal(cache.k_outer, o.squeeze(-1))
    q = torch.randn(B, Hq, D)
    out = decode_attention(q, cache, starts, lens, L, num_splits=splits)
    kh = ref.kv_dequantize(cache.k_packed, cache.k_scales, cache.k_outer).view(B, L, Hkv, D)
    vh = ref.kv_dequantize(cache.v_packed, cache.v_scales, cache.v_outer).view(B, L, Hkv, D)
    r = ref.decode_attention_reference(q, kh, vh, lens)
    assert float((out - r).norm() / r.norm()) < 1e-5
    assert float(out[1].abs().max()) == 0.0  # empty sequence


def test_errors():
    cache = FP4KVCache.allocate(8, 2, 32, "cpu")
    with pytest.raises(ValueError, match="non-finite"):
        kv_store(cache, torch.full((1, 2, 32), float("nan")), torch.zeros(1, 2, 32), torch.tensor([0]))
    with pytest.raises(ValueError):
        kv_store(cache, torch.zeros(1, 3, 32), torch.zeros(1, 3, 32), torch.tensor([0]))
    with pytest.raises(ValueError, match="slots"):
        kv_store(cache, torch.ones(1, 2, 32), torch.ones(1, 2, 32), torch.tensor([8]))
    q = torch.randn(1, 4, 32)
    with pytest.raises(ValueError):
        decode_attention(torch.randn(1, 3, 32), cache, torch.tensor([0]), torch.tensor([4]), 4)
    with pytest.raises(ValueError):
        decode_attention(q, cache, torch.tensor([0]), torch.tensor([9]), 8)
    with pytest.raises(TypeError):
        decode_attention(q, cache, torch.tensor([0.0]), torch.tensor([4]), 4)
