"""The decode GEMV kernels over the GEMV layout (kernels.gemv.gemv_layout): dense `gemv2` and grouped MoE
`gemv` vs the FP32 oracles on fresh random inputs, odd sizes (padding of K to 256, N not a multiple of
BN, row groups beyond 4, split-K) and the unmasked EVEN path. FP32 FMA kernels: tolerance 1e-5 on the GPU
and in the interpreter alike (tests/kernels/conftest.py); the MMA fallback is held to TOL_MMA."""
import pytest
import torch

from kernels import reference as ref
from kernels.gemm import GemmConfig, fp4_linear, prepare_weight
from kernels.gemv import GV_BITS, gemv_layout
from kernels.moe import MoEConfig, fused_moe, prepare_moe_weights
from tests.kernels.conftest import DEV, TOL, TOL_MMA, bf16_exact, dev, host, rel


def test_layout_bits_roundtrip():
    g = torch.Generator().manual_seed(0)
    N, K = 3, 512
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 127, (N, K // 16), generator=g, dtype=torch.uint8)
    words, sb = host(gemv_layout(*dev(codes, scales)))  # the layout is built on the weights' device
    assert words.shape == (2, N, 8, 4) and sb.shape == (2, N, 8, 4)
    used = set()
    for m, s in GV_BITS:
        bits = {m, m + 1, m + 2, s}
        assert not used & bits
        used |= bits
    assert used == set(range(32))
    w = words.to(torch.int64) & 0xFFFFFFFF
    for gi in range(2):
        for t in range(8):
            for j, (m, s) in enumerate(GV_BITS):
                for wi in range(4):
                    k = gi * 256 + 32 * t + 4 * j + wi
                    c = ((w[gi, :, t, wi] >> m) & 7) | (((w[gi, :, t, wi] >> s) & 1) << 3)
                    assert torch.equal(c.to(torch.uint8), codes[:, k])
            assert torch.equal(sb[gi, :, t, 0], scales[:, gi * 16 + 2 * t])
            assert torch.equal(sb[gi, :, t, 1], scales[:, gi * 16 + 2 * t + 1])


@pytest.mark.parametrize("M,N,K,BN,split,U,pf", [(1, 40, 96, 8, 1, 1, False), (3, 33, 272, 16, 2, 1, False),
                                                 (6, 16, 528, 8, 1, 2, False), (2, 16, 512, 8, 1, 2, False),
                                                 (4, 24, 768, 8, 3, 1, False), (2, 33, 528, 8, 1, 1, True),
                                                 (1, 16, 768, 8, 2, 1, True)])
def test_dense_gemv2(M, N, K, BN, split, U, pf):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    w = torch.randn(N, K, generator=g) * torch.exp(torch.randn(N, 1, generator=g))
    w[:, :16] = 0  # a zero block column
    c, s, o = ref.nvfp4_quantize(w)
    pw = prepare_weight(*dev(c, s, o))
    x = torch.randn(M, K, generator=g) * 10.0 ** torch.randint(-3, 4, (M, 1), generator=g)
    cfg = GemmConfig(kind="gemv2", BN=BN, BM=4, split=split, num_warps=1, num_stages=1, U=U, prefetch=pf)
    y = fp4_linear(dev(x), pw, config=cfg)
    r = ref.fp4_linear(x, c, s, o)
    assert y.shape == (M, N) and rel(y, r) < TOL


def test_dense_default_uses_gemv2_and_requires_layout():
    g = torch.Generator().manual_seed(2)
    c, s, o = ref.nvfp4_quantize(torch.randn(16, 64, generator=g))
    x = bf16_exact(torch.randn(2, 64, generator=g))  # BF16-exact for the MMA fallback (conftest.py)
    r = ref.fp4_linear(x, c, s, o)
    xd = dev(x)
    assert rel(fp4_linear(xd, prepare_weight(*dev(c, s, o))), r) < TOL
    pw = prepare_weight(*dev(c, s, o), gemv=False)
    assert pw.gv_words is None and rel(fp4_linear(xd, pw), r) < TOL_MMA  # falls back to the MMA path
    with pytest.raises(ValueError, match="gemv"):
        fp4_linear(xd, pw, config=GemmConfig(kind="gemv2", BN=8, BM=4, num_warps=1, num_stages=1))


@pytest.mark.parametrize("T,E,H,I,k,BM", [(5, 4, 64, 48, 2, 4), (3, 6, 48, 32, 3, 1), (6, 5, 256, 256, 2, 2)])
def test_moe_gemv(T, E, H, I, k, BM):
    g = torch.Generator().manual_seed(T * 31 + E)
    q = lambda *sh: ref.nvfp4_quantize(torch.randn(*sh, generator=g), outer="expert")  # noqa: E731
    gw, uw, dw = q(E, I, H), q(E, I, H), q(E, H, I)
    mw = prepare_moe_weights(*dev(gw, uw, dw))
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(T)])  # expert E-1 stays empty
    tw = torch.softmax(torch.randn(T, k, generator=g), -1)
    cfg = MoEConfig(BM=BM, BN=8, BN_down=16, num_warps=1, num_stages=1, kind="gemv", U=1)
    y = fused_moe(dev(x), mw, *dev(ids, tw), config=cfg)
    r = ref.moe_fp4_reference(x, gw, uw, dw, ids, tw)
    assert rel(y, r) < TOL


def test_gemv2_never_reads_x_past_k():
    """K % 32 == 16: the last chunk's second 16-block lies past the end of each x row. x sits at
    the start of a NaN-filled buffer, so any unmasked read past its end poisons the output (it
    did, before the fix: the last row came out NaN). The buffer lives on DEV, so on the GPU too the
    bytes past x are NaN, not whatever the allocator left there."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(16, 528, generator=g)
    c, s, o = ref.nvfp4_quantize(w)
    pw = prepare_weight(*dev(c, s, o))
    for m in (1, 5, 6):
        buf = torch.full((m * 528 + 256,), float("nan"), device=DEV)
        x = torch.randn(m, 528, generator=g)
        buf[: m * 528].view(m, 528).copy_(x)
        y = fp4_linear(buf[: m * 528].view(m, 528), pw,
                       config=GemmConfig(kind="gemv2", BN=8, BM=4, split=1, num_warps=1, num_stages=1))
        assert bool(torch.isfinite(y).all()) and rel(y, ref.fp4_linear(x, c, s, o)) < TOL
