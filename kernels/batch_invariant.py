"""Batch-invariant mode of the engine's kernels: every row's result independent of how many rows share the call.

What: the configs and the few kernels with which the rollout engine's forward (trace/rollout, `batch_invariant=True`)
computes each token row the same way whether it is one of 1 or 10,000 rows in a call, a decode step's row or a
position of a full-sequence prefill. That is what lets a trainer forward on the same kernels reproduce the
rollout's log-probs bit for bit (DESIGN.md §4, "Exact on-policy arm").

A row's result changes with the batch only where the reduction that produces it changes: a split-K or K-tile chosen
by the row count, a kernel switch by size (GEMV below a crossover, MMA above), an attention split count chosen by
the batch, a torch reduction whose thread layout follows the shape, or a different code path for prefill and decode.
This mode fixes each of them:
  - dense FP4 GEMM: `gemm_config(N, K)`, the MMA tile with BM 64 (16 in the interpreter), one split, the K-tile of
    the default at large M, whatever M is (`kernels.gemm.fp4_linear(config=...)`; never the GEMV kernels);
  - routed experts: `fused_moe_bi`, the MMA tile with the block rows the default picks at 256 tokens
    (`kernels.moe.mma_moe_config(MOE_REFERENCE_TOKENS, k, E)`) for every T, and the sum over a token's k slots as
    k - 1 elementwise adds in slot order (a torch reduction's order can follow the shape);
  - attention over the FP4 KV cache: `attention`, the decode kernel with one split and a fixed key tile for every
    query; a full sequence is its positions as decode queries (each of length position + 1), so a decode step and
    the same query inside a prefill run the same program over the same tiles;
  - unquantized linears (router, shared-expert gate, lm_head): `linear`, a plain tiled GEMM with fixed tiles and
    FP32 accumulation in K order;
  - log-probs of given tokens: `token_logprobs`, one program per row with a block size set by the vocabulary only,
    for the sampled token in the rollout and for every target in the trainer;
  - elementwise transcendental ops of the engine's forward (SiLU product of the dense / shared-expert MLP, the shared
    expert's sigmoid gate): `silu_mul`, `sigmoid`, so the CPU interpreter computes them like the GPU, per element.
The activation quantize (one row per program, per-row outer scale, DESIGN.md §2), the norms and RoPE
(`kernels/norm.py`) and the routing (`kernels/routing.py`) are one program per row already.

The default mode's configs are untouched; this module only chooses among the existing kernels' parameters and adds
the kernels above. Cost (predictions, not measured): no split-K for small decode batches (the dense GEMM's default
splits K while fewer than ~4 waves of CTAs run), a 64-row tile where the default takes 16 at <= 16 rows, one
attention split (the default's split count only changes below ~4 x SMs (sequence, KV head) programs) and the Triton
attention where the default takes the register-operand Gluon kernel; at batch 256 the dense and MoE tiles equal the
default's (BM 64, no split; the MoE's BM is the default's at 256 tokens).

Compared against: tests/kernels/test_batch_invariant.py (each kernel: rows bitwise equal across row counts, decode
equal to prefill, and within kernels/reference.py's tolerances).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import INTERPRET, check_tensor, round_as
from kernels.attention import FP4KVCache, decode_attention
from kernels.gemm import GemmConfig, PreparedFP4Weight, fp4_linear, quantize_act_for_gemm
from kernels.moe import MoEConfig, MoEWeights, mma_moe_config, moe_align, moe_gemm

# The MoE tile's block rows are the default's at this many tokens (the rollout benchmark's batch), for every T.
MOE_REFERENCE_TOKENS = 256


def gemm_config(N: int, K: int) -> GemmConfig:
    """The dense FP4 GEMM config of this mode: a function of the weight's shape only (here a constant): the MMA tile,
    one split, BM 64 (the default's at > 32 rows); the interpreter's small tile there."""
    if INTERPRET:  # large tiles: the interpreter's time goes with the number of programs
        return GemmConfig(BN=64, BM=64, BKW=8, split=1, num_warps=1, num_stages=1)
    return GemmConfig(BN=64, BM=64, BKW=16, split=1, num_warps=4, num_stages=3, bf16_decode=True, dot_order=True)


def moe_config(E: int, k: int) -> MoEConfig:
    """The MoE config of this mode for E experts of top-k, whatever the number of tokens."""
    if INTERPRET:
        return MoEConfig(BM=32, BN=64, BKW=8, num_warps=1, num_stages=1, BN_down=64)
    return mma_moe_config(MOE_REFERENCE_TOKENS, k, E)


def attention_block() -> int:
    """Keys per tile of this mode's attention (the default decode attention's)."""
    return 16 if INTERPRET else 64


def fp4_linear_bi(x: torch.Tensor, w: PreparedFP4Weight, on_quant=None) -> torch.Tensor:
    """W4A4 x [M, K] @ W^T in this mode (`kernels.gemm.fp4_linear` at `gemm_config`)."""
    return fp4_linear(x, w, act_quant=True, config=gemm_config(w.N, w.K), check_finite=False, on_quant=on_quant)


def sum_slots(y: torch.Tensor) -> torch.Tensor:
    """y [T, k, H] -> sum over the k slots [T, H] in fp32, slot 0 first: elementwise adds, the same order for
    every T."""
    acc = y[:, 0].float()
    for j in range(1, y.shape[1]):
        acc = acc + y[:, j].float()
    return acc


def fused_moe_bi(x: torch.Tensor, w: MoEWeights, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 on_quant=None) -> torch.Tensor:
    """W4A4 routed experts in this mode: `kernels.moe.fused_moe(act_quant=True)`'s MMA path at `moe_config`, the
    slots summed by `sum_slots`. on_quant(which, QuantizedRows) as in fused_moe."""
    check_tensor(x, "x", (torch.bfloat16, torch.float16, torch.float32), dim=2)
    T, H = x.shape
    k = topk_ids.shape[1]
    if T == 0:
        return torch.zeros_like(x)
    cfg = moe_config(w.E, k)
    x = x.contiguous()
    slots, blocks = moe_align(topk_ids, w.E, cfg.BM)
    S = T * k
    rw = topk_weights.reshape(-1).to(torch.float32)
    kw = dict(BM=cfg.BM, BKW=cfg.BKW, num_warps=cfg.num_warps, num_stages=cfg.num_stages, bf16_decode=cfg.bf16_decode,
              out_dtype=x.dtype, tma=cfg.tma, dot_order=cfg.dot_order)
    seen = (lambda which: None) if on_quant is None else (lambda which: (lambda q: on_quant(which, q)))
    xq, xf = quantize_act_for_gemm(x, check_finite=False, on_quant=seen("gate_up"))
    h = moe_gemm(xq, w.w13, slots, blocks, S, a_div=k, gated=True, a_factor=xf, BN=cfg.BN, **kw)
    hq, hf = quantize_act_for_gemm(h, check_finite=False, on_quant=seen("down"))
    y = moe_gemm(hq, w.w2, slots, blocks, S, a_div=1, gated=False, route_w=rw, a_factor=hf, BN=cfg.BN_down, **kw)
    return sum_slots(y.view(T, k, H)).to(x.dtype)


def attention(q: torch.Tensor, cache: FP4KVCache, seq_starts: torch.Tensor, seq_lens: torch.Tensor,
              max_len: int) -> torch.Tensor:
    """q [Q, Hq, D] -> [Q, Hq, D]: query i against the first seq_lens[i] tokens stored from slot seq_starts[i] on,
    one split and `attention_block()` keys per tile (`kernels.attention.decode_attention`). Queries are independent
    programs, so a prefill passes each position as a query with its own length."""
    return decode_attention(q, cache, seq_starts, seq_lens, max_len, num_splits=1, block_n=attention_block(),
                            check_finite=False)


# ----------------------------------------------------------------------------------------------
# Unquantized linear (router, shared-expert gate, lm_head)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, sxm, swn, HAS_B: tl.constexpr, IEEE: tl.constexpr,
                   INTERP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mm = offs_m < M
    nm = offs_n < N
    acc = tl.zeros([BM, BN], tl.float32)
    k0 = 0
    while k0 < K:  # (the interpreter takes no tensor trip count in range())
        offs_k = k0 + tl.arange(0, BK)
        km = offs_k < K
        a = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * sxm + offs_k[None, :], mask=mm[:, None] & km[None, :],
                    other=0.0)
        b = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * swn + offs_k[:, None], mask=nm[None, :] & km[:, None],
                    other=0.0)
        if INTERP:
            # the interpreter's tl.dot is numpy's matmul, whose BLAS kernel (OPENBLAS_CORETYPE, the row's place in
            # the tile) sets the order of the sum; products summed over the tile's K axis have one order for every row
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        elif IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        k0 += BK
    if HAS_B:
        acc = acc + tl.load(b_ptr + offs_n, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mm[:, None] & nm[None, :])


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T (+ bias) -> [..., N] in x's dtype, FP32 accumulation over K in tiles of a fixed size
    (64 x 64 x 64 on a GPU, 16 x 16 x 16 in the interpreter) whatever the number of rows."""
    check_tensor(x, "x", (torch.bfloat16, torch.float16, torch.float32))
    check_tensor(w, "w", (x.dtype,), dim=2)
    K = x.shape[-1]
    N = w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"x has K={K}, w is {tuple(w.shape)}")
    x2 = x.reshape(-1, K).contiguous()
    w = w.contiguous()
    M = x2.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        b = 16 if INTERPRET else 64
        ieee = INTERPRET or x.dtype == torch.float32
        _linear_kernel[(triton.cdiv(M, b), triton.cdiv(N, b))](
            x2, w, bias if bias is not None else w, out, M, N, K, x2.stride(0), w.stride(0), HAS_B=bias is not None,
            IEEE=ieee, INTERP=INTERPRET, BM=b, BN=b, BK=b, num_warps=1 if INTERPRET else 4)
    return out.view(*x.shape[:-1], N)


# ----------------------------------------------------------------------------------------------
# Log-probs of given tokens
# ----------------------------------------------------------------------------------------------
@triton.jit
def _logprob_kernel(x_ptr, stride, tok_ptr, out_ptr, V, scale2, BLOCK: tl.constexpr):
    """Program r: log_softmax(x[r] / t)[tok[r]] with scale2 = log2(e) / t: per slot a running max and rescaled sum
    of 2^(z log2 e) over the row's blocks, one reduction over the slots at the end."""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    start = 0
    while start < V:
        offs = start + tl.arange(0, BLOCK)
        z = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * scale2
        m_new = tl.maximum(m, z)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp2(m - m_safe) + tl.exp2(z - m_safe)
        m = m_new
        start += BLOCK
    mm = tl.max(m, axis=0)
    ss = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp2(m - mm)), axis=0)
    zt = tl.load(base + tl.load(tok_ptr + row)).to(tl.float32) * scale2
    tl.store(out_ptr + row, (zt - mm - tl.log2(ss)) * 0.6931471805599453)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits [A, V] (fp32 / bf16 / fp16), tokens [A] int -> log_softmax(logits / temperature)[a, tokens[a]] [A] fp32,
    one program per row, blocks of min(4096, next_pow2(V)) elements: the same value for a row whatever else is in
    the call. temperature > 0 (the engine reports greedy samples at 1)."""
    check_tensor(logits, "logits", (torch.float32, torch.bfloat16, torch.float16), dim=2)
    check_tensor(tokens, "tokens", (torch.int32, torch.int64), dim=1)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    A, V = logits.shape
    if tokens.shape[0] != A:
        raise ValueError(f"tokens has {tokens.shape[0]} entries, logits {A} rows")
    out = torch.empty(A, dtype=torch.float32, device=logits.device)
    if A:
        _logprob_kernel[(A,)](logits, logits.stride(0), tokens.contiguous(), out, V, 1.4426950408889634 / temperature,
                              BLOCK=max(16, min(4096, triton.next_power_of_2(V))), num_warps=1 if INTERPRET else 8)
    return out


# ----------------------------------------------------------------------------------------------
# Elementwise ops with transcendentals
# ----------------------------------------------------------------------------------------------
@triton.jit
def _elementwise_kernel(a_ptr, b_ptr, out_ptr, n, OP: tl.constexpr, INTERP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(a_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if OP == 0:  # silu(a) * b, each rounded to the dtype as torch's two ops round
        y = round_as(a / (1.0 + tl.exp(-a)), out_ptr, INTERP)
        y = round_as(y * tl.load(b_ptr + offs, mask=m, other=0.0).to(tl.float32), out_ptr, INTERP)
    else:  # sigmoid(a)
        y = 1.0 / (1.0 + tl.exp(-a))
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=m)


def _elementwise(a: torch.Tensor, b: torch.Tensor | None, op: int) -> torch.Tensor:
    check_tensor(a, "a", (torch.bfloat16, torch.float16, torch.float32))
    a = a.contiguous()
    if b is not None:
        if b.shape != a.shape or b.dtype != a.dtype:
            raise ValueError(f"b {tuple(b.shape)} {b.dtype} must match a {tuple(a.shape)} {a.dtype}")
        b = b.contiguous()
    out = torch.empty_like(a)
    n = a.numel()
    if n:
        blk = 1024
        _elementwise_kernel[(triton.cdiv(n, blk),)](a, b if b is not None else a, out, n, OP=op, INTERP=INTERPRET,
                                                    BLOCK=blk)
    return out


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u elementwise (the gated MLP's product), the same per element wherever it sits in the tensor."""
    return _elementwise(g, u, 0)


def sigmoid(a: torch.Tensor) -> torch.Tensor:
    """sigmoid(a) elementwise (the shared expert's gate)."""
    return _elementwise(a, None, 1)


__all__ = ["MOE_REFERENCE_TOKENS", "attention", "attention_block", "fp4_linear_bi", "fused_moe_bi", "gemm_config",
           "linear", "moe_config", "sigmoid", "silu_mul", "sum_slots", "token_logprobs"]
