"""FP4-KV decode attention with the decoded K and V as register operands of mma.sync (Gluon, sm_80+; timed on sm_90).

What: `decode_attention_mma(q, cache, seq_starts, seq_lens, max_len)` computes what `kernels.attention.decode_attention`
computes (same cache, same arguments, same numerics up to the order of fp32 sums) with one warp per (sequence, KV
head, split) and no shared-memory trip for K or V. The Triton kernel decodes each 64-token tile into registers and
moves it through shared memory into the MMA operand layout (ncu at B256 x 1k: 17% occupancy, stalls on that trip,
~8.5 instructions per K/V element: kernels/NOTES.md, "FP4-KV decode attention"). Here each thread loads exactly the
words whose decoded pairs are its own mma.sync fragment registers:
- S^T = K q^T (m16n8k16: 16 keys x the G query rows of the KV head): the A fragment pairs two consecutive k; a
  dot product does not care which d each k stands for, so k is a permutation of d (`k_dim_order`) chosen so that
  thread (g, t) of the warp (g = lane / 4, t = lane % 4) holds keys g and g + 8 and, of each, the 32 elements of
  words 4t .. 4t + 3 (one 16-byte load), paired as the bf16 decode pairs them (elements p, p + 4 of a word); q is
  loaded in the same permuted order, once per program.
- O^T = V^T P^T (m16n8k16: d x query rows, K = 16 keys): the A fragment's rows are d (again a permutation,
  `v_dim_order`, undone by the store's addresses) and its pairs are two keys: thread (g, t) loads keys 2t, 2t + 1,
  2t + 8, 2t + 9 and of each words 2g, 2g + 1 (one NVFP4 block, one 8-byte load); the decode pairs two d of one key,
  so each A register takes halves of two (one byte permute each). P^T goes from S^T's accumulator layout to the B
  fragment through a few bytes of shared memory (16 x 8 bf16 per tile).
`gl.convert_layout(..., assert_trivial=True)` proves at compile time that the decoded tiles move no data between
threads. The per-token factors 2^7 / S_enc scale S^T's rows (K) and P^T's rows (V), as in the Triton kernel.

Compared against: `kernels.reference.decode_attention_reference` (tests/kernels/test_attention_mma.py on a GPU) and
the Triton kernel; timing in benchmarks/bench_kernels.py (`--only attention`, rows fp4kv-mma).
Run: `python -m pytest tests/kernels/test_attention_mma.py -q` (compiles offline for sm_90 on any machine).
"""
from __future__ import annotations

import math

import torch
import triton

from kernels._common import DECODE8_ASM, DECODE8_ORDER, num_sms
from kernels.attention import FP4KVCache, check_decode_args, merge_splits, split_buffers

try:  # Gluon ships with Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
except ImportError:  # pragma: no cover - older Triton
    gluon = None

D_HEAD = 128  # the layouts below: 16 words of 8 codes per (token, head)


def k_dim_order() -> list[int]:
    """The d of each k of S^T = K q^T (k = pair + 2 t + 8 p0 + 16 p1 + 32 w0 + 64 w1 holds element p + 4 pair, p = p0 +
    2 p1, of word 4 t + 2 w1 + w0: `DECODE8_ORDER`'s pairs in thread t's four words)."""
    out = []
    for k in range(D_HEAD):
        pair, t, p0, p1, w0, w1 = k & 1, (k >> 1) & 3, (k >> 3) & 1, (k >> 4) & 1, (k >> 5) & 1, (k >> 6) & 1
        out.append(8 * (4 * t + 2 * w1 + w0) + DECODE8_ORDER[2 * (p0 + 2 * p1) + pair])
    return out


def v_dim_order() -> list[int]:
    """The d of each row m of O^T = V^T P^T (m = g + 8 w0 + 16 pair + 32 p0 + 64 p1 holds element p + 4 pair of word
    2 g + w0)."""
    out = []
    for m in range(D_HEAD):
        g, w0, pair, p0, p1 = m & 7, (m >> 3) & 1, (m >> 4) & 1, (m >> 5) & 1, (m >> 6) & 1
        out.append(8 * (2 * g + w0) + DECODE8_ORDER[2 * (p0 + 2 * p1) + pair])
    return out


if gluon is not None:
    _MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))
    _A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_MMA, k_width=2))
    _B = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=_MMA, k_width=2))

    @triton.constexpr_function
    def _key_bits(T):
        """Register bases of the key dim past one MMA's 16 (T = 32: keys + 16 in more registers)."""
        return [[16, 0]] if T == 32 else []

    @triton.constexpr_function
    def _kw_layout(T, n):
        """K [T keys, n] (n = 16 words or 8 blocks): thread (g, t) holds keys g, g + 8 (+ 16) and words 4t .. 4t + 3
        (blocks 2t, 2t + 1)."""
        col = [[0, 1], [0, 2]] if n == 16 else [[0, 1]]
        lanes = [[0, 4], [0, 8]] if n == 16 else [[0, 2], [0, 4]]
        return gl.DistributedLinearLayout(reg_bases=col + [[8, 0]] + _key_bits(T),
                                          lane_bases=lanes + [[1, 0], [2, 0], [4, 0]], warp_bases=[], block_bases=[],
                                          shape=[T, n])

    @triton.constexpr_function
    def _vw_layout(T, n):
        """V [T keys, n] (16 words or 8 blocks): thread (g, t) holds keys 2t, 2t + 1, 2t + 8, 2t + 9 (+ 16) and words
        2g, 2g + 1 (block g)."""
        col = [[0, 1]] if n == 16 else []
        lanes = [[0, 2], [0, 4], [0, 8]] if n == 16 else [[0, 1], [0, 2], [0, 4]]
        return gl.DistributedLinearLayout(reg_bases=col + [[1, 0], [8, 0]] + _key_bits(T),
                                          lane_bases=[[2, 0], [4, 0]] + lanes, warp_bases=[], block_bases=[],
                                          shape=[T, n])

    @gluon.jit
    def _decode(w, sblock, wl: gl.constexpr):
        """words int32 [T, 16] (layout wl) and their blocks' E4M3 scale bytes [T, 8] -> the 8 outputs of
        `DECODE8_ASM` (slot j = 2 p + pair holds element p + 4 pair), each value * s_b * 2^-7 in bf16. A block's
        scale is converted once for its two words."""
        sc = (sblock.to(gl.float8e4nv, bitcast=True).to(gl.float32) * 6.646139978924579e35).to(gl.bfloat16)  # 2^119
        sc = gl.convert_layout(gl.reshape(gl.join(sc, sc), [w.shape[0], 16]), wl, assert_trivial=True)
        return gl.inline_asm_elementwise(DECODE8_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [w, sc],
                                         dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)

    @gluon.jit
    def _k_operand(w, sblock, T: gl.constexpr):
        """K words [T, 16] and blocks [T, 8] -> the A operand [T keys, 128 k] of S^T = K q^T (`k_dim_order`)."""
        s0, s1, s2, s3, s4, s5, s6, s7 = _decode(w, sblock, _kw_layout(T, 16))
        # join(a, b) adds a last dim: [key, word, pair, p0, p1]
        v = gl.join(gl.join(gl.join(s0, s1), gl.join(s2, s3)), gl.join(gl.join(s4, s5), gl.join(s6, s7)))
        v = gl.reshape(v, [T, 4, 2, 2, 2, 2, 2])  # [key, t, w1, w0, pair, p0, p1]
        v = gl.permute(v, (0, 2, 3, 6, 5, 1, 4))  # [key, w1, w0, p1, p0, t, pair]
        return gl.convert_layout(gl.reshape(v, [T, 128]), _A, assert_trivial=True)

    @gluon.jit
    def _v_operand(w, sblock, T: gl.constexpr):
        """V words [T, 16] and blocks [T, 8] -> the A operand [128 m, T keys] of O^T = V^T P^T (`v_dim_order`)."""
        s0, s1, s2, s3, s4, s5, s6, s7 = _decode(w, sblock, _vw_layout(T, 16))
        v = gl.join(gl.join(gl.join(s0, s1), gl.join(s2, s3)), gl.join(gl.join(s4, s5), gl.join(s6, s7)))
        v = gl.reshape(v, [T, 8, 2, 2, 2, 2])  # [key, g, w0, pair, p0, p1]
        v = gl.permute(v, (5, 4, 3, 2, 1, 0))  # [p1, p0, pair, w0, g, key]
        return gl.convert_layout(gl.reshape(v, [128, T]), _A, assert_trivial=True)

    @gluon.jit
    def _load_step(kp_ptr, ks_ptr, vp_ptr, vs_ptr, kf_ptr, vf_ptr, row, left, offs):
        """A step's K / V words, scale blocks and per-token factors from cache row `row` on, keys past `left` masked
        (zero words decode to 0, factors 1); offs: the int32 offsets and key indices of each tensor's layout."""
        kw_o, ks_o, vw_o, vs_o, f_o, kr, ksr, vr, vsr, sr = offs
        kw = gl.load(kp_ptr + row * 16 + kw_o, mask=(kr < left)[:, None], other=0)
        ksb = gl.load(ks_ptr + row * 8 + ks_o, mask=(ksr < left)[:, None], other=0)
        vw = gl.load(vp_ptr + row * 16 + vw_o, mask=(vr < left)[:, None], other=0)
        vsb = gl.load(vs_ptr + row * 8 + vs_o, mask=(vsr < left)[:, None], other=0)
        kf = gl.load(kf_ptr + row + f_o, mask=sr < left, other=1.0)
        vf = gl.load(vf_ptr + row + f_o, mask=sr < left, other=1.0)
        return kw, ksb, vw, vsb, kf, vf

    @gluon.jit
    def _decode_attn_mma_kernel(q_ptr, kp_ptr, ks_ptr, kf_ptr, vp_ptr, vs_ptr, vf_ptr, starts_ptr, lens_ptr,
                                o_ptr, lse_ptr, qk_scale, Hq, Hkv, per_split, NSPLIT,
                                G: gl.constexpr, GP: gl.constexpr, T: gl.constexpr, PREFETCH: gl.constexpr,
                                DIRECT: gl.constexpr):
        """Grid (B, Hkv, splits), one warp: the G query rows of KV head h of sequence b over the split's tokens, T keys
        a step (the next step's words loaded before this one is decoded); online softmax in fp32 (log2 domain) over
        the columns of S^T."""
        D: gl.constexpr = 128
        b = gl.program_id(0)
        h = gl.program_id(1)
        sp = gl.program_id(2)
        L = gl.load(lens_ptr + b)
        base = gl.load(starts_ptr + b).to(gl.int64) * Hkv + h  # cache row (slot, head) of the sequence's first token
        n_lo = sp * per_split
        n_hi = gl.minimum(L, n_lo + per_split)
        # q^T [128 k, GP rows] as the B operand, in k_dim_order
        kk = gl.arange(0, D, layout=gl.SliceLayout(1, _B))
        dk = 8 * (4 * ((kk >> 1) & 3) + 2 * ((kk >> 6) & 1) + ((kk >> 5) & 1)) + ((kk >> 3) & 1) + 2 * ((kk >> 4) & 1) \
            + 4 * (kk & 1)
        rq = gl.arange(0, GP, layout=gl.SliceLayout(0, _B))
        qh = h * G + rq
        qt = gl.load(q_ptr + (b * Hq + qh)[None, :].to(gl.int64) * D + dk[:, None], mask=(rq < G)[None, :], other=0.0)
        qt = qt.to(gl.bfloat16)
        KW: gl.constexpr = _kw_layout(T, 16)
        KS: gl.constexpr = _kw_layout(T, 8)
        VW: gl.constexpr = _vw_layout(T, 16)
        VS: gl.constexpr = _vw_layout(T, 8)
        # int32 offsets of a step's words, blocks and factors from the step's first cache row (a sequence spans < 2^31
        # rows); the step's first row advances as a scalar
        kr = gl.arange(0, T, layout=gl.SliceLayout(1, KW))
        kw_o = (kr * Hkv * 16)[:, None] + gl.arange(0, 16, layout=gl.SliceLayout(0, KW))[None, :]
        ksr = gl.arange(0, T, layout=gl.SliceLayout(1, KS))
        ks_o = (ksr * Hkv * 8)[:, None] + gl.arange(0, 8, layout=gl.SliceLayout(0, KS))[None, :]
        vr = gl.arange(0, T, layout=gl.SliceLayout(1, VW))
        vw_o = (vr * Hkv * 16)[:, None] + gl.arange(0, 16, layout=gl.SliceLayout(0, VW))[None, :]
        vsr = gl.arange(0, T, layout=gl.SliceLayout(1, VS))
        vs_o = (vsr * Hkv * 8)[:, None] + gl.arange(0, 8, layout=gl.SliceLayout(0, VS))[None, :]
        sr = gl.arange(0, T, layout=gl.SliceLayout(1, _MMA))  # keys of S^T's rows (and P^T's)
        f_o = sr * Hkv
        row = base + n_lo * Hkv  # int64: the step's first cache row
        left = n_hi - n_lo  # keys of the split from the step's first
        offs = (kw_o, ks_o, vw_o, vs_o, f_o, kr, ksr, vr, vsr, sr)
        if PREFETCH:
            kw, ksb, vw, vsb, kf, vf = _load_step(kp_ptr, ks_ptr, vp_ptr, vs_ptr, kf_ptr, vf_ptr, row, left, offs)
        m_i = gl.full([GP], -float("inf"), gl.float32, layout=gl.SliceLayout(0, _MMA))
        l_i = gl.zeros([GP], gl.float32, layout=gl.SliceLayout(0, _MMA))
        acc = gl.zeros([D, GP], gl.float32, layout=_MMA)  # O^T
        for n0 in range(n_lo, n_hi, T):
            if PREFETCH:  # the next step's loads first (past the split: masked, nothing read)
                row += T * Hkv
                nl = n_hi - n0 - T  # keys of the split from the next step's first
                kw_n, ksb_n, vw_n, vsb_n, kf_n, vf_n = _load_step(kp_ptr, ks_ptr, vp_ptr, vs_ptr, kf_ptr, vf_ptr, row, nl,
                                                                  offs)
            else:  # this step's loads; the other warps on the SM hide their latency
                kw, ksb, vw, vsb, kf, vf = _load_step(kp_ptr, ks_ptr, vp_ptr, vs_ptr, kf_ptr, vf_ptr, row, n_hi - n0,
                                                      offs)
                row += T * Hkv
            s = mma_v2(_k_operand(kw, ksb, T), qt, gl.zeros([T, GP], gl.float32, layout=_MMA))  # S^T [T keys, GP]
            s = s * ((128.0 / kf) * qk_scale)[:, None]  # log2 domain
            s = gl.where((sr < n_hi - n0)[:, None], s, -float("inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=0))
            m_safe = gl.where(m_new == -float("inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(s - m_safe[None, :])
            l_i = l_i * alpha + gl.sum(p, axis=0)
            pv = (p * (128.0 / vf)[:, None]).to(gl.bfloat16)
            acc = mma_v2(_v_operand(vw, vsb, T), gl.convert_layout(pv, _B), acc * alpha[None, :])
            m_i = m_new
            if PREFETCH:
                kw, ksb, vw, vsb, kf, vf = kw_n, ksb_n, vw_n, vsb_n, kf_n, vf_n
        o = acc / gl.where(l_i == 0.0, 1.0, l_i)[None, :]
        om = gl.arange(0, D, layout=gl.SliceLayout(1, _MMA))
        dm = 8 * (2 * (om & 7) + ((om >> 3) & 1)) + ((om >> 5) & 1) + 2 * ((om >> 6) & 1) + 4 * ((om >> 4) & 1)
        ro = gl.arange(0, GP, layout=gl.SliceLayout(0, _MMA))
        qo = h * G + ro
        gm = (ro < G)[None, :]
        if DIRECT:  # o_ptr: the output [B, Hq, D] in q's dtype
            gl.store(o_ptr + (b * Hq + qo)[None, :].to(gl.int64) * D + dm[:, None], o.to(o_ptr.dtype.element_ty),
                     mask=gm)
        else:
            lse = gl.where(l_i == 0.0, -float("inf"), m_i + gl.log2(gl.where(l_i == 0.0, 1.0, l_i)))
            ob = (b * Hq + qo) * NSPLIT + sp  # rows of o [B, Hq, NSPLIT, D]
            gl.store(o_ptr + ob[None, :].to(gl.int64) * D + dm[:, None], o, mask=gm)
            gl.store(lse_ptr + ob, lse, mask=ro < G)


def applies(head_dim: int, groups: int) -> bool:
    """Whether the kernel takes a model's attention: head dim 128, at most 16 query heads per KV head."""
    return head_dim == D_HEAD and groups <= 16


def default_splits(B: int, Hkv: int, max_len: int, device) -> int:
    """Splits of the context toward ~8 one-warp programs per SM, never past that, each split >= 256 tokens: at B256 x
    Hkv4 x 1k (1,024 programs) one split takes 121.0 us, 2 145.6, 3 148.8; at B64 x 8k 4 splits (1,024 programs)
    223.7, 8 242.8, 9 227.6, 2 357.0 (H200, 16 keys a step; kernels/NOTES.md, "FP4-KV decode attention")."""
    want = max(1, (8 * num_sms(device)) // max(1, B * Hkv))
    return max(1, min(want, triton.cdiv(max(max_len, 1), 256)))


def decode_attention_mma(q: torch.Tensor, cache: FP4KVCache, seq_starts: torch.Tensor, seq_lens: torch.Tensor,
                         max_len: int, *, sm_scale: float | None = None, num_splits: int | None = None,
                         keys_per_step: int = 32, prefetch: bool = False, maxnreg: int | None = None,
                         check_finite: bool = True) -> torch.Tensor:
    """`kernels.attention.decode_attention` on the register-operand kernel: q [B, Hq, D] (D = 128, Hq / Hkv <= 16)
    -> [B, Hq, D] in q's dtype. CUDA only. keys_per_step: keys a loop step loads and multiplies (16 or 32; 32: twice the
    loads in flight per warp, 242 registers offline against 164, still 8 one-warp programs per SM, as `default_splits`
    aims for; at the default splits 102.5 against 120.6 us at B256 x 1k and 185.2 against 224.4 at B64 x 8k on the
    H200: kernels/NOTES.md, "FP4-KV decode attention"). prefetch: the next step's loads issued before this step's math.
    maxnreg: the compiler's register cap per thread (None: its choice; 128 spills and is slower at both sizes)."""
    if gluon is None:
        raise RuntimeError("decode_attention_mma needs Gluon (Triton >= 3.5)")
    B, Hq, Hkv, D = check_decode_args(q, cache, seq_starts, seq_lens, max_len, check_finite)
    if not applies(D, Hq // Hkv):
        raise ValueError(f"decode_attention_mma takes head dim {D_HEAD} and <= 16 query heads per KV head, got "
                         f"{D} and {Hq // Hkv}")
    G = Hq // Hkv
    GP = max(8, triton.next_power_of_2(G))
    if num_splits is None:
        num_splits = default_splits(B, Hkv, max_len, q.device)
    if keys_per_step not in (16, 32):
        raise ValueError(f"keys_per_step must be 16 or 32, got {keys_per_step}")
    q = q.contiguous()
    per_split, num_splits, out, o_part, lse = split_buffers(q, max_len, num_splits, keys_per_step)
    if B == 0:
        return out
    direct = num_splits == 1
    scale = (sm_scale if sm_scale is not None else D ** -0.5) * math.log2(math.e)
    _decode_attn_mma_kernel[(B, Hkv, num_splits)](
        q, cache.k_packed.view(torch.int32), cache.k_scales, cache.k_outer, cache.v_packed.view(torch.int32),
        cache.v_scales, cache.v_outer, seq_starts, seq_lens, o_part, lse, scale, Hq, Hkv, per_split, num_splits,
        G=G, GP=GP, T=keys_per_step, PREFETCH=prefetch, DIRECT=direct,
        num_warps=1, **({"maxnreg": maxnreg} if maxnreg else {}))
    return merge_splits(o_part, lse, out)
