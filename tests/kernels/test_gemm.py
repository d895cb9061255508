"""Triton FP4 dense GEMM (MMA and GEMV paths, split-K, W4A4) vs kernels.reference.fp4_linear.
Tolerance: rel. Frobenius error 1e-5 under the interpreter (FP32 dots over exactly dequantized
operands: only accumulation order differs); the GPU benchmark checks 1e-2 with BF16 outputs."""
import pytest
import torch

from kernels import reference as ref
from kernels.gemm import GemmConfig, fp4_linear, prepare_weight

TOL = 1e-5


def _w(N, K, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g)
    w[:, :16] = 0  # a zero block column
    return ref.nvfp4_quantize(w)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("M,N,K", [(1, 40, 96), (17, 33, 256), (5, 64, 48)])
@pytest.mark.parametrize("act_quant", [False, True])
def test_mma_path(M, N, K, act_quant):
    c, s, o = _w(N, K, M + N + K)
    pw = prepare_weight(c, s, o)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(K))
    cfg = GemmConfig(BN=16, BM=16, BKW=4, split=2 if K >= 128 else 1, num_warps=1, num_stages=1)  # MMA explicitly
    y = fp4_linear(x, pw, act_quant=act_quant, config=cfg)
    r = ref.fp4_linear(x, c, s, o, act_quant=act_quant)
    assert y.shape == (M, N) and _rel(y, r) < TOL
    y = fp4_linear(x, pw, act_quant=act_quant)  # default (v1 GEMV for W4A16 at M <= 16)
    assert y.shape == (M, N) and _rel(y, r) < TOL


@pytest.mark.parametrize("split", [1, 3])
def test_gemv_path_and_split(split):
    M, N, K = 2, 37, 272
    c, s, o = _w(N, K, 1)
    pw = prepare_weight(c, s, o)
    x = torch.randn(M, K)
    cfg = GemmConfig(kind="gemv", BN=16, BKW=4, split=split, num_warps=1, num_stages=1)
    assert _rel(fp4_linear(x, pw, config=cfg), ref.fp4_linear(x, c, s, o)) < TOL


def test_w4a4_equals_dequant_then_gemm():
    M, N, K = 4, 32, 128
    c, s, o = _w(N, K, 2)
    pw = prepare_weight(c, s, o)
    x = torch.randn(M, K) * 3
    xq = ref.fake_quantize_rows(x)
    y = fp4_linear(x, pw, act_quant=True)
    assert _rel(y, xq @ ref.nvfp4_dequantize(c, s, o).T) < TOL


def test_errors():
    c, s, o = _w(16, 32, 3)
    pw = prepare_weight(c, s, o)
    with pytest.raises(ValueError, match="non-finite"):
        fp4_linear(torch.full((1, 32), float("nan")), pw)
    with pytest.raises(ValueError, match="K="):
        fp4_linear(torch.ones(1, 48), pw)
    with pytest.raises(TypeError):
        fp4_linear(torch.ones(1, 32, dtype=torch.int64), pw)
    with pytest.raises(ValueError):
        prepare_weight(c, s[:, :1], o)
    with pytest.raises(ValueError):
        prepare_weight(c[:, :24], s, o)
    assert fp4_linear(torch.ones(0, 32), pw).shape == (0, 16)
