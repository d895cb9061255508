"""The quantize kernel's record output (kernels/quantize.py: quantize_rows(record=RecordSink)): the launch writes
the record form of its rows (mantissa bits packed as `reference.pack_bits(codes & 1)`, scale bytes, S_enc, codes
packed as `pack_fp4`) at row `step * M + r` of step-major buffers, the step read from a device tensor; the other
rows of the buffers are untouched, and the observer fallback (`RecordSink.__call__`) writes the same bytes.
Inputs and buffers live on DEV (the GPU where one is visible; the kernels refuse CPU tensors there)."""
import pytest
import torch

from kernels import reference as ref
from kernels.attention import FP4KVCache, kv_store
from kernels.gemm import quantize_act_for_gemm
from kernels.quantize import RecordSink, fake_rows, quantize_rows
from tests.kernels.conftest import DEV

STEPS = 3


def _sink(M, K, codes=True, block=16):
    u8 = dict(dtype=torch.uint8, device=DEV)
    bufs = [torch.full((STEPS, M, K // 8), 7, **u8), torch.full((STEPS, M, K // block), 7, **u8),
            torch.full((STEPS, M), 7.0, device=DEV), torch.full((STEPS, M, K // 2), 7, **u8) if codes else None,
            torch.tensor([1], device=DEV)]
    return RecordSink(lambda m, k, fmt: tuple(bufs)), bufs


def _check(bufs, q_packed, q_scales, q_outer, step=1):
    mant, scales, outer, codes, _ = (None if b is None else b.cpu() for b in bufs)
    q_packed, q_scales, q_outer = q_packed.cpu(), q_scales.cpu(), q_outer.cpu()
    c = ref.unpack_fp4(q_packed)
    assert torch.equal(mant[step], ref.pack_bits(c & 1))
    assert torch.equal(scales[step], q_scales) and torch.equal(outer[step], q_outer.reshape(-1).float())
    if codes is not None:
        assert torch.equal(codes[step], q_packed)
    for other in (0, 2):  # the other steps' rows untouched
        assert bool((mant[other] == 7).all()) and bool((outer[other] == 7.0).all())


@pytest.mark.parametrize("M,K", [(5, 64), (3, 4096 + 512)])  # one chunk, and rows of several chunks
@pytest.mark.parametrize("codes", [True, False])
def test_record_rows_are_the_reference_record(M, K, codes):
    x = torch.randn(M, K) * torch.exp(torch.randn(M, 1))
    sink, bufs = _sink(M, K, codes)
    q = quantize_rows(x.to(DEV), "nvfp4", record=sink)
    c, s, o = ref.nvfp4_quantize(x, outer="row")
    assert torch.equal(q.codes().cpu(), c)
    _check(bufs, ref.pack_fp4(c), s, o)
    eager, ebufs = _sink(M, K, codes)
    eager(q)  # the observer fallback: torch ops, the same bytes
    for a, b in zip(bufs[:4], ebufs[:4], strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def test_record_of_the_gemm_and_fake_rows_quantize():
    x = torch.randn(4, 128)
    xd = x.to(DEV)
    for run in (lambda s: quantize_act_for_gemm(xd, on_quant=s), lambda s: fake_rows(xd, on_quant=s)):
        sink, bufs = _sink(4, 128)
        run(sink)
        c, s, o = ref.nvfp4_quantize(x, outer="row")
        _check(bufs, ref.pack_fp4(c), s, o)


def test_kv_store_records_its_source_rows():
    T, H, D = 3, 2, 32
    cache = FP4KVCache.allocate(16, H, D, DEV)
    k, v = torch.randn(T, H, D), torch.randn(T, H, D)
    (ks, kb), (vs, vb) = _sink(T * H, D), _sink(T * H, D)
    kv_store(cache, k.to(DEV), v.to(DEV), torch.tensor([9, 2, 14], device=DEV), record=(ks, vs))
    for x, bufs in ((k, kb), (v, vb)):
        c, s, o = ref.nvfp4_quantize(x.reshape(T * H, D), outer="row")
        _check(bufs, ref.pack_fp4(c), s, o)
