"""Property tests (hypothesis) of the FP4 library: error bound, idempotence, packing round trip,
guided rounding recovery, unbiased stochastic rounding and the straight-through gradient."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import reference as ref
from trace import fp4

GRID = torch.tensor(ref.E2M1_GRID)


def rand(seed, shape, log_spread=2.0):
    """Random values spanning several orders of magnitude per row, with exact zeros and ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(*shape[:-1], 1, generator=g) * log_spread)
    x[torch.rand(shape, generator=g) < 0.03] = 0.0
    return x


seeds = st.integers(0, 2**31 - 1)
rows = st.integers(1, 6)
nblocks = st.integers(1, 4)
fmts = st.sampled_from(["nvfp4", "mxfp4"])
outers = st.sampled_from(["tensor", "row"])


def _half_step(a):
    """Half the distance to the next grid point above the nearest one below: the RTN error bound."""
    lo = ref.e2m1_floor_index(a).clamp(max=6).long()
    return (GRID[lo + 1] - GRID[lo]) / 2


@given(seeds, rows, nblocks, fmts, outers)
def test_error_bound_per_element(seed, r, nb, fmt, outer):
    block = 16 if fmt == "nvfp4" else 32
    x = rand(seed, (r, nb * block))
    t = fp4.quantize(x, fmt, outer)
    xh = t.dequantize()
    # v is the value that was rounded; its scale converts between the code domain and x
    if fmt == "nvfp4":
        v = ref.nvfp4_scaled(x, t.scales, t.outer)
        unit = ref.expand_scales(ref.e4m3_decode(t.scales), x.shape, 16, False) / t.outer
    else:
        v = ref.mxfp4_scaled(x, t.scales)
        unit = ref.expand_scales(ref.e8m0_decode(t.scales), x.shape, 32, False)
    a = v.abs()
    bound_codes = torch.where(a <= 6, _half_step(a.clamp(max=6)), a - 6)
    err = (x - xh).abs()
    assert (err <= (bound_codes + 1e-5) * unit).all()  # 1e-5 code units: fp32 rounding of x*S_enc/s_b
    # the rounding is the nearest grid point of the clamped value, sign preserved
    dec = ref.e2m1_decode(t.codes)
    nearest = (a.clamp(max=6).unsqueeze(-1) - GRID).abs().min(-1).values
    assert torch.allclose((dec.abs() - a.clamp(max=6)).abs(), nearest, atol=1e-6)


@given(seeds, rows, nblocks, outers)
def test_nvfp4_quantize_of_dequantized_is_idempotent_with_same_outer(seed, r, nb, outer):
    x = rand(seed, (r, nb * 16), log_spread=1.0)
    t = fp4.quantize(x, "nvfp4", outer)
    normal = ref.e4m3_decode(t.scales) >= 2.0 ** -6  # subnormal E4M3 scales lose relative precision
    t2 = fp4.quantize(t.dequantize(), "nvfp4", t.outer)
    keep = normal.repeat_interleave(16, -1)
    assert torch.equal(t2.scales[normal], t.scales[normal])
    assert torch.equal(t2.codes[keep] & 7, t.codes[keep] & 7)
    assert torch.equal(t2.dequantize()[keep], t.dequantize()[keep])


@given(seeds, rows, nblocks, st.sampled_from(["floor", "noclip"]))
def test_mxfp4_dequantize_quantize_is_idempotent(seed, r, nb, rule):
    x = rand(seed, (r, nb * 32), log_spread=1.0)
    xh = fp4.quantize(x, "mxfp4", mx_rule=rule).dequantize()
    assert torch.equal(fp4.quantize(xh, "mxfp4", mx_rule=rule).dequantize(), xh)


@given(seeds, rows, st.integers(1, 8))
def test_pack_unpack_round_trip(seed, r, half_k):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (r, 2 * half_k), generator=g, dtype=torch.uint8)
    assert torch.equal(fp4.unpack(fp4.pack(codes)), codes)
    bits = torch.randint(0, 2, (r, 8 * half_k), generator=g, dtype=torch.uint8)
    assert torch.equal(fp4.unpack_bits(fp4.pack_bits(bits)), bits)


@given(seeds, rows, nblocks, fmts, st.floats(0.0, 1.5))
def test_guided_reproduces_codes_within_one_grid_step_and_reports_the_rest(seed, r, nb, fmt, eps):
    """Quantize x (the 'rollout'); perturb it (the 'trainer'); replay with the rollout's mantissa bits
    and scales. Every element whose perturbed value stays within one grid step of the rollout value
    (on the same side of zero) must get the rollout code back; the others are reported."""
    block = 16 if fmt == "nvfp4" else 32
    x = rand(seed, (r, nb * block), log_spread=1.0)
    t = fp4.quantize(x, fmt, "row")
    g = torch.Generator().manual_seed(seed + 1)
    unit = (ref.expand_scales(ref.e4m3_decode(t.scales), x.shape, 16, False) / t.outer if fmt == "nvfp4"
            else ref.expand_scales(ref.e8m0_decode(t.scales), x.shape, 32, False))
    # perturbation in code units, up to `eps` grid units of 1.0 (large enough to cross steps sometimes)
    xp = x + torch.randn(x.shape, generator=g) * eps * unit
    res = fp4.guided_quantize(xp, t.mantissa(), t.scales, t.outer, fmt, ref_codes=t.codes)
    # which elements are within one grid step of the recorded value?
    v_p = (ref.nvfp4_scaled(xp, t.scales, t.outer) if fmt == "nvfp4" else ref.mxfp4_scaled(xp, t.scales))
    code_mag = (t.codes & 7).long()
    a = v_p.abs()
    lower = GRID[(code_mag - 1).clamp(min=0)]
    upper = GRID[(code_mag + 1).clamp(max=7)]
    within = (a >= lower) & ((a < upper) | (code_mag == 7))
    same_sign = (torch.signbit(xp) == torch.signbit(x)) | (code_mag == 0)
    ok = within & same_sign
    assert torch.equal(res.tensor.codes[ok] & 7, t.codes[ok] & 7)
    assert not res.unrecoverable[ok & (code_mag > 0)].any()
    # the report is exact: flagged elements are exactly those whose value differs from the rollout's
    differs = res.tensor.dequantize() != t.dequantize()
    assert torch.equal(res.unrecoverable, differs)
    # and with no perturbation everything is recovered
    if eps == 0.0:
        assert not res.unrecoverable.any()


def test_guided_recovers_rtn_flips_that_plain_rtn_misses():
    """The point of TRACE: tiny numeric noise flips RTN codes near midpoints; guided rounding does not."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g)
    t = fp4.quantize(x, "nvfp4", "row")
    xp = x * (1 + 2e-3 * torch.randn(x.shape, generator=g))  # bf16-sized relative noise
    rtn = fp4.quantize(xp, "nvfp4", t.outer)
    flips_rtn = (rtn.codes != t.codes).float().mean().item()
    res = fp4.guided_quantize(xp, t.mantissa(), t.scales, t.outer, ref_codes=t.codes)
    assert flips_rtn > 1e-3
    assert res.unrecoverable.float().mean().item() == 0.0


@settings(max_examples=15)  # 4000 samples each: the expensive property
@given(seeds, fmts)
def test_stochastic_rounding_is_unbiased(seed, fmt):
    block = 16 if fmt == "nvfp4" else 32
    x = rand(seed, (1, 2 * block), log_spread=0.5)
    g = torch.Generator().manual_seed(seed)
    n = 4000
    xs = x.expand(n, -1).contiguous()
    # per-tensor scale over identical rows == the scale of one row: every sample shares the scales
    samples = fp4.quantize(xs, fmt, "tensor", "stochastic", generator=g).dequantize()
    t = fp4.quantize(x, fmt, "tensor")
    unit = (ref.expand_scales(ref.e4m3_decode(t.scales), x.shape, 16, False) / t.outer if fmt == "nvfp4"
            else ref.expand_scales(ref.e8m0_decode(t.scales), x.shape, 32, False))
    v = (x / unit).abs()
    inside = v <= 6
    mean = samples.mean(0, keepdim=True)
    # std of a two-point rounding is at most half a step (<= 1 code unit); 5 sigma of the mean
    tol = 5 * unit / n ** 0.5
    assert ((mean - x).abs()[inside] <= tol[inside]).all()
    # and it really is stochastic (not RTN) wherever x is strictly between grid points
    between = inside & ((v.unsqueeze(-1) - GRID).abs().min(-1).values > 0.05)
    if between.any():
        assert samples.std(0, keepdim=True)[between].min() > 0


def test_stochastic_rounding_is_seeded():
    x = torch.randn(8, 64)
    a = fp4.quantize(x, rounding="stochastic", seed=7).codes
    b = fp4.quantize(x, rounding="stochastic", seed=7).codes
    c = fp4.quantize(x, rounding="stochastic", seed=8).codes
    assert torch.equal(a, b) and not torch.equal(a, c)


@given(seeds, fmts, st.sampled_from(["rtn", "stochastic"]), st.sampled_from([torch.float32, torch.bfloat16]))
def test_ste_gradient_is_identity(seed, fmt, rounding, dtype):
    block = 16 if fmt == "nvfp4" else 32
    x = rand(seed, (3, 2 * block)).to(dtype).requires_grad_(True)
    y = fp4.fake_quant(x, fmt, "row", rounding, seed=seed)
    assert y.dtype == dtype
    assert torch.equal(y.detach(), fp4.quantize(x.detach(), fmt, "row", rounding, seed=seed).dequantize(dtype))
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    (y * w).sum().backward()
    assert torch.equal(x.grad, w)


def test_guided_fake_quant_uses_the_record_and_passes_gradient():
    x = torch.randn(4, 32, requires_grad=True)
    t = fp4.quantize(x.detach(), outer="row")
    y = fp4.fake_quant(x * 1.001, rounding="guided", guide=fp4.Guide(t.mantissa(), t.scales, t.outer))
    assert torch.equal(y.detach(), t.dequantize())
    y.sum().backward()
    assert torch.allclose(x.grad, torch.full_like(x, 1.001))
