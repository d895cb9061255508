"""FP4 (NVFP4) KV cache: Triton store kernel and split-K decode-attention kernel (GQA, variable lengths).

What: `FP4KVCache` holds K and V as packed E2M1 codes [slots, Hkv, D/2], E4M3 block-scale bytes
[slots, Hkv, D/16] and one FP32 encode scale S_enc per (token, head) [slots, Hkv] (DESIGN.md §2:
per-token-and-head outer scale, so the cache is batch-invariant). `kv_store` quantizes new K/V rows
into given slots (the quantize kernel of `kernels.quantize` with a scatter of output rows).
`decode_attention` computes one decode query per sequence: q [B, Hq, D] against the first
seq_lens[b] cached tokens of sequence b, stored at slots seq_starts[b] + 0..len-1 (the decode token
is the last, so the causal mask is the length mask). Flash-decoding: grid (B, Hkv, splits), each
program serves all Hq/Hkv query heads of its KV head over one chunk of the context, dequantizing
K and V tiles in registers (whole int32 words of codes per thread, `kernels._common.dequant_tile_words`,
in bf16 by inline PTX on a GPU; per-token 2^7/S_enc folded into the scores for K and into the
probabilities for V), online softmax in FP32, BF16 MMA; with more than one split a second small kernel merges them by their
log-sum-exp. Tiles of at least 32 tokens on a GPU (16 computed wrong there; kernels/NOTES.md, "FP4-KV decode attention").

Compared against: `kernels.reference.decode_attention_reference` over `kv_dequantize`d caches
(tests/kernels/test_attention.py); timing vs BF16 SDPA in benchmarks/bench_kernels.py.
Run: `python -m pytest tests/kernels/test_attention.py -q`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._common import INTERPRET, check_tensor, dequant_tile_words, num_sms
from kernels.quantize import QuantizedRows, quantize_rows


@dataclass
class FP4KVCache:
    k_packed: torch.Tensor  # [S, Hkv, D/2] uint8
    k_scales: torch.Tensor  # [S, Hkv, D/16] uint8 (E4M3)
    k_outer: torch.Tensor  # [S, Hkv] fp32 S_enc
    v_packed: torch.Tensor
    v_scales: torch.Tensor
    v_outer: torch.Tensor

    @staticmethod
    def allocate(num_slots: int, num_kv_heads: int, head_dim: int, device) -> "FP4KVCache":
        if head_dim % 16:
            raise ValueError(f"head_dim {head_dim} must be a multiple of 16")
        S, H, D = num_slots, num_kv_heads, head_dim
        u8 = dict(dtype=torch.uint8, device=device)
        return FP4KVCache(torch.zeros(S, H, D // 2, **u8), torch.zeros(S, H, D // 16, **u8),
                          torch.ones(S, H, dtype=torch.float32, device=device),
                          torch.zeros(S, H, D // 2, **u8), torch.zeros(S, H, D // 16, **u8),
                          torch.ones(S, H, dtype=torch.float32, device=device))

    @property
    def shape(self):
        S, H, D2 = self.k_packed.shape
        return S, H, 2 * D2

    def nbytes_per_token(self) -> int:
        S, H, D = self.shape
        return 2 * H * (D // 2 + D // 16 + 4)


def kv_store(cache: FP4KVCache, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, check_finite: bool = True,
             record=None):
    """Quantize k, v [T, Hkv, D] (per token and head NVFP4, RTN) into cache slots [T] (int32/int64).
    record: (sink of k, sink of v), `kernels.quantize.RecordSink`s (either None): the store's launches also
    write the record form of the T*Hkv rows (row t*Hkv + h) at the sinks' current step."""
    S, H, D = cache.shape
    for name, t in (("k", k), ("v", v)):
        check_tensor(t, name, (torch.bfloat16, torch.float16, torch.float32), dim=3, finite=check_finite)
        if t.shape[1:] != (H, D):
            raise ValueError(f"{name} must be [T, {H}, {D}], got {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    check_tensor(slots, "slots", (torch.int32, torch.int64), dim=1)
    T = k.shape[0]
    if slots.shape[0] != T:
        raise ValueError(f"slots has {slots.shape[0]} entries, k has {T} tokens")
    if check_finite and T and (int(slots.min()) < 0 or int(slots.max()) >= S):
        raise ValueError(f"slots must lie in [0, {S})")
    dst = (slots.to(torch.int64)[:, None] * H + torch.arange(H, device=k.device)).reshape(-1)  # [T*H] rows
    sinks = (None, None) if record is None else record
    for x, p, s, o, r in ((k, cache.k_packed, cache.k_scales, cache.k_outer, sinks[0]),
                          (v, cache.v_packed, cache.v_scales, cache.v_outer, sinks[1])):
        quantize_rows(x.reshape(T * H, D), "nvfp4", out=QuantizedRows(p, s, o, None, "nvfp4"), dst_rows=dst,
                      check_finite=False, record=r)


@triton.jit
def _dequant_rows(pw, sp, fp, rows, rmask, D: tl.constexpr, BLOCK_N: tl.constexpr, INTERP: tl.constexpr):
    """Dequantize cache rows -> ([BLOCK_N, D] = q * s_b * 2^-7, [BLOCK_N] factor 2^7/S_enc). pw / sp / fp:
    the codes as int32 words [rows, D/8], the scale bytes and the factors, from the sequence's first row on;
    rows: int32 offsets from it (a sequence spans < 2^31 words: no 64-bit address arithmetic per element).
    Each thread decodes whole words (`kernels._common.dequant_tile_words`), on a GPU in bf16 by inline PTX
    (the MMA operand's dtype, the same values), in the interpreter in fp32."""
    offs_w = tl.arange(0, D // 8)
    offs_s = tl.arange(0, D // 16)
    wp = pw + rows[:, None] * (D // 8) + offs_w[None, :]
    scp = sp + rows[:, None] * (D // 16) + offs_s[None, :]
    if INTERP:
        vals = dequant_tile_words(wp, scp, rmask[:, None], rmask[:, None], BLOCK_N, D)
    else:
        vals = dequant_tile_words(wp, scp, rmask[:, None], rmask[:, None], BLOCK_N, D, True)
    f = tl.load(fp + rows, mask=rmask, other=1.0)
    return vals, 128.0 / f


@triton.jit
def _decode_attn_kernel(q_ptr, kp_ptr, ks_ptr, kf_ptr, vp_ptr, vs_ptr, vf_ptr, starts_ptr, lens_ptr,
                        o_ptr, lse_ptr, qk_scale, Hq, Hkv, per_split, NSPLIT,
                        G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                        NIT: tl.constexpr, INTERP: tl.constexpr, DIRECT: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    L = tl.load(lens_ptr + b)
    base = tl.load(starts_ptr + b).to(tl.int64) * Hkv + h  # cache row of the sequence's first token, head h
    kp_ptr += base * (D // 8)
    ks_ptr += base * (D // 16)
    kf_ptr += base
    vp_ptr += base * (D // 8)
    vs_ptr += base * (D // 16)
    vf_ptr += base
    offs_g = tl.arange(0, GP)
    gmask = offs_g < G
    offs_d = tl.arange(0, D)
    qh = h * G + offs_g  # [GP] query heads
    q = tl.load(q_ptr + (b * Hq + qh)[:, None] * D + offs_d[None, :], mask=gmask[:, None], other=0.0)  # [GP, D]
    q = q.to(tl.float32)
    if not INTERP:
        q = q.to(tl.bfloat16)
    m_i = tl.full([GP], -float("inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    n_lo = sp * per_split
    # the split's tiles that hold any of the row's L tokens: a row shorter than the launch's max_len (the engine's
    # 256-slot graph bucket, other rows' lengths) decodes no tile past its end
    # (the interpreter takes no tensor trip count: it runs all NIT, the tiles past L fully masked, the same values)
    nit = tl.cdiv(tl.minimum(tl.maximum(L - n_lo, 0), NIT * BLOCK_N), BLOCK_N)
    for it in range(NIT if INTERP else nit):
        offs_n = n_lo + it * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < L
        rows = offs_n * Hkv  # cache rows (slot, head) from the sequence's first
        kd, kf = _dequant_rows(kp_ptr, ks_ptr, kf_ptr, rows, nmask, D, BLOCK_N, INTERP)
        if INTERP:
            s = tl.dot(q, tl.trans(kd), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(kd.to(tl.bfloat16)))
        s = s * (kf * qk_scale)[None, :]  # [GP, BN], log2 domain
        s = tl.where(nmask[None, :], s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vd, vf = _dequant_rows(vp_ptr, vs_ptr, vf_ptr, rows, nmask, D, BLOCK_N, INTERP)
        pv = p * vf[None, :]
        if INTERP:
            acc = acc * alpha[:, None] + tl.dot(pv, vd, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(pv.to(tl.bfloat16), vd.to(tl.bfloat16))
        m_i = m_new
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if DIRECT:  # one split: o_ptr is the output [B, Hq, D] in q's dtype, nothing to merge
        tl.store(o_ptr + (b * Hq + qh)[:, None] * D + offs_d[None, :], o.to(o_ptr.dtype.element_ty), mask=gmask[:, None])
    else:
        lse = tl.where(l_i == 0.0, -float("inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        ob = (b * Hq + qh) * NSPLIT + sp  # [GP] rows of o [B, Hq, NSPLIT, D]
        tl.store(o_ptr + ob[:, None] * D + offs_d[None, :], o, mask=gmask[:, None])
        tl.store(lse_ptr + ob, lse, mask=gmask)


@triton.jit
def _combine_kernel(o_ptr, lse_ptr, out_ptr, NSPLIT, SP: tl.constexpr, D: tl.constexpr):
    r = tl.program_id(0)  # (b, hq)
    offs_s = tl.arange(0, SP)
    smask = offs_s < NSPLIT
    lse = tl.load(lse_ptr + r * NSPLIT + offs_s, mask=smask, other=-float("inf"))  # [SP]
    mx = tl.max(lse, axis=0)
    mx = tl.where(mx == -float("inf"), 0.0, mx)
    w = tl.exp2(lse - mx)  # 0 for empty splits
    tot = tl.sum(w, axis=0)
    offs_d = tl.arange(0, D)
    o = tl.load(o_ptr + (r * NSPLIT + offs_s)[:, None] * D + offs_d[None, :], mask=smask[:, None], other=0.0)
    res = tl.sum(o * w[:, None], axis=0) / tl.where(tot == 0.0, 1.0, tot)
    tl.store(out_ptr + r * D + offs_d, res.to(out_ptr.dtype.element_ty))


def check_decode_args(q: torch.Tensor, cache: FP4KVCache, seq_starts: torch.Tensor, seq_lens: torch.Tensor,
                      max_len: int, check_finite: bool) -> tuple[int, int, int, int]:
    """A decode attention's arguments (shared with kernels/attention_mma.py) -> (B, Hq, Hkv, D); the lengths against
    the cache only with check_finite (it syncs)."""
    S, Hkv, D = cache.shape
    check_tensor(q, "q", (torch.bfloat16, torch.float16, torch.float32), dim=3, finite=check_finite)
    B, Hq, Dq = q.shape
    if Dq != D:
        raise ValueError(f"q head dim {Dq} != cache head dim {D}")
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    for name, t in (("seq_starts", seq_starts), ("seq_lens", seq_lens)):
        check_tensor(t, name, (torch.int32, torch.int64), dim=1)
        if t.shape[0] != B:
            raise ValueError(f"{name} must have {B} entries")
    if check_finite and B and (int(seq_lens.max()) > max_len or int(seq_lens.min()) < 0
                               or int((seq_starts + seq_lens).max()) > S):
        raise ValueError("seq_lens must be in [0, max_len] and seq_starts + seq_lens <= cache slots")
    return B, Hq, Hkv, D


def split_buffers(q: torch.Tensor, max_len: int, num_splits: int, step: int):
    """The context cut into num_splits chunks of whole steps (tiles of `step` tokens) -> (per_split, num_splits (the
    chunks that hold a token), out [B, Hq, D] in q's dtype, o_part, lse). With one split the kernel writes `out`
    itself (o_part and lse are out: no fp32 partials, no merge launch, 7.7 us a layer at B256 x 1k on the H200,
    Nsight Compute); with more, o_part [B, Hq, splits, D] and lse [B, Hq, splits] in fp32 for `merge_splits`."""
    B, Hq, D = q.shape
    per_split = triton.cdiv(triton.cdiv(max(max_len, 1), num_splits), step) * step
    num_splits = triton.cdiv(max(max_len, 1), per_split)
    out = torch.empty_like(q)
    if num_splits == 1:
        return per_split, num_splits, out, out, out
    return (per_split, num_splits, out, torch.empty((B, Hq, num_splits, D), dtype=torch.float32, device=q.device),
            torch.empty((B, Hq, num_splits), dtype=torch.float32, device=q.device))


def merge_splits(o_part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out <- the splits' partial outputs weighted by their log-sum-exps (nothing to do with one split)."""
    if o_part is not out:
        B, Hq, n, D = o_part.shape
        _combine_kernel[(B * Hq,)](o_part, lse, out, n, SP=max(2, triton.next_power_of_2(n)), D=D)
    return out


def decode_attention(q: torch.Tensor, cache: FP4KVCache, seq_starts: torch.Tensor, seq_lens: torch.Tensor,
                     max_len: int, *, sm_scale: float | None = None, num_splits: int | None = None,
                     block_n: int | None = None, num_warps: int = 4, num_stages: int | None = None,
                     maxnreg: int | None = None, check_finite: bool = True) -> torch.Tensor:
    """q [B, Hq, D] (bf16/fp16/fp32) -> [B, Hq, D] in q's dtype. seq_starts/seq_lens int [B]; max_len
    >= max(seq_lens) (a host int, so the launch needs no sync). num_stages: the K/V loads' cp.async stages
    (Triton's software pipeline; default Triton's, 3 on sm_90). maxnreg: the compiler's register cap per thread
    (PTX .maxnreg; None: its choice, ~154 at the 64-token tile, which leaves room for 3 programs per SM:
    kernels/NOTES.md, "FP4-KV decode attention")."""
    B, Hq, Hkv, D = check_decode_args(q, cache, seq_starts, seq_lens, max_len, check_finite)
    if D & (D - 1) or D < 16:
        raise ValueError(f"head dim must be a power of two >= 16, got {D}")
    G = Hq // Hkv
    GP = max(16, triton.next_power_of_2(G))
    bn = block_n or (16 if INTERPRET else 64)
    if not INTERPRET and bn < 32:
        # Measured on an H200 (Triton 3.6): with 16-token tiles the compiled kernel returns wrong outputs
        # (relative error ~1 at every head dim, split count and num_warps tried; 32, 64 and 128 agree with
        # the oracle to ~1.5e-3). kernels/NOTES.md, "FP4-KV decode attention".
        raise ValueError(f"block_n must be >= 32 on a GPU, got {bn}")
    if num_splits is None:
        sms = num_sms(q.device)
        if B * Hkv < sms:  # programs leave SMs idle: 2 per SM
            want = triton.cdiv(2 * sms, max(1, B * Hkv))
            num_splits = max(1, min(want, triton.cdiv(max(max_len, 1), 4 * bn)))
        elif B * Hkv < 4 * sms:
            # ~1,024 programs where each split keeps >= 2,048 tokens: at B64 x Hkv4 x 8k 4 splits took 306.5 / 308.6 us,
            # 1 split 332.3 / 327.1, 2 splits 329.7 (H200, the split sweep of kernels/NOTES.md); contexts up to 2,048 keep one (the
            # engine's batch 64 at <= 1.5k was timed with one)
            want = 1 << max(0, (1024 // (B * Hkv)).bit_length() - 1)
            num_splits = max(1, min(want, triton.cdiv(max(max_len, 1), 2048)))
        else:  # B256 x Hkv4 x 1k: 1 split 159.6 us, 2 splits 166.0 (H200)
            num_splits = 1
    q = q.contiguous()
    per_split, num_splits, out, o_part, lse = split_buffers(q, max_len, num_splits, bn)
    if B == 0:
        return out
    direct = num_splits == 1
    scale = (sm_scale if sm_scale is not None else D ** -0.5) * math.log2(math.e)
    _decode_attn_kernel[(B, Hkv, num_splits)](
        q, cache.k_packed.view(torch.int32), cache.k_scales, cache.k_outer,  # codes as words [S, Hkv, D/8]
        cache.v_packed.view(torch.int32), cache.v_scales, cache.v_outer,
        seq_starts, seq_lens, o_part, lse, scale, Hq, Hkv, per_split, num_splits,  # int32 or int64, read as given
        G=G, GP=GP, D=D, BLOCK_N=bn, NIT=per_split // bn, INTERP=INTERPRET, DIRECT=direct, num_warps=num_warps,
        maxnreg=maxnreg, **({} if num_stages is None else {"num_stages": num_stages}))
    return merge_splits(o_part, lse, out)
