"""The engine's fused norms (kernels/norm.py) against the torch formulas they replace (trace/rollout/forward.py):
the residual sum and the RoPE bit-identical (the same roundings in the same places), the normed values within the
bound the inverse RMS's last-bit freedom allows (two roundings of the dtype, then the RoPE's own three). Fresh
random inputs at the engine's shapes and at odd ones. Runs on a GPU, or on the CPU under the interpreter."""
import pytest
import torch

from kernels.norm import LAUNCH, norm_rope, rms_norm
from tests.kernels.conftest import DEV, compile_sm90
from trace.rollout.forward import rms_norm as torch_rms_norm
from trace.rollout.forward import rope, rotate_half

DTYPES = [torch.bfloat16, torch.float16]


def _gen():
    return torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))


def _rope_inputs(M, D, dtype, g):
    """cos / sin [M, D] as the engine builds them: cat(freqs, freqs) of positions times inverse frequencies."""
    inv = 1.0 / (1e6 ** (torch.arange(0, D, 2).float() / D))
    pos = torch.randint(0, 40000, (M,), generator=g).float()
    emb = torch.cat([pos[:, None] * inv] * 2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _within(got, want, scale, dtype, ulps):
    """|got - want| <= ulps * eps(dtype) * scale elementwise (scale: the magnitudes the roundings act on)."""
    err = (got.float() - want.float()).abs()
    return bool((err <= ulps * torch.finfo(dtype).eps * scale.float() + torch.finfo(dtype).tiny).all())


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
@pytest.mark.parametrize("shape", [(5, 2048), (3, 4, 96), (1, 4096), (0, 64)])
def test_rms_norm_is_transformers_within_two_roundings(dtype, shape):
    g = _gen()
    x = (torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g) * 8).to(dtype)
    w = (1 + torch.randn(shape[-1], generator=g) * 0.3).to(dtype)
    got = rms_norm(x.to(DEV), w.to(DEV), 1e-6).cpu()
    want = torch_rms_norm(x, w, 1e-6)
    assert got.shape == want.shape and got.dtype == dtype
    # the normed row x * inv rounds to the dtype (one ulp apart at most), the weight product rounds once more
    assert _within(got, want, want.abs(), dtype, 3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_sum_is_torch_add_bit_for_bit_and_normed(dtype):
    g = _gen()
    x, r = (torch.randn(7, 1000, generator=g) * 3).to(dtype), (torch.randn(7, 1000, generator=g)).to(dtype)
    w = (1 + torch.randn(1000, generator=g) * 0.3).to(dtype)
    s, y = rms_norm(x.to(DEV), w.to(DEV), 1e-5, residual=r.to(DEV))
    assert torch.equal(s.cpu(), x + r)
    want = torch_rms_norm(x + r, w, 1e-5)
    assert _within(y.cpu(), want, want.abs(), dtype, 3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,Hh,D", [(6, 32, 128), (5, 4, 128), (3, 3, 64), (0, 4, 128)])
def test_rope_alone_is_torch_bit_for_bit(dtype, M, Hh, D):
    """No norm: the same products and sum, each rounded to the dtype as torch's ops round them."""
    g = _gen()
    t = (torch.randn(M, Hh, D, generator=g) * 4).to(dtype)
    c, s = _rope_inputs(M, D, dtype, g)
    got = norm_rope(t.to(DEV), c.to(DEV), s.to(DEV)).cpu()
    assert torch.equal(got, rope(t, c, s))


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
@pytest.mark.parametrize("M,Hh,D", [(6, 32, 128), (5, 4, 128), (3, 3, 64)])
def test_per_head_norm_then_rope_is_qwen3s_within_the_roundings(dtype, M, Hh, D):
    g = _gen()
    t = (torch.randn(M, Hh, D, generator=g) * torch.rand(M, Hh, 1, generator=g) * 10).to(dtype)
    w = (1 + torch.randn(D, generator=g) * 0.3).to(dtype)
    c, s = _rope_inputs(M, D, dtype, g)
    got = norm_rope(t.to(DEV), c.to(DEV), s.to(DEV), w.to(DEV), 1e-6).cpu()
    n = torch_rms_norm(t, w, 1e-6)
    want = rope(n, c, s)
    # two roundings of each normed input (the inverse RMS's last bits), then the RoPE's two products and its sum
    scale = (n * c[:, None]).abs() + (rotate_half(n) * s[:, None]).abs()
    assert _within(got, want, scale + want.abs(), dtype, 4)


def test_bad_shapes_and_dtypes_are_refused():
    x = torch.randn(2, 8, 64).to(DEV)
    c = torch.randn(2, 64).to(DEV)
    with pytest.raises(ValueError):
        norm_rope(x, c[:, :32], c)
    with pytest.raises(ValueError):
        norm_rope(torch.randn(2, 8, 48).to(DEV), torch.randn(2, 48).to(DEV), torch.randn(2, 48).to(DEV))
    with pytest.raises(ValueError):
        rms_norm(x, torch.ones(63).to(DEV), 1e-6)
    with pytest.raises((TypeError, ValueError)):
        rms_norm(x, torch.ones(64, dtype=torch.bfloat16).to(DEV), 1e-6)


_ROPE_SIG = dict(t_ptr="*bf16", w_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16", out_ptr="*bf16", Hh="i32",
                 inv_d="fp32", eps="fp32", D="constexpr", HB="constexpr", NORM="constexpr", INTERP="constexpr")


def test_rope_compiles_to_torchs_roundings_for_sm90():
    """Offline sm_90 PTX of the RoPE kernel as the launch compiles it: no fused multiply-add in the narrow dtype
    (Triton narrows the fp32 ops between the roundings and, with fp fusion, contracts them: one rounding where torch
    makes two, an ulp off on the H200). The default options do contract, so the check can see it."""
    keys = ["fma.rn.bf16", "mul.rn.bf16", "add.rn.bf16"]
    cst = dict(D=128, HB=4, NORM=True, INTERP=False)
    ours = compile_sm90("kernels.norm", "_norm_rope_kernel", _ROPE_SIG, cst, keys, 4, options=LAUNCH)
    default = compile_sm90("kernels.norm", "_norm_rope_kernel", _ROPE_SIG, cst, keys, 4)
    assert ours["fma.rn.bf16"] == 0 and ours["mul.rn.bf16"] > 0 and ours["add.rn.bf16"] > 0, ours
    assert default["fma.rn.bf16"] > 0, default
