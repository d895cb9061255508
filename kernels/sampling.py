"""One pass over a decode step's logits: the sampled token, its log-probability and an all-finite flag.

What: the rollout engine's sampling (`trace.rollout.engine.RolloutEngine.sample`) as one Triton program per row
reading the logits once in their own dtype: a running max and rescaled sum of exponentials (the log-softmax
normalizer) beside a running argmax of the selection key. Greedy (temperature 0): the key is the logit, so the token
is torch.argmax's (the first index of the row's maximum) and the log-prob that of log_softmax at temperature 1.
Sampling (temperature t > 0): the key is z + g with z = logit / t and g a Gumbel draw per element (-log(-log u),
u uniform in (0, 1) from Philox, `tl.rand4x`, keyed by `seed`, one counter per 4 elements): the Gumbel-max trick draws exactly from
softmax(z), the distribution torch's exponential race (argmax p / q, q ~ Exp(1)) draws from, with other random
numbers; the log-prob is log_softmax(z) at the token. The torch path makes ~5 (greedy) to ~10 passes over the
[rows, vocabulary] fp32 copy of the logits (0.56 ms per step at 256 x 151,936 on the H200: kernels/NOTES.md,
"Sampling").
Nucleus sampling (top_p < 1) stays on the torch path.

Numerics: the exponentials and logarithms are Triton's (`tl.exp`, `tl.log`: a few ulp), so log-probs agree with
torch.log_softmax to ~1e-6 relative, not bit for bit; greedy tokens are exact (a max over the same fp32 values).

Compared against: `kernels.reference.sample_reference` (torch: argmax / log_softmax; the Gumbel keys from the same
uniforms); tests/kernels/test_sampling.py (interpreter and GPU); timed in benchmarks/bench_kernels.py (`--only
sampling`, beside the engine's torch path).
Run: `TRITON_INTERPRET=1 python -m pytest tests/kernels/test_sampling.py -q`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import INTERPRET, check_tensor


@triton.jit
def _block_uniforms(seed, row, V4, start, BLOCK: tl.constexpr):
    """The uniforms [BLOCK] in [0, 1) of row `row`, elements start .. start + BLOCK (start a multiple of 4): one
    Philox call (`tl.rand4x`, counter row * V4 + i) gives elements 4i .. 4i + 3, a quarter of `tl.rand`'s work."""
    i = start // 4 + tl.arange(0, BLOCK // 4)
    u0, u1, u2, u3 = tl.rand4x(seed, row * V4 + i)
    return tl.reshape(tl.join(tl.join(u0, u2), tl.join(u1, u3)), [BLOCK])  # element 4i + c <- u_c[i]


@triton.jit
def _lg2(x, ASM: tl.constexpr):
    """log2(x) for x > 0: on a GPU the MUFU's `lg2.approx.f32` (~2^-22 relative), where `tl.log2` compiles to ~12
    FMAs; the interpreter's numpy log2 otherwise."""
    if ASM:
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return tl.log2(x)


@triton.jit
def _sample_block(base, start, V, V4, scale2, seed, row, m, s, best, best_s, bad, MASKED: tl.constexpr,
                  GREEDY: tl.constexpr, ASM: tl.constexpr, BLOCK: tl.constexpr):
    """One block of the row, elements start .. start + BLOCK, into the per-slot state (see `_sample_kernel`);
    MASKED: the row's last, partial block."""
    offs = tl.arange(0, BLOCK)
    if MASKED:
        inb = start + offs < V
        x = tl.load(base + start + offs, mask=inb, other=float("-inf")).to(tl.float32)  # [BLOCK]
        bad += tl.where(inb, x - x, 0.0)
    else:
        x = tl.load(base + start + offs).to(tl.float32)
        bad += x - x  # 0 for a finite x, NaN for inf or NaN: stays NaN
    z2 = x * scale2  # z * log2(e)
    hi = tl.maximum(m, z2)
    e = tl.exp2(tl.minimum(m, z2) - hi)  # 2^(-|m - z2|); 0 for a masked element
    s = tl.where(hi == float("-inf"), s, tl.where(z2 > m, s * e + 1.0, s + e))
    if GREEDY:
        key = x  # the logits themselves: z2 could round two neighbours to one value
    else:
        u = _block_uniforms(seed, row, V4, start, BLOCK)  # [BLOCK] in [0, 1)
        u = tl.where(u > 0.0, u, 1e-30)  # (0, 1); u = 0 has probability ~2^-31
        key = z2 - _lg2(-_lg2(u, ASM), ASM)
        if MASKED:
            key = tl.where(inb, key, float("-inf"))
    take = key > best  # strict: a slot keeps its earliest index of a tie
    return hi, s, tl.where(take, key, best), tl.where(take, start, best_s), bad


@triton.jit
def _sample_kernel(x_ptr, stride, V, V4, inv_t, seed, tok_ptr, lp_ptr, bad_ptr, GREEDY: tl.constexpr,
                   ASM: tl.constexpr, BLOCK: tl.constexpr):
    """Program r: row r of x [rows, V] -> tok[r], lp[r], bad[r] (> 0 where a logit is not finite). Each of the BLOCK
    slots keeps its own running max, sum of exponentials, best key and the block it came from over the row's blocks
    (one exponential per element: the larger of the slot's max and the new value is the new max); one reduction over
    the slots at the end, none per block. Keys in log2 units (z * log2(e) - log2(-log2(u))): the same argmax as
    z - log(-log(u))."""
    LOG2E: tl.constexpr = 1.4426950408889634
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride
    scale2 = LOG2E * inv_t
    m = tl.full([BLOCK], float("-inf"), tl.float32)  # per slot: max of z * log2(e)
    s = tl.zeros([BLOCK], tl.float32)  # per slot: sum of 2^(z * log2(e) - m)
    best = tl.full([BLOCK], float("-inf"), tl.float32)  # per slot: best key
    best_s = tl.zeros([BLOCK], tl.int32)  # per slot: the start of its block
    bad = tl.zeros([BLOCK], tl.float32)  # per slot: 0 while its logits are finite, else NaN
    full = V // BLOCK * BLOCK
    start = 0
    while start < full:
        m, s, best, best_s, bad = _sample_block(base, start, V, V4, scale2, seed, row, m, s, best, best_s, bad,
                                                False, GREEDY, ASM, BLOCK)
        start += BLOCK
    if full < V:
        m, s, best, best_s, bad = _sample_block(base, full, V, V4, scale2, seed, row, m, s, best, best_s, bad,
                                                True, GREEDY, ASM, BLOCK)
    # the slots together: the row's max and normalizer, the best key's first index
    mm = tl.max(m, axis=0)
    ss = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp2(m - mm)), axis=0)
    bk = tl.max(best, axis=0)
    bi = tl.min(tl.where(best == bk, best_s + tl.arange(0, BLOCK), V), axis=0)
    zt = tl.load(base + bi).to(tl.float32) * scale2
    tl.store(tok_ptr + row, bi.to(tl.int64))
    tl.store(lp_ptr + row, (zt - mm - tl.log2(ss)) * 0.6931471805599453)  # log2 -> natural log
    tl.store(bad_ptr + row, tl.sum((bad != 0.0).to(tl.int32), axis=0))  # NaN != 0


@triton.jit
def _uniforms_kernel(u_ptr, V, V4, seed, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    start = tl.program_id(1) * BLOCK
    idx = start + tl.arange(0, BLOCK)
    tl.store(u_ptr + row.to(tl.int64) * V + idx, _block_uniforms(seed, row, V4, start, BLOCK), mask=idx < V)


def sampler_uniforms(A: int, V: int, seed: int, device) -> torch.Tensor:
    """The uniforms [A, V] in [0, 1) that `fused_sample(logits [A, V], t > 0, seed)` draws its Gumbel keys from (same
    Philox key and counters): for its oracle (`kernels.reference.sample_reference`)."""
    u = torch.empty(A, V, dtype=torch.float32, device=device)
    if A and V:
        _uniforms_kernel[(A, triton.cdiv(V, 1024))](u, V, triton.cdiv(V, 4), int(seed) & (2**62 - 1), BLOCK=1024)
    return u


def fused_sample(logits: torch.Tensor, temperature: float, seed: int = 0, *, block: int = 4096,
                 num_warps: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [A, V] (fp32 / bf16 / fp16, rows contiguous) -> (tokens [A] int64, log-probs [A] fp32 under
    softmax(logits / temperature) (temperature 0: greedy, log-probs at temperature 1), all-finite flag [] bool),
    on the logits' device, without a host synchronisation. seed: the Philox key of this call's Gumbel draws (its low 62 bits; elements
    (r, 4i .. 4i + 3) take counter r * ceil(V / 4) + i, unique while A * V / 4 < 2^32); the same seed and logits give
    the same tokens. block: elements per loop step (a power of two >= 4)."""
    check_tensor(logits, "logits", (torch.float32, torch.bfloat16, torch.float16), dim=2)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    A, V = logits.shape
    tok = torch.empty(A, dtype=torch.int64, device=logits.device)
    lp = torch.empty(A, dtype=torch.float32, device=logits.device)
    bad = torch.empty(A, dtype=torch.int32, device=logits.device)
    if A:
        greedy = temperature == 0
        _sample_kernel[(A,)](logits, logits.stride(0), V, triton.cdiv(V, 4), 1.0 if greedy else 1.0 / temperature,
                             int(seed) & (2**62 - 1),
                             tok, lp, bad, GREEDY=greedy, ASM=not INTERPRET, BLOCK=max(4, min(block, triton.next_power_of_2(V))),
                             num_warps=num_warps)
    return tok, lp, bad.eq(0).all()
