"""The MoE router's softmax, top-k and renormalisation in one launch (vLLM's `topk_softmax` op does the same in CUDA).

What: `topk_softmax(logits [N, E], k, renorm, out_dtype)` -> (weights [N, k] out_dtype, ids [N, k] int64): the
softmax over the experts in float32, the k largest probabilities in descending order (ties to the lower expert id),
divided by their sum with `renorm` (Mixtral always, the others per `norm_topk_prob`), then cast to out_dtype. One program per
token row; the top k are k rounds of max + first index. In torch (`trace/rollout/forward.py` `_moe`) this was a
float cast, a softmax, a top-k (radix-select kernels), a sum, a division and a cast per MoE layer and step.

Numerics: `tl.exp` and a tree sum in place of torch's expf and reduction order: probabilities within ~1e-6
relative of torch's, so the chosen experts are torch's except where two probabilities lie that close (a near-tie
that either choice is as right about); the engine records the ids it routed by, so a rollout's replay never
depends on which.

Compared against: the torch ops (softmax, topk, sum) in tests/kernels/test_routing.py (interpreter; GPU where
present); timed in benchmarks/bench_kernels.py `--only fused`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import INTERPRET, check_tensor, round_as


@triton.jit
def _topk_softmax_kernel(l_ptr, v_ptr, i_ptr, E, K: tl.constexpr, EB: tl.constexpr, KB: tl.constexpr,
                         RENORM: tl.constexpr, INTERP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, EB)
    x = tl.load(l_ptr + row * E + offs, mask=offs < E, other=float("-inf")).to(tl.float32)  # [EB]
    e = tl.exp(x - tl.max(x, axis=0))
    p = e / tl.sum(e, axis=0)  # softmax; padding lanes 0
    p = tl.where(offs < E, p, -1.0)  # never chosen
    kk = tl.arange(0, KB)
    vals = tl.zeros([KB], dtype=tl.float32)
    ids = tl.zeros([KB], dtype=tl.int64)
    for j in tl.static_range(K):
        best = tl.max(p, axis=0)
        bi = tl.min(tl.where(p == best, offs, EB), axis=0)  # the first expert holding the maximum
        vals = tl.where(kk == j, best, vals)
        ids = tl.where(kk == j, bi.to(tl.int64), ids)
        p = tl.where(offs == bi, -2.0, p)
    if RENORM:
        vals = vals / tl.sum(vals, axis=0)  # lanes >= K hold 0
    out = kk < K
    tl.store(v_ptr + row * K + kk, round_as(vals, v_ptr, INTERP).to(v_ptr.dtype.element_ty), mask=out)
    tl.store(i_ptr + row * K + kk, ids, mask=out)


def topk_softmax(logits: torch.Tensor, k: int, renorm: bool, out_dtype: torch.dtype = torch.float32):
    """logits [N, E] (any float dtype) -> (weights [N, k] out_dtype, expert ids [N, k] int64), as
    softmax(logits.float()) -> topk -> (/ sum if renorm) -> .to(out_dtype)."""
    check_tensor(logits, "logits", (torch.bfloat16, torch.float16, torch.float32), dim=2)
    N, E = logits.shape
    if not 1 <= k <= E:
        raise ValueError(f"k must lie in [1, {E}], got {k}")
    logits = logits.contiguous()
    vals = torch.empty(N, k, dtype=out_dtype, device=logits.device)
    ids = torch.empty(N, k, dtype=torch.int64, device=logits.device)
    if N:
        EB = triton.next_power_of_2(E)
        _topk_softmax_kernel[(N,)](logits, vals, ids, E, K=k, EB=EB, KB=triton.next_power_of_2(k), RENORM=renorm,
                                   INTERP=INTERPRET, num_warps=1 if EB <= 256 else 4)
    return vals, ids
