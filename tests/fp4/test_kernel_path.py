"""trace/fp4 on the Triton quantize kernel (TRACE_FP4_KERNELS=on; the CPU runs it in Triton's interpreter)
against the reference ops (TRACE_FP4_KERNELS=off): codes, scale bytes, outer scales and the fake-quantized
values bit for bit, per row, per tensor and per expert, NVFP4 and MXFP4, fp32 and bf16, with zero rows
and blocks, and the straight-through gradient. On a GPU this file compares the compiled kernel with the reference ops
(in the GPU suite, scripts/gpu/gpu_tests.sh), at the tests' shapes and at the small flavors' weight shapes."""
import pytest
import torch

from trace import fp4
from trace.models import list_models

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU: the compiled kernel against the reference there


def _inputs(seed: int, shape, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-6, 7, shape[:-1], generator=g).float())[..., None]
    x[..., :16] *= 40.0  # blocks far above the row's typical scale
    x.view(-1, shape[-1])[1] = 0.0  # an all-zero row
    x[..., 16:32] = 0.0  # a zero block
    return x.to(DEV, dtype)


def _both(monkeypatch, fn):
    monkeypatch.setenv("TRACE_FP4_KERNELS", "off")
    a = fn()
    monkeypatch.setenv("TRACE_FP4_KERNELS", "on")
    b = fn()
    return a, b


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("outer,shape", [("row", (6, 5, 96)), ("tensor", (12, 64)), ("expert", (3, 8, 64))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_and_fake_quant_match_the_reference(monkeypatch, fmt, outer, shape, dtype):
    for seed in range(2):
        x = _inputs(seed, shape, dtype)
        ref, ker = _both(monkeypatch, lambda: fp4.quantize(x, fmt, outer))  # noqa: B023
        assert ker.codes.dtype == torch.uint8 and ker.codes.shape == ref.codes.shape
        assert torch.equal(ker.codes, ref.codes) and torch.equal(ker.scales, ref.scales)
        assert ker.outer.shape == ref.outer.shape and torch.equal(ker.outer, ref.outer)
        assert ker.dtype == ref.dtype and ker.fmt == ref.fmt
        f_ref, f_ker = _both(monkeypatch, lambda: fp4.fake_quant(x, fmt, outer))  # noqa: B023
        assert f_ker.dtype == dtype and torch.equal(f_ker, f_ref)
        assert torch.equal(f_ker, ref.dequantize(dtype))


@pytest.mark.parametrize("shape", [(48, 32), (4, 32, 48)])
def test_weights_match_the_reference_with_a_straight_through_gradient(monkeypatch, shape):
    w = _inputs(3, shape, torch.bfloat16).requires_grad_(True)
    ref, ker = _both(monkeypatch, lambda: fp4.fake_quant_weight(w))
    assert torch.equal(ker, ref)
    g = torch.randn(shape).to(DEV, torch.bfloat16)
    ker.backward(g)
    assert torch.equal(w.grad, g)


def test_the_switch(monkeypatch):
    x = torch.zeros(2, 16)
    monkeypatch.delenv("TRACE_FP4_KERNELS", raising=False)
    assert not fp4.kernels_on(x)  # default: the reference ops, on every device
    if torch.cuda.is_available():
        assert not fp4.kernels_on(x.cuda())
    monkeypatch.setenv("TRACE_FP4_KERNELS", "auto")
    assert not fp4.kernels_on(x)  # auto: CUDA tensors only
    if torch.cuda.is_available():
        assert fp4.kernels_on(x.cuda())
    monkeypatch.setenv("TRACE_FP4_KERNELS", "on")
    assert fp4.kernels_on(x)
    monkeypatch.setenv("TRACE_FP4_KERNELS", "sometimes")
    with pytest.raises(ValueError, match="TRACE_FP4_KERNELS must be one of"):
        fp4.kernels_on(x)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_guided_dequantize_matches_the_reference(monkeypatch, fmt, dtype):
    """Replay's guided sites: a record of x, replayed on a perturbed copy (elements within and beyond a grid
    step, zero blocks and rows), gives the same guided codes, values and own RTN codes on both paths."""
    x = _inputs(5, (7, 3, 96), torch.float32)
    rec = fp4.quantize(x, fmt, "row")
    g = torch.Generator().manual_seed(6)
    y = (x * (1 + 0.3 * torch.randn(x.shape, generator=g).to(DEV))).to(dtype)
    args = (y, rec.mantissa(), rec.scales, rec.outer, fmt)
    (r0, v0, o0), (r1, v1, o1) = _both(monkeypatch, lambda: fp4.guided_dequantize(*args, dtype=dtype, rtn_codes=True))
    assert torch.equal(r1.tensor.codes, r0.tensor.codes) and torch.equal(v1, v0) and torch.equal(o1, o0)
    assert v1.dtype == dtype and torch.equal(r0.tensor.codes, fp4.guided_quantize(*args).tensor.codes)
    assert bool((r0.tensor.codes != o0).any())  # the perturbation moved some elements off their RTN code
    _, _, none = fp4.guided_dequantize(*args, dtype=dtype)
    assert none is None


@pytest.mark.parametrize("name", list_models(flavor="small"))  # every registered family
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_at_the_small_flavors_shapes(monkeypatch, name, dtype):
    """Every quantized weight shape of a small flavor (K up to the experts' intermediate size, not a power of
    two, per-expert outer scales over thousands of rows): the engine's codes (`quantize_weight`) and the
    trainer's values (`fake_quant_weight`) on the kernel equal the reference's, and so do the per-row fake
    quantized activations of each weight's input width. On a GPU the whole tensors
    (the runs' launches); on the CPU's interpreter the first 2 experts' or 64 rows' slice of each."""
    from trace.models import build_model

    model = build_model(name, seed=0)
    seen = set()
    for pname, p in model.named_parameters():
        if p.dim() < 2 or tuple(p.shape) in seen or any(s in pname for s in ("embed", "lm_head", "norm", "mlp.gate.")):
            continue
        seen.add(tuple(p.shape))
        w = p.detach() if DEV == "cuda" else (p.detach()[:2, :64] if p.dim() == 3 else p.detach()[:64])
        w = (w * torch.exp2(torch.linspace(-3, 3, w.shape[-1]))).to(DEV, dtype)  # blocks of unequal scale
        ref, ker = _both(monkeypatch, lambda: fp4.quantize_weight(w))  # noqa: B023
        assert torch.equal(ker.codes, ref.codes) and torch.equal(ker.scales, ref.scales), pname
        assert torch.equal(ker.outer, ref.outer), pname
        f_ref, f_ker = _both(monkeypatch, lambda: fp4.fake_quant_weight(w))  # noqa: B023
        assert torch.equal(f_ker, f_ref) and torch.equal(f_ker, ref.dequantize(dtype)), pname
        # the activations that meet this weight (K = its input width, e.g. the experts' 1792), per row as the
        # trainer's plain sites quantize them
        g = torch.Generator().manual_seed(len(seen))
        x = (torch.randn(4096 if DEV == "cuda" else 48, w.shape[-1], generator=g) * 3).to(DEV, dtype)
        x[:, :16] *= 50.0
        f_ref, f_ker = _both(monkeypatch, lambda: fp4.fake_quant(x, "nvfp4", "row"))  # noqa: B023
        assert torch.equal(f_ker, f_ref), (pname, "activations")
    assert len(seen) >= 3  # attention, experts in and out (olmoe-small has no other shape)
