"""Plain-PyTorch oracle for every FP4 number this project produces.

This file is the normative definition of DESIGN.md §2 in code: E2M1 encode/decode, E4M3 and E8M0
scale bytes, NVFP4 and MXFP4 block quantization (RTN, stochastic, guided), packing, and the plain
dequantize-then-matmul GEMM and attention oracles. It imports only torch, so the formats library
(`trace.fp4`), the QAT trainer, the rollout engine and the Triton kernel tests all share exactly one
copy of the numerics; a Triton kernel is correct when it reproduces these functions bit-exactly
(codes, scale bytes) or to a stated tolerance (GEMM / attention outputs).

Conventions (compared against torchao's `nvfp4_quantize` / `to_mx` and NVIDIA's NVFP4 recipe):
- Computation is float32. `x` is quantized in blocks along its LAST dimension (the reduction dim).
- Codes are unpacked uint8 0..15: bits 0-2 the E2M1 magnitude index, bit 3 the sign. The sign is the
  float sign bit, so a negative value that rounds to zero gets code 8 (-0), like the hardware `cvt.rn`
  and torchao. The lowest bit is the mantissa bit that TRACE records.
- NVFP4 outer scale is stored in the ENCODE direction: `S_enc = 6*448/amax_outer` (torchao stores the
  decode direction `amax/2688`; TransformerEngine the encode direction). Dequant is `q * s_b / S_enc`.
- Validation (finite input, dtypes, divisibility) lives at the library boundary (`trace.fp4`); these
  functions assume valid float32 input.

Run the oracle's own tests: `python -m pytest tests/fp4 tests/kernels -q`.
"""
from __future__ import annotations

import torch

# E2M1 magnitudes by code 0..7.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
# Midpoints between consecutive codes i and i+1. A tie goes to the even code: stay on i when i is
# even, go up to i+1 when i is odd (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4).
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_FLT_MAX = torch.finfo(torch.float32).max
# smallest amax for which S_enc = 2688/amax is still finite (1.0001x margin against rounding up)
AMAX_MIN = E2M1_MAX * E4M3_MAX / _FLT_MAX * 1.0001


_GRIDS: dict = {}


def _grid(device) -> torch.Tensor:
    # one constant tensor per device: creating it from a Python list is a host-to-device copy, which is
    # not allowed inside a CUDA graph capture (the rollout engine captures its decode steps)
    g = _GRIDS.get(device)
    if g is None:
        g = _GRIDS[device] = torch.tensor(E2M1_GRID, dtype=torch.float32, device=device)
    return g


# ----------------------------------------------------------------------------------------------
# E2M1 element codes
# ----------------------------------------------------------------------------------------------
def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """Round float32 values (already divided by their scale) to E2M1 codes, RNE, saturating at 6."""
    a = v.abs()
    idx = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for i, m in enumerate(_MIDPOINTS):
        idx += (a >= m if i % 2 else a > m).to(torch.uint8)
    return idx | (torch.signbit(v).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 0..15) -> float32 values."""
    mag = _grid(codes.device)[(codes & 7).long()]
    return torch.where((codes & 8).bool(), -mag, mag)


def e2m1_floor_index(a: torch.Tensor) -> torch.Tensor:
    """Largest code index whose grid value is <= a (a >= 0), as uint8 in 0..7 (index the grid with
    `.long()`). One byte per element: the trainer's guided sites call it on [tokens, k, I] expert rows,
    where a [..., 7] comparison tensor and an int64 result took GiBs."""
    idx = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for m in E2M1_GRID[1:]:
        idx += (a >= m).to(torch.uint8)
    return idx


def e2m1_stochastic(v: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Stochastic rounding to E2M1: round up with probability equal to the fractional position
    between the two neighbouring grid points, so E[decode(code)] == v inside [-6, 6]."""
    g = _grid(v.device)
    a = v.abs().clamp(max=E2M1_MAX)
    lo = e2m1_floor_index(a).clamp(max=6).long()
    glo, ghi = g[lo], g[lo + 1]
    p_up = (a - glo) / (ghi - glo)
    u = torch.rand(v.shape, generator=generator, device=v.device, dtype=torch.float32)
    idx = (lo + (u < p_up).long()).to(torch.uint8)
    return idx | (torch.signbit(v).to(torch.uint8) << 3)


def e2m1_guided(v: torch.Tensor, mantissa: torch.Tensor) -> torch.Tensor:
    """TRACE's guided rounding (DESIGN.md §3): of the two grid points bracketing |v|, take the one
    whose mantissa bit (code & 1) equals the recorded bit. Reproduces the recorded code whenever
    |v| lies within one grid step of the recorded value."""
    a = v.abs()
    lo = e2m1_floor_index(a).clamp_(max=6)  # uint8 throughout: this runs on the largest activations
    idx = torch.where((lo & 1) == mantissa.to(torch.uint8), lo, lo + 1)
    return idx | (torch.signbit(v).to(torch.uint8) << 3)


# ----------------------------------------------------------------------------------------------
# Scale bytes
# ----------------------------------------------------------------------------------------------
def e4m3_encode(s: torch.Tensor) -> torch.Tensor:
    """Non-negative float32 -> E4M3 byte, round-to-nearest-even, saturating at 448.
    Clamping before the cast matters: an unclamped cast of a value above 464 gives NaN."""
    return s.clamp(0.0, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_decode(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.float8_e4m3fn).to(torch.float32)


def e8m0_decode(b: torch.Tensor) -> torch.Tensor:
    """E8M0 byte -> 2**(b-127); 0xFF is NaN (OCP MX spec)."""
    v = torch.exp2(b.to(torch.float32) - 127.0)
    return torch.where(b == 255, torch.full_like(v, float("nan")), v)


# ----------------------------------------------------------------------------------------------
# Blocking helpers
# ----------------------------------------------------------------------------------------------
def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)  # [..., K/b, b]


def _tiles_16x16(x: torch.Tensor) -> torch.Tensor:
    *lead, n, k = x.shape
    return x.reshape(*lead, n // 16, 16, k // 16, 16).transpose(-3, -2)  # [..., N/16, K/16, 16, 16]


def expand_scales(scales: torch.Tensor, shape: torch.Size, block: int, block_2d: bool) -> torch.Tensor:
    """Per-block scale values -> per-element tensor of `shape`."""
    if block_2d:
        return scales.repeat_interleave(16, dim=-2).repeat_interleave(16, dim=-1)
    return scales.repeat_interleave(block, dim=-1).reshape(shape)


def outer_amax(x: torch.Tensor, outer: str) -> torch.Tensor:
    """amax over the outer-scale group: 'tensor' -> [], 'row' -> [..., 1], 'expert' -> [E, 1, ..., 1]."""
    a = x.abs()
    if outer == "tensor":
        return a.amax()
    if outer == "row":
        return a.amax(dim=-1, keepdim=True)
    if outer == "expert":
        return a.amax(dim=tuple(range(1, x.dim())), keepdim=True)
    raise ValueError(f"outer must be 'tensor', 'row' or 'expert', got {outer!r}")


def nvfp4_outer_scale(amax: torch.Tensor) -> torch.Tensor:
    """S_enc = 6*448/amax, 1.0 where amax is 0. amax is clamped from below so S_enc stays finite
    (an expert that saw only tiny inputs must not give an infinite scale, DESIGN.md §6a)."""
    amax = amax.to(torch.float32)
    # tensor / tensor: one correctly rounded division on every device (torch evaluates
    # `scalar / tensor` as reciprocal(tensor) * scalar, two roundings)
    s = torch.full_like(amax, E2M1_MAX * E4M3_MAX) / amax.clamp(min=AMAX_MIN)
    return torch.where(amax == 0, torch.ones_like(s), s)


# ----------------------------------------------------------------------------------------------
# NVFP4
# ----------------------------------------------------------------------------------------------
def nvfp4_block_scales(x: torch.Tensor, s_enc: torch.Tensor, block_2d: bool = False) -> torch.Tensor:
    """E4M3 block-scale bytes: s_b = e4m3(min(amax_blk * S_enc / 6, 448)).
    Shape [..., K/16] for 1x16 blocks, [..., N/16, K/16] for 16x16 tiles."""
    if block_2d:
        # per-tensor or per-expert outer scales only, so whole tiles share one S_enc
        amax_blk = _tiles_16x16(x).abs().amax(dim=(-2, -1))
    else:
        amax_blk = _blocks(x, NVFP4_BLOCK).abs().amax(-1)
    # divide by a tensor, not a Python scalar: on CUDA torch turns `t / 6.0` into `t * (1/6)`,
    # which changes about one scale byte in 1000 against the CPU (measured on the H200)
    six = torch.full((), E2M1_MAX, dtype=torch.float32, device=x.device)
    return e4m3_encode(torch.clamp(amax_blk * s_enc / six, max=E4M3_MAX))


def nvfp4_scaled(x: torch.Tensor, scale_bytes: torch.Tensor, s_enc: torch.Tensor, block_2d: bool = False):
    """x * S_enc / s_b per element (0 where s_b is 0), the value that is rounded to E2M1."""
    s_b = expand_scales(e4m3_decode(scale_bytes), x.shape, NVFP4_BLOCK, block_2d)
    zero = s_b == 0
    # divide by a safe scale: `where` after a division by 0 would give 0 * inf = NaN gradients
    v = x * s_enc / torch.where(zero, torch.ones_like(s_b), s_b)
    return torch.where(zero, torch.zeros_like(v), v)


def nvfp4_quantize(
    x: torch.Tensor,
    outer: str = "tensor",
    rounding: str = "rtn",
    block_2d: bool = False,
    generator: torch.Generator | None = None,
    s_enc: torch.Tensor | None = None,
):
    """NVFP4 quantize float32 x [..., K] -> (codes uint8 [..., K], scale bytes, S_enc float32).
    `s_enc` may be passed in (e.g. a precomputed per-tensor scale); otherwise it comes from `outer`."""
    if rounding not in ("rtn", "stochastic"):
        raise ValueError(f"rounding must be 'rtn' or 'stochastic', got {rounding!r}")
    if s_enc is None:
        s_enc = nvfp4_outer_scale(outer_amax(x, outer))
    sb = nvfp4_block_scales(x, s_enc, block_2d)
    v = nvfp4_scaled(x, sb, s_enc, block_2d)
    codes = e2m1_stochastic(v, generator) if rounding == "stochastic" else e2m1_encode(v)
    return codes, sb, s_enc


def nvfp4_dequantize(codes, scale_bytes, s_enc, block_2d: bool = False) -> torch.Tensor:
    s_b = expand_scales(e4m3_decode(scale_bytes), codes.shape, NVFP4_BLOCK, block_2d)
    return e2m1_decode(codes) * s_b / s_enc


# ----------------------------------------------------------------------------------------------
# MXFP4
# ----------------------------------------------------------------------------------------------
def mxfp4_exponent(amax_blk: torch.Tensor, rule: str = "floor") -> torch.Tensor:
    """Unbiased shared exponent per block, int32 in [-127, 127].
    'floor' (OCP): floor(log2(amax)) - 2, may clip the top of the block to 6.
    'noclip': ceil(log2(amax/6)), the smallest e with 6*2**e >= amax.
    Computed exactly from frexp (amax = m*2**f, m in [0.5, 1)). Zero blocks get -127."""
    m, f = torch.frexp(amax_blk)
    fl = f.to(torch.int32) - 1  # floor(log2(amax))
    if rule == "floor":
        e = fl - 2
    elif rule == "noclip":
        # amax in [2**fl, 2**(fl+1)); 6*2**(fl-2) = 1.5*2**fl covers amax iff mantissa m <= 0.75.
        e = torch.where(m <= 0.75, fl - 2, fl - 1)
    else:
        raise ValueError(f"MXFP4 scale rule must be 'floor' or 'noclip', got {rule!r}")
    e = torch.where(amax_blk == 0, torch.full_like(e, -127), e)
    return e.clamp(-127, 127)


def mxfp4_quantize(x: torch.Tensor, rounding: str = "rtn", rule: str = "floor",
                   generator: torch.Generator | None = None):
    """MXFP4 quantize float32 x [..., K] -> (codes uint8 [..., K], E8M0 bytes [..., K/32])."""
    xb = _blocks(x, MXFP4_BLOCK)
    e = mxfp4_exponent(xb.abs().amax(-1), rule)
    sb = (e + 127).to(torch.uint8)
    v = (xb / torch.exp2(e.to(torch.float32)).unsqueeze(-1)).reshape(x.shape)
    if rounding == "rtn":
        codes = e2m1_encode(v)
    elif rounding == "stochastic":
        codes = e2m1_stochastic(v, generator)
    else:
        raise ValueError(f"rounding must be 'rtn' or 'stochastic', got {rounding!r}")
    return codes, sb


def mxfp4_dequantize(codes: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    s = expand_scales(e8m0_decode(scale_bytes), codes.shape, MXFP4_BLOCK, False)
    return e2m1_decode(codes) * s


def mxfp4_scaled(x: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    s = expand_scales(e8m0_decode(scale_bytes), x.shape, MXFP4_BLOCK, False)
    return x / s


# ----------------------------------------------------------------------------------------------
# Packing
# ----------------------------------------------------------------------------------------------
def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] bytes; element 2i in the low nibble, 2i+1 in the high nibble."""
    c = codes.reshape(*codes.shape[:-1], -1, 2)
    return c[..., 0] | (c[..., 1] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """[..., K] 0/1 values -> [..., K/8] bytes; element 8i+j in bit j (LSB first)."""
    b = bits.to(torch.uint8).reshape(*bits.shape[:-1], -1, 8)
    w = (1 << torch.arange(8, dtype=torch.uint8, device=bits.device))
    return (b * w).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    sh = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> sh) & 1).reshape(*packed.shape[:-1], -1)


# ----------------------------------------------------------------------------------------------
# Compute oracles for the kernels
# ----------------------------------------------------------------------------------------------
def fp4_linear(x: torch.Tensor, w_codes, w_scales, w_outer, fmt: str = "nvfp4", act_quant: bool = False,
               block_2d: bool = False) -> torch.Tensor:
    """y = x @ dequant(W)^T in float32, W [N, K]. With act_quant, x is first NVFP4/MXFP4
    fake-quantized per row (W4A4 emulation)."""
    w = nvfp4_dequantize(w_codes, w_scales, w_outer, block_2d) if fmt == "nvfp4" else mxfp4_dequantize(
        w_codes, w_scales)
    x = x.float()
    if act_quant:
        x = fake_quantize_rows(x, fmt)
    return x @ w.T


def fake_quantize_rows(x: torch.Tensor, fmt: str = "nvfp4") -> torch.Tensor:
    """Per-row (batch-invariant) RTN fake quantization, the activation/KV path of DESIGN.md §2."""
    if fmt == "nvfp4":
        c, s, o = nvfp4_quantize(x.float(), outer="row")
        return nvfp4_dequantize(c, s, o)
    c, s = mxfp4_quantize(x.float())
    return mxfp4_dequantize(c, s)


# ----------------------------------------------------------------------------------------------
# Oracles for the grouped MoE and FP4-KV attention kernels (added with the Triton kernels)
# ----------------------------------------------------------------------------------------------
def moe_fp4_reference(x: torch.Tensor, gate, up, down, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      act_quant: bool = False, h_dtype: torch.dtype | None = None) -> torch.Tensor:
    """FP32 oracle of the SiLU-gated MoE expert MLP over NVFP4 weights. gate/up/down are
    (codes, scale bytes, S_enc) with codes [E, I, H] / [E, I, H] / [E, H, I] (1x16 blocks).
    out[t] = sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j].
    act_quant: per-row NVFP4 fake quantization of the gate/up input (per token) and of the down
    input (per token and slot), DESIGN.md §2. h_dtype: round h to it before the down projection (and
    before its quantization), as a kernel that keeps h in the activation dtype does (kernels.moe with a
    BF16 x); without it, an FP4 code of h that sits at a rounding boundary can differ from such a kernel's,
    and at a narrow expert (I = 64) one such code moves the output by ~10%."""
    wg, wu, wd = (nvfp4_dequantize(*t) for t in (gate, up, down))  # [E, I, H], [E, I, H], [E, H, I]
    x = x.float()
    if act_quant:
        x = fake_quantize_rows(x)
    T, k = topk_ids.shape
    out = torch.zeros(T, wd.shape[1], dtype=torch.float32, device=x.device)
    for j in range(k):
        e = topk_ids[:, j].long()
        g = torch.einsum("th,tih->ti", x, wg[e])
        u = torch.einsum("th,tih->ti", x, wu[e])
        h = torch.nn.functional.silu(g) * u
        if h_dtype is not None:
            h = h.to(h_dtype).float()
        if act_quant:
            h = fake_quantize_rows(h)
        out += topk_weights[:, j, None].float() * torch.einsum("ti,thi->th", h, wd[e])
    return out


def kv_dequantize(codes_packed: torch.Tensor, scale_bytes: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """FP4 KV-cache rows -> float32: packed codes [..., D/2], E4M3 scale bytes [..., D/16],
    S_enc [...] (one per token and head) -> [..., D]."""
    return nvfp4_dequantize(unpack_fp4(codes_packed), scale_bytes, s_enc.unsqueeze(-1))


def decode_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor,
                               sm_scale: float | None = None) -> torch.Tensor:
    """FP32 decode attention with GQA and variable lengths: q [B, Hq, D]; k, v [B, L, Hkv, D]
    (already dequantized); sequence b attends to its first seq_lens[b] positions (the decode
    token is the last of them, so this is the causal row). Returns [B, Hq, D]."""
    B, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    scale = sm_scale if sm_scale is not None else D ** -0.5
    out = torch.zeros(B, Hq, D, dtype=torch.float32, device=q.device)
    for b in range(B):
        n = int(seq_lens[b])
        if n == 0:
            continue
        kb = k[b, :n].float().repeat_interleave(G, dim=1)  # [n, Hq, D]
        vb = v[b, :n].float().repeat_interleave(G, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), kb) * scale
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), vb)
    return out


def sample_reference(logits: torch.Tensor, temperature: float, uniforms: torch.Tensor | None = None):
    """The sampler's oracle in float64: logits [A, V] -> (tokens [A], log-probs [A] of them under
    softmax(logits / temperature), all-finite flag). Temperature 0: torch.argmax's token (the first index of the
    maximum), its log-prob at temperature 1. Temperature t > 0 with `uniforms` [A, V] in [0, 1) (a zero read as
    1e-30): the exponential race argmax p / q with q = -log(u) ~ Exp(1) (torch.multinomial's one-sample draw), the
    distribution softmax(logits / t)."""
    z = logits.double() / (temperature if temperature > 0 else 1.0)
    if temperature > 0:
        u = uniforms.double().clamp_min(1e-30)
        tok = (torch.softmax(z, -1) / -torch.log(u)).argmax(-1)
    else:
        tok = logits.float().argmax(-1)
    return tok, torch.log_softmax(z, -1).gather(-1, tok[:, None]).squeeze(-1), bool(torch.isfinite(logits).all())
