"""kernels/align.py (the fused alignment term of a site) against its oracle, trace/guidance/align.py's torch ops
(`alignment_terms` on `scaled_values`, `scale_terms`) and torch's autograd of them.

What holds (the kernel makes the oracle's fp32 operations in the oracle's order):
- items and flipped counts: equal.
- the hinge sums: within fp32 summation order. Every hinge is >= 0, so each order's sum is within
  (depth of its summation) x 2^-24 of the exact sum relatively; rtol 1e-5 covers that at any test size here.
- gradients: bit-equal wherever an element's gradient is a function of its own item and its block's (every
  element except a row's amax element(s) under the scale part). The row-amax element also gets the row
  amax's share, a sum over the row's blocks that the kernel adds in another order (and multiplies by the
  upstream gradient after the sum, not before): within rtol 1e-5 and an absolute 1e-6 of the row's largest
  gradient (the sum's terms are of either sign, so its error is relative to their magnitudes, each at most
  the row's largest gradient; <= K/16 terms of 2^-24 relative error each at the sizes here).
Inputs: quantizer-made scales (random activations near a "rollout" copy), zero blocks, values exactly on
rounding boundaries and exactly at the cap under power-of-two scales, flipped and sign-only unflipped codes,
ties for a block amax and for the row amax, NVFP4 with and without the scale part, MXFP4, fp32 and bf16,
and the expert-slot shape [n, k, I] with per-(row, slot) outer scales.
"""
from __future__ import annotations

import pytest
import torch

from kernels import align as kalign
from kernels import reference as ref
from tests.kernels.conftest import DEV
from trace.guidance import align as talign


def _host(t):
    return t.detach().cpu() if isinstance(t, torch.Tensor) else t


def _oracle(x, scales, outer, own, target, own_s, target_s, fmt, margin, with_scales, w):
    xd = x.clone().requires_grad_(True)
    scaled = ref.nvfp4_scaled(xd, scales, outer) if fmt == "nvfp4" else ref.mxfp4_scaled(xd, scales)
    out = talign.alignment_terms(scaled, own, target, margin=margin)
    loss = w[0] * out[0]
    if with_scales:
        out += talign.scale_terms(xd, own_s, target_s, margin=margin)
        loss = loss + w[1] * out[3]
    loss.backward()
    return out, xd.grad


def _kernel(x, scales, outer, own, target, own_s, target_s, fmt, margin, with_scales, w):
    xd = x.to(DEV).clone().requires_grad_(True)
    d = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    out = kalign.alignment_site(xd, d(scales), d(outer), d(own), d(target), d(own_s), d(target_s), fmt, margin,
                                with_scales)
    loss = w[0] * out[0]
    if with_scales:
        loss = loss + w[1] * out[3]
    loss.backward()
    return tuple(_host(t) for t in out), _host(xd.grad)


def _check(x, scales, outer, own, target, own_s, target_s, fmt="nvfp4", margin=talign.MARGIN, with_scales=True,
           w=(0.37, 1.9)):
    args = (x, scales, outer, own, target, own_s, target_s, fmt, margin, with_scales, w)
    want, gw = _oracle(*args)
    got, gg = _kernel(*args)
    assert len(got) == len(want)
    for i in range(0, len(want), 3):
        assert got[i + 1] == want[i + 1]  # items
        assert int(got[i + 2]) == int(want[i + 2])  # flipped
        torch.testing.assert_close(got[i].float(), want[i].detach().float(), rtol=1e-5, atol=1e-12)
    assert gg.dtype == gw.dtype and gg.shape == gw.shape
    gg, gw = gg.float(), gw.float()
    if with_scales:  # the row-amax elements: the row amax's share summed in another order
        a = x.float().abs()
        at_max = a == a.amax(-1, keepdim=True)
        assert torch.equal(gg[~at_max], gw[~at_max])
        scale = gw.abs().amax().clamp(min=1e-30)
        torch.testing.assert_close(gg[at_max], gw[at_max], rtol=1e-5, atol=1e-6 * float(scale))
    else:
        assert torch.equal(gg, gw)
    return want


def _site(shape, fmt="nvfp4", seed=0, zero_blocks=True, dtype=torch.float32):
    """Activations near a rollout's copy, the rollout's recorded scales / outer, the trainer's own RTN codes
    under them and a target: the guided codes of the rollout's bits, with some magnitudes moved 1-3 grid steps
    (beyond the cap) and some signs flipped (not an item's flip)."""
    g = torch.Generator().manual_seed(seed)
    x_roll = torch.randn(shape, generator=g) * torch.exp(torch.randn(*shape[:-1], 1, generator=g))
    B = 16 if fmt == "nvfp4" else 32
    if zero_blocks:
        x_roll[..., :B] = 0.0  # a zero-scale block in every row
    x = (x_roll * (1 + 0.15 * torch.randn(shape, generator=g))).to(dtype)
    if zero_blocks:
        x[..., 1, :B] = 0.0
    if fmt == "nvfp4":
        c, scales, outer = ref.nvfp4_quantize(x_roll, outer="row")
        own_s = ref.nvfp4_quantize(x.float(), outer="row")[1]
    else:
        c, scales = ref.mxfp4_quantize(x_roll)
        outer, own_s = torch.ones(*shape[:-1], 1), None
    outer = outer.expand(*shape[:-1], 1).float().contiguous()
    scaled = ref.nvfp4_scaled(x.float(), scales, outer) if fmt == "nvfp4" else ref.mxfp4_scaled(x.float(), scales)
    own = ref.e2m1_encode(scaled)
    mag = (c & 7).long()
    move = torch.randint(-3, 4, shape, generator=g) * (torch.rand(shape, generator=g) < 0.15)
    target = ((mag + move).clamp(0, 7) | (c & 8).long()).to(torch.uint8)
    target ^= ((torch.rand(shape, generator=g) < 0.1).to(torch.uint8) << 3)
    return x, scales, outer, own, target, own_s, scales


@pytest.mark.parametrize("with_scales", [True, False])
@pytest.mark.parametrize("shape", [(12, 64), (5, 272), (3, 48)])  # 272: two chunks, the second part-masked
def test_nvfp4_random_sites(shape, with_scales):
    want = _check(*_site(shape, seed=shape[1]), with_scales=with_scales)
    assert int(want[2]) > 0 and (not with_scales or int(want[5]) > 0)


def test_moe_down_in_slots_shape():
    """[n, k, I] expert-slot rows with an outer scale per (row, slot)."""
    _check(*_site((4, 3, 96), seed=5))


def test_bf16_activations():
    """bf16 x: each part's gradient rounded to bf16, then their sum, as autograd accumulates them."""
    _check(*_site((6, 128), seed=6, dtype=torch.bfloat16))


@pytest.mark.parametrize("margin", [0.0, 0.1, 0.5])
def test_margins(margin):
    _check(*_site((4, 64), seed=7), margin=margin)


def test_mxfp4_codes():
    want = _check(*_site((6, 128), fmt="mxfp4", seed=8), fmt="mxfp4", with_scales=False)
    assert int(want[2]) > 0


def test_boundaries_cap_and_ties():
    """Power-of-two scales and outer 1, so each value's grid position is exact: values exactly at the boundary
    into the target's interval (d = 0), at the cap (d = -1: gradient still flows, clamp's >=), just past it, and
    the margin point (r = 0: no gradient); a row amax at 448 reached by two blocks, a block amax reached by two
    elements, and block amaxes exactly at E4M3 midpoints and one E4M3 step past them."""
    K = 64
    x = torch.zeros(2, K)
    scales = torch.full((2, K // 16), 56, dtype=torch.uint8)  # E4M3 1.0
    scales[:, 1] = 64  # 2.0
    outer = torch.ones(2, 1)
    # codes part, block 0 (scale 1): own magnitudes vs targets with values on the edges
    vals = [0.75, 0.25, 1.75, 1.25, 2.5, 0.5, 4.0, 5.0, 2.1, 0.0, -0.75, -3.5, 6.0, 0.35, 1.0, 0.85]
    x[:, :16] = torch.tensor(vals)
    x[:, 16:32] = 2.0 * torch.tensor(vals)  # block 1, scale 2: the same grid positions
    x[0, 40], x[0, 50] = 448.0, -448.0  # the row amax, reached by blocks 2 and 3
    x[1, 33], x[1, 34] = 1.0625, -1.0625  # a block amax reached twice: 1.0625 the E4M3 midpoint of 1 / 1.125
    x[1, 60] = 448.0
    x[1, 48] = 0.9375  # a block amax one E4M3 step below the midpoint (the cap)
    own = ref.e2m1_encode(ref.nvfp4_scaled(x, scales, outer))
    target = own.clone()
    # d = 0 / -1 / -1 - step: flip to the neighbour above / two above / three above
    for j, t in enumerate([2, 2, 5, 3, 6, 0, 5, 7, 4, 1, 3, 5, 6, 2, 3, 1]):
        target[:, j] = target[:, 16 + j] = t | int(own[0, j]) & 8
    e4 = lambda v: int(torch.tensor([v]).to(torch.float8_e4m3fn).view(torch.uint8))  # noqa: E731
    own_s = torch.tensor([[e4(1.0), e4(2.0), e4(448.0), e4(448.0)], [e4(1.0), e4(1.0), e4(0.875), e4(448.0)]],
                         dtype=torch.uint8)
    target_s = own_s.clone()
    target_s[0, 2] = e4(416.0)  # a flipped scale at the row amax
    target_s[1, 2] = e4(1.125)  # u = 1.0625: on the boundary (d = 0)
    target_s[1, 3] = e4(0.875)  # u = 0.9375 at one step below: d = -1, the cap
    target_s[1, 1] = e4(1.0)
    _check(x, scales, outer, own, target, own_s, target_s)
    _check(x, scales, outer, own, target, own_s, target_s, margin=0.0)


def test_no_flips_and_zero_rows():
    x, scales, outer, own, _, own_s, _ = _site((4, 64), seed=9)
    x[2] = 0.0
    own = ref.e2m1_encode(ref.nvfp4_scaled(x, scales, outer))
    want = _check(x, scales, outer, own, own.clone(), own_s, own_s.clone())
    assert int(want[2]) == 0 and int(want[5]) == 0 and float(want[0]) == 0.0


def test_saves_only_the_inputs_and_row_numbers():
    """Nothing of O(elements) in fp32 kept for the backward beyond x itself (the checkpointed torch term's
    inputs): codes and scales as bytes, and three numbers per row."""
    x, scales, outer, own, target, own_s, target_s = _site((8, 128), seed=10)
    xd = x.to(DEV).requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = kalign.alignment_site(xd, *(t.to(DEV) for t in (scales, outer, own, target, own_s, target_s)))
    big = [t for t in saved if t.is_floating_point() and t.numel() >= x.shape[0] + 1 and t.data_ptr() != xd.data_ptr()]
    assert not big, [tuple(t.shape) for t in big]
    (out[0] + out[3]).backward()


def test_constants_are_the_oracles():
    assert kalign.CAP == talign.CAP and kalign.E4M3_MAX == ref.E4M3_MAX
    assert (kalign.NVFP4_BLOCK, kalign.MXFP4_BLOCK) == (ref.NVFP4_BLOCK, ref.MXFP4_BLOCK)


def test_rejects_the_scale_part_for_mxfp4():
    x, scales, outer, own, target, _, _ = _site((2, 64), fmt="mxfp4", seed=11)
    with pytest.raises(ValueError):
        kalign.alignment_site(x, scales, outer, own, target, scales, scales, "mxfp4", 0.1, True)


def test_kernels_compile_for_sm90():
    """The forward and backward kernels (NVFP4 with the scale part, bf16 activations) compile for sm_90 without a GPU."""
    from tests.kernels.conftest import compile_sm90

    common = {"x_ptr": "*bf16", "s_ptr": "*u8", "o_ptr": "*fp32", "own_ptr": "*u8", "tgt_ptr": "*u8", "os_ptr": "*u8",
              "ts_ptr": "*u8"}
    fwd = dict(common, hc_ptr="*fp32", fc_ptr="*i32", hs_ptr="*fp32", fs_ptr="*i32", rr_ptr="*fp32", p_ptr="*fp32",
               cr_ptr="*i32", K="i32", margin="fp32")
    bwd = dict(common, rr_ptr="*fp32", p_ptr="*fp32", cr_ptr="*i32", gc_ptr="*fp32", gs_ptr="*fp32", gx_ptr="*bf16",
               K="i32", margin="fp32")
    cst = dict(NV=True, SCALES=True, NB=64, B=16, NCH=2)
    for name, sig, extra in (("_fwd_kernel", fwd, {}), ("_bwd_kernel", bwd, {"INTERP": False})):
        n = compile_sm90("kernels.align", name, sig, {**cst, **extra}, ("ld.global",), 4, wide=("K",))
        assert n["ld.global"] > 0, (name, n)


def test_kernels_divide_correctly_rounded_and_never_fuse():
    """What the interpreter cannot show: on a GPU, Triton's fp32 `/` is an approximate division and its compiler
    contracts a*b + c into one FMA, where torch rounds each operation. The bit-equal gradients above hold on a GPU
    only if every division in the kernels is div_rn and every launch passes enable_fp_fusion=False."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(kalign))
    jitted = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
              and any("jit" in ast.unparse(d) for d in f.decorator_list)]
    assert len(jitted) >= 6
    for f in jitted:
        divs = [ast.unparse(n) for n in ast.walk(f) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)]
        assert not divs, (f.name, divs)
    launches = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)]
    assert len(launches) == 2
    for call in launches:
        assert any(k.arg is None and ast.unparse(k.value) == "LAUNCH" for k in call.keywords), ast.unparse(call)
    assert kalign.LAUNCH == {"enable_fp_fusion": False}
