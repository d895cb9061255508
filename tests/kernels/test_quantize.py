"""Triton quantize kernel vs kernels/reference.py: bit-exact codes, scales, outer scales and packed
mantissa bits (rtn); statistics and determinism for stochastic rounding; Python-side errors.
Every assertion holds on the GPU and in the interpreter alike (tests/kernels/conftest.py): inputs are
made on the CPU, the kernel runs on DEV, the oracle on the CPU copy."""
import pytest
import torch
import triton
import triton.language as tl

from kernels import reference as ref
from kernels._common import e2m1_rtn_idx, e2m1_rtn_idx_fma
from kernels.quantize import QuantizedRows, quantize_rows
from tests.kernels.conftest import DEV, ON_GPU, dev, host


def _data(M, K, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.exp(torch.randn(M, 1, generator=g) * 3)
    x[0, :32] = 0.0  # zero blocks
    if M > 1:
        x[1] = -x[1].abs()  # an all-negative row
        x[1, 3] = -0.0
    if M > 2:
        x[2, 16:32] = 1e-30  # tiny block (E4M3 subnormal / zero scale)
    return x


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("M,K", [(1, 32), (7, 96), (5, 160), (3, 4096 + 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rtn_bit_exact(fmt, M, K, dtype):
    x = _data(M, K, seed=M * 1000 + K).to(dtype)
    q = host(quantize_rows(dev(x), fmt, guidance=True))
    if fmt == "nvfp4":
        c, s, o = ref.nvfp4_quantize(x.float(), outer="row")
        assert torch.equal(q.outer, o)
    else:
        c, s = ref.mxfp4_quantize(x.float())
    assert torch.equal(q.packed, ref.pack_fp4(c))
    assert torch.equal(q.scales, s)
    assert torch.equal(q.mantissa, ref.pack_bits(c & 1))
    assert torch.equal(q.codes(), c)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("M,K", [(5, 160), (128, 1792), (128, 2048)])
def test_plain_variant_bit_exact(fmt, M, K):
    """The variant the W4A4 GEMMs call (codes and scales only, no mantissa bits or dequantized rows) is
    its own compiled kernel: at 128 x 2048 on an H200 it once disagreed with the guidance variant, which
    matched the oracle (kernels/NOTES.md, v2j). 128 x 1792 is mixtral-small's expert down projection."""
    if not ON_GPU and M * K > 4096:
        pytest.skip("the GPU's tile at this shape; the interpreter picks smaller tiles, covered by 5 x 160")
    x = _data(M, K, seed=M + K).to(torch.bfloat16)
    q = host(quantize_rows(dev(x), fmt))
    if fmt == "nvfp4":
        c, s, o = ref.nvfp4_quantize(x.float(), outer="row")
        assert torch.equal(q.outer, o)
    else:
        c, s = ref.mxfp4_quantize(x.float())
    assert q.mantissa is None and q.fake is None
    assert torch.equal(q.scales, s)
    assert torch.equal(q.packed, ref.pack_fp4(c)), int((q.codes() != c).sum())


@pytest.mark.parametrize("M,K", [(300, 512), (300, 1024), (300, 1536), (300, 1792), (300, 2048), (300, 2560),
                                 (300, 4096), (64, 6144), (64, 14336), (200, 6144)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_gpu_tile_bit_exact(M, K, dtype):
    """Every tile `_config` gives a GPU (one chunk of 512 to 16384 elements; 2048-wide chunks for long rows
    beyond the decode sizes), fp32 and bf16 inputs, each of the kernel's variants: codes and scales with the
    row's own S_enc, with a given per-tensor S_enc (trace/fp4's weights), with mantissa bits, and the
    dequantized rows. Triton 3.6 miscompiled two of these tiles on an H200 while the interpreter ran them
    exactly (kernels/NOTES.md, v2d and v2k), so this runs on the GPU only. The rounding on the FMA pipe (the
    default); `test_every_gpu_tile_bit_exact_by_compares` runs the threshold compares."""
    _check_every_variant(M, K, dtype, fma_rtn=True)


def _check_every_variant(M, K, dtype, fma_rtn):
    if not ON_GPU:
        pytest.skip("the GPU's tiles; the interpreter picks its own (covered above)")
    x = _data(M, K, seed=K + M).to(dtype)
    xf = x.float()
    c, s, o = ref.nvfp4_quantize(xf, outer="row")
    q = host(quantize_rows(dev(x), "nvfp4", fma_rtn=fma_rtn))
    assert torch.equal(q.scales, s) and torch.equal(q.outer, o)
    assert torch.equal(q.packed, ref.pack_fp4(c)), ("plain", int((q.codes() != c).sum()))
    q = host(quantize_rows(dev(x), "nvfp4", guidance=True, fake_dtype=dtype, fake_exact=True, fma_rtn=fma_rtn))
    assert torch.equal(q.packed, ref.pack_fp4(c)), ("guidance", int((q.codes() != c).sum()))
    assert torch.equal(q.mantissa, ref.pack_bits(c & 1))
    assert torch.equal(q.fake, ref.nvfp4_dequantize(c, s, o).to(dtype))
    given = ref.nvfp4_outer_scale(ref.outer_amax(xf, "tensor"))
    c, s, _ = ref.nvfp4_quantize(xf, "tensor", s_enc=given)
    q = host(quantize_rows(dev(x), "nvfp4", s_enc=dev(given.expand(M).contiguous()), fma_rtn=fma_rtn))
    assert torch.equal(q.scales, s)
    assert torch.equal(q.packed, ref.pack_fp4(c)), ("given S_enc", int((q.codes() != c).sum()))
    c, s = ref.mxfp4_quantize(xf)
    q = host(quantize_rows(dev(x), "mxfp4", fma_rtn=fma_rtn))
    assert torch.equal(q.scales, s) and torch.equal(q.packed, ref.pack_fp4(c)), "mxfp4"


def test_mx_noclip_and_3d_input():
    x = _data(6, 64, 3).reshape(2, 3, 64)
    q = host(quantize_rows(dev(x), "mxfp4", mx_rule="noclip"))
    c, s = ref.mxfp4_quantize(x, rule="noclip")
    assert q.packed.shape == (2, 3, 32) and torch.equal(q.packed, ref.pack_fp4(c)) and torch.equal(q.scales, s)


def test_e4m3_scale_rounding_boundaries():
    # block amax values whose scaled amax lands near E4M3 binade edges and rounding midpoints. The
    # scale byte comes from the hardware cast on the GPU and from integer RNE in the interpreter
    # (whose own fp8 cast rounded 126.7 to 64): both must give the oracle's bytes.
    amax_row = 100.0
    blk = torch.tensor([126.7, 120.0, 124.0, 0.015625 * 6 / 26.88, 0.0009, 99.99, 4.0, 60.0]) / 448 * amax_row
    x = torch.zeros(1, 16 * len(blk))
    x[0, 0] = amax_row
    for i, a in enumerate(blk):
        x[0, 16 * i + 5] = float(a)
        x[0, 16 * i + 9] = -float(a) / 3
    q = host(quantize_rows(dev(x), "nvfp4"))
    c, s, o = ref.nvfp4_quantize(x, outer="row")
    assert torch.equal(q.scales, s) and torch.equal(q.packed, ref.pack_fp4(c))


def test_stochastic_contract():
    x = _data(4, 64, 7)
    xd = dev(x)
    q1 = host(quantize_rows(xd, "nvfp4", "stochastic", seed=5))
    q2 = host(quantize_rows(xd, "nvfp4", "stochastic", seed=5))
    assert torch.equal(q1.packed, q2.packed)  # deterministic per seed
    rtn = host(quantize_rows(xd, "nvfp4"))
    assert torch.equal(q1.scales, rtn.scales) and torch.equal(q1.outer, rtn.outer)
    v = ref.nvfp4_scaled(x, rtn.scales, rtn.outer)
    lo = ref.e2m1_floor_index(v.abs()).clamp(max=6).long()
    idx = (q1.codes() & 7).long()
    assert bool(((idx == lo) | (idx == lo + 1)).all())  # always a bracketing code
    # unbiased: the mean over seeds of the dequantized value approaches x
    acc = torch.zeros_like(x)
    n = 200
    for sd in range(n):
        acc += host(quantize_rows(xd, "nvfp4", "stochastic", seed=sd)).dequantize()
    err = (acc / n - x).abs()
    step = (rtn.dequantize() - x).abs().max()  # scale of one grid step
    assert float(err.mean()) < 0.05 * float(step) + 1e-6
    assert not torch.equal(quantize_rows(xd, "nvfp4", "stochastic", seed=6).packed.cpu(), q1.packed)


def test_scatter_rows_into_buffers():
    x = _data(5, 32, 11)
    R = 9
    u8 = dict(dtype=torch.uint8, device=DEV)
    out = QuantizedRows(torch.zeros(R, 16, **u8), torch.zeros(R, 2, **u8), torch.ones(R, device=DEV),
                        torch.zeros(R, 4, **u8), "nvfp4")
    dst = torch.tensor([8, 0, 3, 5, 1])
    assert quantize_rows(dev(x), "nvfp4", guidance=True, out=out, dst_rows=dev(dst)) is out
    out = host(out)
    c, s, o = ref.nvfp4_quantize(x, outer="row")
    assert torch.equal(out.packed[dst], ref.pack_fp4(c)) and torch.equal(out.scales[dst], s)
    assert torch.equal(out.outer[dst], o.squeeze(-1)) and torch.equal(out.mantissa[dst], ref.pack_bits(c & 1))
    assert int(out.packed[2].sum()) == 0  # untouched row


def test_errors_before_launch():
    with pytest.raises(ValueError, match="non-finite"):
        quantize_rows(dev(torch.tensor([[1.0, float("nan")] + [0.0] * 14])))
    with pytest.raises(ValueError, match="non-finite"):
        quantize_rows(torch.full((2, 16), float("inf"), device=DEV))
    with pytest.raises(TypeError):
        quantize_rows(torch.ones(2, 16, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="multiple"):
        quantize_rows(torch.ones(2, 24, device=DEV))
    with pytest.raises(ValueError, match="multiple"):
        quantize_rows(torch.ones(2, 16, device=DEV), "mxfp4")
    with pytest.raises(ValueError):
        quantize_rows(torch.ones(2, 16, device=DEV), rounding="guided")
    assert quantize_rows(torch.ones(0, 16, device=DEV)).packed.shape == (0, 8)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_output_is_the_reference_dequantization(fmt, dtype):
    """The dequantized rows written in the same pass (the W4A4 decode path's GEMV input) are the
    reference dequantization of the kernel's own codes: exactly for MXFP4 (power-of-two scales); for
    NVFP4 the kernel multiplies by the row's reciprocal of S_enc instead of dividing: within 2^-22 of
    it in fp32; after the cast to bf16 equal except where the two land on either side of a rounding
    boundary (rare), then one bf16 ulp apart. The cast rounds to nearest even on both devices (the
    GPU's cvt.rn; in the interpreter, whose cast truncates, the kernel rounds the bits itself)."""
    x = _data(6, 4096 + 64, seed=11).to(dtype)
    xd = dev(x)
    q = host(quantize_rows(xd, fmt, fake_dtype=dtype))
    c = q.codes()
    deq = ref.nvfp4_dequantize(c, q.scales, q.outer) if fmt == "nvfp4" else ref.mxfp4_dequantize(c, q.scales)
    assert q.fake.dtype == dtype
    want = deq.to(dtype)
    if fmt == "mxfp4":
        assert torch.equal(q.fake, want)
    else:
        rel = 2.0 ** -22 if dtype == torch.float32 else 2.0 ** -8
        err = (q.fake.double() - deq.double()).abs()
        assert bool((err <= rel * deq.double().abs() + (want.double() - deq.double()).abs()).all())
        if dtype == torch.bfloat16:
            assert float((q.fake != want).float().mean()) < 1e-3
    q0 = host(quantize_rows(xd, fmt))  # codes and scales do not depend on the extra output
    assert torch.equal(q0.packed, q.packed) and torch.equal(q0.scales, q.scales) and q0.fake is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_exact_is_bit_identical_to_the_reference(dtype):
    """fake_exact (the engine's FP4-KV prefill: what `KVCache.read` decodes): the reference's formula,
    q * s_b / S_enc with the division correctly rounded, then one cast: equal bit for bit, both devices."""
    x = _data(9, 2048 + 128, seed=5).to(dtype)
    q = host(quantize_rows(dev(x), "nvfp4", fake_dtype=dtype, fake_exact=True))
    want = ref.nvfp4_dequantize(q.codes(), q.scales, q.outer).to(dtype)
    assert torch.equal(q.fake, want)
    assert torch.equal(q.packed, host(quantize_rows(dev(x), "nvfp4")).packed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_tile_is_exact(dtype):
    """fake_tile (the W4A4 MMA tile's activation operand, `kernels.gemm.quantize_act_for_gemm`): q * s_b * 2^-7
    from the kernel's own codes and scales, exact in bf16 and fp32, so equal bit for bit to the reference's decode
    of them, in either output dtype; times 2^7 / S_enc it is the dequantized row."""
    x = _data(9, 2048 + 128, seed=6).to(dtype)
    for fd in (torch.float32, torch.bfloat16):
        q = host(quantize_rows(dev(x), "nvfp4", fake_dtype=fd, fake_tile=True))
        blocks = ref.e2m1_decode(q.codes()).reshape(9, -1, 16) * ref.e4m3_decode(q.scales)[..., None]
        want = (blocks.reshape(9, -1) * 2.0**-7).to(fd)
        assert torch.equal(q.fake, want)
        assert torch.equal(want.float(), blocks.reshape(9, -1) * 2.0**-7)  # nothing was rounded
        assert torch.equal(q.packed, host(quantize_rows(dev(x), "nvfp4")).packed)
    with pytest.raises(ValueError, match="fake_tile"):
        quantize_rows(dev(x), "mxfp4", fake_dtype=torch.float32, fake_tile=True)


def _midpoint_edges() -> torch.Tensor:
    """One 16-element NVFP4 block per (E4M3 scale s, midpoint m): the block amax 6 * s makes the block
    scale exactly s (S_enc is 1: the row's amax is 2688), and the other 15 elements sit on m * s and on
    the floats just below and above it, both signs. These are the values where RN(x / s) lands on a
    rounding midpoint of the E2M1 grid, or one ulp away from it."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    scales = ref.e4m3_decode(torch.arange(1, 127, dtype=torch.uint8))  # every positive finite byte < 448
    scales = scales[6 * scales <= 2688]
    rows = []
    for s in scales.tolist():
        for m in mids.tolist():
            t = torch.tensor(m * s, dtype=torch.float32)  # exact
            lo, hi = torch.nextafter(t, torch.zeros(())), torch.nextafter(t, torch.full((), 1e9))
            vals = [6 * s, t, lo, hi, -t, -lo, -hi, t, lo, hi, -t, -lo, -hi, t, hi, -lo]
            rows.append(torch.stack([torch.as_tensor(v, dtype=torch.float32) for v in vals]))
    blocks = torch.stack(rows)  # [n, 16]
    pad = (-blocks.shape[0]) % 8
    blocks = torch.cat([blocks, blocks[:pad]]) if pad else blocks
    x = blocks.reshape(-1, 8 * 16)  # rows of 8 blocks
    x[:, -1] = 2688.0  # row amax -> S_enc = 2688 / 2688 = 1 (the last block's scale is 448)
    return x


def test_rtn_codes_at_rounding_midpoints():
    """The NVFP4 RTN code is decided by comparing |x * S_enc| with midpoint * s_b instead of dividing;
    on the values where that could go wrong (on and one ulp around every midpoint times every E4M3
    scale) the codes and scales must still be the oracle's, whose codes come from the division."""
    x = _midpoint_edges()
    q = host(quantize_rows(dev(x), "nvfp4", guidance=True))
    c, s, o = ref.nvfp4_quantize(x, outer="row")
    assert torch.equal(o, torch.ones_like(o))
    assert torch.equal(q.scales, s)
    assert torch.equal(q.codes(), c)
    assert torch.equal(q.mantissa, ref.pack_bits(c & 1))


def _e2m1_edges() -> torch.Tensor:
    """Values where the E2M1 rounding of a value already divided by its scale can go wrong: every grid
    point and midpoint with the 3 floats on each side, the 1 / 2 regime boundary, 6 and above, zeros of
    both signs, subnormals, the largest floats, inf and NaNs (several payloads), both signs."""
    pts = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0,
                        0.125, 1e-45, 2.0 ** -126, 2.0 ** -127, 1e-30, 3.4028234663852886e38])
    vals = [pts]
    up, down = pts.clone(), pts.clone()
    for _ in range(3):
        up = torch.nextafter(up, torch.full_like(up, float("inf")))
        down = torch.nextafter(down, torch.zeros_like(down))
        vals += [up, down]
    v = torch.cat(vals)
    v = torch.cat([v, -v, torch.tensor([float("inf"), float("nan")])])
    nans = torch.tensor([0x7FC00000, 0x7F800001, 0x7FFFFFFF, -0x00400000, -1], dtype=torch.int32).view(torch.float32)
    return torch.cat([v, -v[-2:-1], nans])


@triton.jit
def _e2m1_probe(v_ptr, out_ptr, N, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + o, mask=o < N, other=0.0)
    sign = (v.to(tl.int32, bitcast=True) < 0).to(tl.int32)  # as the kernel: the code's sign bit
    tl.store(out_ptr + o, (e2m1_rtn_idx(tl.abs(v)) | (sign << 3)).to(tl.uint8), mask=o < N)


def test_e2m1_rtn_idx_edges():
    """The kernels' E2M1 rounding of a value already divided by its scale (`kernels._common.e2m1_rtn_idx`) on
    every edge of the grid, including inf and NaN (the kernel's NaN code: index 0 with the NaN's sign bit, as
    the reference)."""
    v = _e2m1_edges()
    out = torch.empty(v.shape, dtype=torch.uint8, device=DEV)
    _e2m1_probe[(triton.cdiv(v.numel(), 128),)](dev(v), out, v.numel(), BLOCK=128)
    assert torch.equal(host(out), ref.e2m1_encode(v))


def test_mxfp4_rtn_edges_at_scale_one():
    """MXFP4 RTN through the kernel on the finite edges below 8 in magnitude, every 32-element block
    holding a 6 so its scale is 2^0 (the kernel rounds x itself): codes bit-exact to the oracle."""
    v = _e2m1_edges()
    v = v[torch.isfinite(v) & (v.abs() < 8)]
    pad = (-v.numel()) % 124  # 4 blocks of 31 values + a 6 per row
    v = torch.cat([v, v[:pad]]).reshape(-1, 31)
    x = torch.cat([torch.full((v.shape[0], 1), 6.0), v], dim=1).reshape(-1, 128)  # 4 blocks per row
    q = host(quantize_rows(dev(x), "mxfp4", guidance=True))
    c, s = ref.mxfp4_quantize(x)
    assert torch.equal(s, torch.full_like(s, 127))
    assert torch.equal(q.scales, s)
    assert torch.equal(q.codes(), c)
    assert torch.equal(q.mantissa, ref.pack_bits(c & 1))


# The E2M1 rounding on the FMA pipe (`fma_rtn`, saturating FMAs; the default, kernels/NOTES.md v2l): the same codes
# as the compares. In the interpreter the saturating FMA is a multiply by 2^40 (exact) and one rounded add, the value
# `fma.rn.sat.f32` gives on the GPU.
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("M,K", [(7, 96), (3, 4096 + 64), (128, 1792), (300, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fma", [True, False])
def test_fma_rounding_bit_exact(fmt, M, K, dtype, fma):
    if not ON_GPU and M * K > 16384:
        pytest.skip("the GPU's tiles; the interpreter covers the rounding at the smaller shapes")
    x = _data(M, K, seed=M * 7 + K).to(dtype)
    for guide in (False, True):
        q = host(quantize_rows(dev(x), fmt, guidance=guide, fma_rtn=fma))
        if fmt == "nvfp4":
            c, s, o = ref.nvfp4_quantize(x.float(), outer="row")
            assert torch.equal(q.outer, o)
        else:
            c, s = ref.mxfp4_quantize(x.float())
        assert torch.equal(q.scales, s)
        assert torch.equal(q.codes(), c), int((q.codes() != c).sum())
        if guide:
            assert torch.equal(q.mantissa, ref.pack_bits(c & 1))


@pytest.mark.parametrize("M,K", [(300, 512), (300, 1024), (300, 1536), (300, 1792), (300, 2048), (300, 2560),
                                 (300, 4096), (64, 6144), (64, 14336), (200, 6144)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_gpu_tile_bit_exact_by_compares(M, K, dtype):
    """test_every_gpu_tile_bit_exact's tiles and variants with the rounding by threshold compares (fma_rtn=False,
    GPU only)."""
    _check_every_variant(M, K, dtype, fma_rtn=False)


@pytest.mark.parametrize("fma", [True, False])
def test_fma_rounding_at_the_midpoints_of_every_scale(fma):
    x = _midpoint_edges()
    q = host(quantize_rows(dev(x), "nvfp4", fma_rtn=fma))
    c, s, _ = ref.nvfp4_quantize(x, outer="row")
    assert torch.equal(q.scales, s)
    assert torch.equal(q.codes(), c)


@triton.jit
def _e2m1_fma_probe(v_ptr, out_ptr, N, BLOCK: tl.constexpr, ASM: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + o, mask=o < N, other=0.0)
    sign = (v.to(tl.int32, bitcast=True) < 0).to(tl.int32)
    idx = e2m1_rtn_idx_fma(tl.abs(v), tl.full([BLOCK], 1.0, tl.float32), ASM)
    tl.store(out_ptr + o, (idx | (sign << 3)).to(tl.uint8), mask=o < N)


def test_fma_rounding_edges_at_scale_one():
    """Every grid edge, inf and NaN payloads (index 0, as the compares)."""
    v = _e2m1_edges()
    out = torch.empty(v.shape, dtype=torch.uint8, device=DEV)
    _e2m1_fma_probe[(triton.cdiv(v.numel(), 128),)](dev(v), out, v.numel(), BLOCK=128, ASM=ON_GPU)
    assert torch.equal(host(out), ref.e2m1_encode(v))


def test_fma_rounding_mxfp4_edges_at_scale_one():
    v = _e2m1_edges()
    v = v[torch.isfinite(v) & (v.abs() < 8)]
    pad = (-v.numel()) % 124
    v = torch.cat([v, v[:pad]]).reshape(-1, 31)
    x = torch.cat([torch.full((v.shape[0], 1), 6.0), v], dim=1).reshape(-1, 128)
    q = host(quantize_rows(dev(x), "mxfp4", fma_rtn=True))
    c, s = ref.mxfp4_quantize(x)
    assert torch.equal(q.scales, s)
    assert torch.equal(q.codes(), c)
