"""Worked examples and tables of DESIGN.md §2: E2M1 ties, guided rounding's bracket, E4M3 rounding and saturation,
E8M0, zero blocks, packing order, the NVFP4 worked example, MXFP4 exponent rules, bad input."""
import pytest
import torch

from kernels import reference as ref
from trace import fp4

GRID = torch.tensor(ref.E2M1_GRID)


@pytest.mark.parametrize(
    "v,code",
    [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6),  # ties -> even code
     (0.2500001, 1), (0.7499999, 1), (4.9999, 6), (5.0001, 7), (6.0, 7), (100.0, 7), (0.0, 0)],
)
def test_e2m1_ties_and_saturation(v, code):
    assert int(ref.e2m1_encode(torch.tensor([v]))[0]) == code
    assert int(ref.e2m1_encode(torch.tensor([-v]))[0]) == code | 8


def test_e2m1_tie_values_match_design_table():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert ref.e2m1_decode(ref.e2m1_encode(ties)).tolist() == [0, 1, 1, 2, 2, 4, 4]


def test_e2m1_decode_all_codes_and_mantissa_alternates():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = ref.e2m1_decode(codes)
    assert vals[:8].tolist() == list(ref.E2M1_GRID)
    assert (vals[8:] == -vals[:8]).all()
    assert ((codes[:8] & 1) == torch.tensor([0, 1, 0, 1, 0, 1, 0, 1], dtype=torch.uint8)).all()


def test_e2m1_encode_is_nearest_on_random_values():
    v = torch.empty(20000).uniform_(-7, 7, generator=torch.Generator().manual_seed(0))
    dec = ref.e2m1_decode(ref.e2m1_encode(v))
    best = (v.abs().clamp(max=6).unsqueeze(-1) - GRID).abs().min(-1).values
    assert torch.allclose((dec.abs() - v.abs().clamp(max=6)).abs(), best)
    assert (torch.sign(dec) * torch.sign(v) >= 0).all()


def test_e2m1_guided_takes_the_bracketing_point_with_the_recorded_bit():
    """Guided rounding (DESIGN.md §3) between the two grid points around |v|: the one whose mantissa bit (code & 1)
    is the recorded bit. Above the top value 6 the bracket is (4, 6): bit 0 gives 4.0 (code 6), never past the
    grid; below 0.5 it is (0, 0.5); the sign is kept (-6.2 -> -4.0, code 14; -0.0 with bit 1 -> -0.5)."""
    v = torch.tensor([6.5, 6.5, 7.0, -6.2, 0.3, 0.3, 2.2, 2.2, -0.0, 5.9])
    bits = torch.tensor([1, 0, 0, 0, 0, 1, 0, 1, 1, 0], dtype=torch.uint8)
    assert ref.e2m1_guided(v, bits).tolist() == [7, 6, 6, 14, 0, 1, 4, 5, 9, 6]


def test_e4m3_rounding_and_saturation():
    # 448 max; beyond saturates (an unclamped cast would give NaN); RNE at the 16-step in [128, 256)
    b = ref.e4m3_encode(torch.tensor([448.0, 464.0, 1e6, 136.0, 152.0, 134.4, 0.0, 2.0 ** -9]))
    vals = ref.e4m3_decode(b).tolist()
    assert vals[:3] == [448.0, 448.0, 448.0]
    assert vals[3] == 128.0 and vals[4] == 160.0  # ties 136 -> 128 (even), 152 -> 160 (even)
    assert vals[5] == 128.0 and vals[6] == 0.0 and vals[7] == 2.0 ** -9
    assert not torch.isnan(ref.e4m3_decode(b)).any()


def test_e8m0_decode_and_nan():
    b = torch.tensor([127, 130, 0, 254, 255], dtype=torch.uint8)
    v = ref.e8m0_decode(b)
    assert v[:4].tolist() == [1.0, 8.0, 2.0 ** -127, 2.0 ** 127]
    assert torch.isnan(v[4])


def test_nvfp4_worked_example():
    # tensor amax 10 -> S_enc = 268.8; a block with amax 3.0 -> scale 3*268.8/6 = 134.4 -> E4M3 128 (0x70)
    x = torch.zeros(32)
    x[0] = 10.0
    x[16:19] = torch.tensor([3.0, 1.0, 0.05])
    t = fp4.quantize(x, "nvfp4", outer="tensor")
    assert float(t.outer) == pytest.approx(268.8)
    assert int(t.scales[1]) == 0x70
    d = t.dequantize()
    assert d[16].item() == pytest.approx(2.857, abs=1e-3)
    assert d[17].item() == pytest.approx(0.952, abs=1e-3)
    assert d[18].item() == 0.0
    assert d[0].item() == pytest.approx(10.0, rel=0.07)


def test_zero_blocks_and_zero_tensor():
    x = torch.zeros(2, 32)
    x[1, 16:] = torch.linspace(-1, 1, 16)
    t = fp4.quantize(x, "nvfp4", outer="row")
    assert float(t.outer[0]) == 1.0  # amax 0 -> S_enc 1
    assert (t.scales[0] == 0).all() and int(t.scales[1, 0]) == 0
    assert ((t.codes[0] & 7) == 0).all() and ((t.codes[1, :16] & 7) == 0).all()
    assert (t.dequantize()[0] == 0).all()
    m = fp4.quantize(torch.zeros(64), "mxfp4")
    assert (m.scales == 0).all() and (m.dequantize() == 0).all()


def test_tiny_amax_keeps_outer_scale_finite():
    x = torch.full((16,), 1e-38)
    t = fp4.quantize(x, "nvfp4")
    assert torch.isfinite(t.outer).all() and torch.isfinite(t.dequantize()).all()


def test_packing_order_low_nibble_first():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    p = fp4.pack(codes)
    assert p.tolist() == [[0x21, 0x0F]]
    assert torch.equal(fp4.unpack(p), codes)
    bits = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0], dtype=torch.uint8)
    assert fp4.pack_bits(bits).tolist() == [0x81, 0x02]
    assert torch.equal(fp4.unpack_bits(fp4.pack_bits(bits)), bits)


def test_mxfp4_exponent_rules():
    amax = torch.tensor([6.0, 7.9, 8.0, 9.0, 12.0, 1.0])
    assert ref.mxfp4_exponent(amax, "floor").tolist() == [0, 0, 1, 1, 1, -2]
    # noclip: smallest e with 6*2**e >= amax
    assert ref.mxfp4_exponent(amax, "noclip").tolist() == [0, 1, 1, 1, 1, -2]
    x = torch.zeros(32)
    x[0] = 7.9
    t_floor = fp4.quantize(x, "mxfp4", mx_rule="floor")
    t_noclip = fp4.quantize(x, "mxfp4", mx_rule="noclip")
    assert t_floor.dequantize()[0].item() == 6.0  # clipped by the OCP rule
    assert t_noclip.dequantize()[0].item() == 8.0


def test_16x16_blocks_share_scale_between_w_and_wT():
    w = torch.randn(32, 48, generator=torch.Generator().manual_seed(1))
    t = fp4.quantize(w, "nvfp4", block_2d=True)
    tt = fp4.quantize(w.T.contiguous(), "nvfp4", block_2d=True)
    assert t.scales.shape == (2, 3)
    assert torch.equal(t.scales.T, tt.scales)
    assert torch.equal(t.dequantize().T, tt.dequantize())


def test_per_expert_outer_scale():
    w = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(2))
    w[2] *= 100
    t = fp4.quantize(w, "nvfp4", outer="expert")
    assert t.outer.shape == (4, 1, 1)
    for e in range(4):
        assert torch.equal(t.outer[e].reshape(()), ref.nvfp4_outer_scale(w[e].abs().amax()))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_raises_with_count_and_location(bad):
    x = torch.randn(3, 32)
    x[1, 5] = bad
    x[2, 7] = bad
    with pytest.raises(ValueError, match=r"2 non-finite.*\(1, 5\)"):
        fp4.quantize(x)
    with pytest.raises(ValueError, match="non-finite"):
        fp4.fake_quant(x)


def test_bad_shapes_and_dtypes_raise():
    with pytest.raises(ValueError, match="multiple of the nvfp4 block size 16"):
        fp4.quantize(torch.randn(3, 20))
    with pytest.raises(ValueError, match="multiple of the mxfp4 block size 32"):
        fp4.quantize(torch.randn(3, 16), "mxfp4")
    for dt in (torch.int32, torch.float64, torch.uint8):
        with pytest.raises(TypeError, match="cast explicitly"):
            fp4.quantize(torch.zeros(16, dtype=dt))
    with pytest.raises(ValueError, match="fmt"):
        fp4.quantize(torch.randn(16), "fp8")
    with pytest.raises(ValueError, match="rounding"):
        fp4.quantize(torch.randn(16), rounding="nearest")
    with pytest.raises(ValueError, match="second-to-last"):
        fp4.quantize(torch.randn(8, 16), block_2d=True)
    x = torch.randn(2, 32)
    t = fp4.quantize(x, outer="row")
    with pytest.raises(ValueError, match="mantissa"):
        fp4.guided_quantize(x, t.mantissa()[:1], t.scales, t.outer)
    with pytest.raises(ValueError, match="scales"):
        fp4.guided_quantize(x, t.mantissa(), t.scales[:, :1], t.outer)
    with pytest.raises(ValueError, match="0 or 1"):
        fp4.guided_quantize(x, t.codes, t.scales, t.outer)


def test_bf16_input_keeps_dtype_and_matches_fp32_codes():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    t = fp4.quantize(x, outer="row")
    t32 = fp4.quantize(x.float(), outer="row")
    assert torch.equal(t.codes, t32.codes) and torch.equal(t.scales, t32.scales)
    assert t.dequantize().dtype == torch.bfloat16
    y = fp4.fake_quant(x)
    assert y.dtype == torch.bfloat16
