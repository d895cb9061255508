"""Expert alignment of routed MoE slots for the grouped GEMMs of kernels/moe.py: the T*k (token, expert) slots
sorted by expert (stable) and each expert's run padded to a multiple of BM, in Triton with no host sync, so that
it can live in a CUDA graph (`moe_align`). Up to ALIGN_ONE_PROGRAM_MAX_SLOTS slots one program walks the slots in
64-slot chunks against all experts; above, a count, an offsets and a scatter launch, chunk-parallel.

Compared against: a torch oracle (stable argsort by expert, padded) in tests/kernels/test_moe.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _chunk_onehot(ids_ptr, c, S, EB: tl.constexpr, CS: tl.constexpr):
    """Slots [c*CS, (c+1)*CS) -> (their ids s [CS], one-hot experts [CS, EB] int32; rows past S all zero)."""
    s = c * CS + tl.arange(0, CS)
    e = tl.load(ids_ptr + s, mask=s < S, other=-1).to(tl.int32)
    return s, (e[:, None] == tl.arange(0, EB)[None, :]).to(tl.int32)


@triton.jit
def _chunk_scatter(slots_ptr, s, hot, first, S):
    """Each slot of a chunk to its expert's next destination `first` [EB] plus its rank among the chunk's
    earlier slots of that expert (stable)."""
    before = tl.cumsum(hot, axis=0) - hot + first[None, :]
    tl.store(slots_ptr + tl.sum(hot * before, axis=1), s, mask=s < S)


@triton.jit
def _fill_padding(slots_ptr, S, P, n_p, CS: tl.constexpr):
    """All P sorted slots point at row S (padding) before the scatter overwrites the real ones."""
    c = 0
    while c < n_p:  # run-time bounds: the interpreter cannot range() over them
        p = c * CS + tl.arange(0, CS)
        tl.store(slots_ptr + p, tl.full([CS], 0, tl.int32) + S, mask=p < P)
        c += 1


@triton.jit
def _block_experts(bexp_ptr, pend, E, P, n_b, BM: tl.constexpr, EB: tl.constexpr, CB: tl.constexpr):
    """Expert of each BM-slot block: how many experts' padded runs end at or before its start (-1 past
    the used blocks)."""
    pend_e = tl.where(tl.arange(0, EB) < E, pend, 2147483647)
    c = 0
    while c < n_b:
        b = c * CB + tl.arange(0, CB)
        be = tl.sum((pend_e[None, :] <= (b * BM)[:, None]).to(tl.int32), axis=1)
        tl.store(bexp_ptr + b, tl.where(be < E, be, -1), mask=b < P // BM)
        c += 1


@triton.jit
def _moe_align_kernel(ids_ptr, slots_ptr, bexp_ptr, S, E, P, n_s, n_p, n_b, BM: tl.constexpr, EB: tl.constexpr,
                      CS: tl.constexpr, CB: tl.constexpr):
    """One program: counting sort of the S slots by expert (stable), each expert's run padded to BM."""
    counts = tl.zeros([EB], tl.int32)
    c = 0
    while c < n_s:  # pass 1: slots per expert
        _, hot = _chunk_onehot(ids_ptr, c, S, EB, CS)
        counts += tl.sum(hot, axis=0)
        c += 1
    padded = (counts + BM - 1) // BM * BM
    pend = tl.cumsum(padded, axis=0)  # [EB] end of each expert's padded run
    _fill_padding(slots_ptr, S, P, n_p, CS)
    tl.debug_barrier()  # the fill above lands before the scatter below (same addresses, other threads)
    first = pend - padded  # [EB] next destination of each expert
    c = 0
    while c < n_s:  # pass 2: rank of each slot within its expert = earlier slots of that expert
        s, hot = _chunk_onehot(ids_ptr, c, S, EB, CS)
        _chunk_scatter(slots_ptr, s, hot, first, S)
        first += tl.sum(hot, axis=0)
        c += 1
    _block_experts(bexp_ptr, pend, E, P, n_b, BM, EB, CB)


@triton.jit
def _align_count_kernel(ids_ptr, hist_ptr, S, EB: tl.constexpr, CS: tl.constexpr):
    """Program c: how many of the slots [c*CS, (c+1)*CS) go to each expert -> hist[c, :] ([chunks, EB])."""
    c = tl.program_id(0)
    _, hot = _chunk_onehot(ids_ptr, c, S, EB, CS)
    tl.store(hist_ptr + c * EB + tl.arange(0, EB), tl.sum(hot, axis=0))


@triton.jit
def _align_offsets_kernel(hist_ptr, slots_ptr, bexp_ptr, S, E, P, n_c, n_p, n_b, BM: tl.constexpr,
                          EB: tl.constexpr, CG: tl.constexpr, CS: tl.constexpr, CB: tl.constexpr):
    """One program: the experts' padded runs from the chunk histograms, each chunk's first destination per
    expert (hist[c, e] <- pstart[e] + slots of expert e in chunks before c, in place), the padding fill and
    the expert of each block."""
    e_ar = tl.arange(0, EB)
    counts = tl.zeros([EB], tl.int32)
    c = 0
    while c < n_c:  # groups of CG chunks
        r = c + tl.arange(0, CG)
        counts += tl.sum(tl.load(hist_ptr + r[:, None] * EB + e_ar[None, :], mask=(r < n_c)[:, None], other=0), axis=0)
        c += CG
    padded = (counts + BM - 1) // BM * BM
    pend = tl.cumsum(padded, axis=0)
    carry = pend - padded  # [EB] next destination of each expert
    c = 0
    while c < n_c:
        r = c + tl.arange(0, CG)
        ptrs = hist_ptr + r[:, None] * EB + e_ar[None, :]
        h = tl.load(ptrs, mask=(r < n_c)[:, None], other=0)  # [CG, EB]
        tl.store(ptrs, tl.cumsum(h, axis=0) - h + carry[None, :], mask=(r < n_c)[:, None])
        carry += tl.sum(h, axis=0)
        c += CG
    _fill_padding(slots_ptr, S, P, n_p, CS)  # the scatter, a later launch, overwrites the real slots
    _block_experts(bexp_ptr, pend, E, P, n_b, BM, EB, CB)


@triton.jit
def _align_scatter_kernel(ids_ptr, offs_ptr, slots_ptr, S, EB: tl.constexpr, CS: tl.constexpr):
    """Program c: each slot of chunk c to its chunk's first destination for its expert plus its rank among
    the chunk's earlier slots of that expert (stable)."""
    c = tl.program_id(0)
    s, hot = _chunk_onehot(ids_ptr, c, S, EB, CS)
    _chunk_scatter(slots_ptr, s, hot, tl.load(offs_ptr + c * EB + tl.arange(0, EB)), S)


# Up to this many slots (T*k) `moe_align` sorts in one program (one launch: a few microseconds at decode
# sizes); above, chunk-parallel in three launches. The one program walks the slots in 64-slot chunks
# against all experts, which took 83 us for Qwen3-30B-A3B at T=256 (2,048 slots, 128 experts; H200, the
# `routing-align` row of results/kernels/kernels.csv): 18% of the W4A4 MoE layer's time there.
ALIGN_ONE_PROGRAM_MAX_SLOTS = 256


def moe_align(topk_ids: torch.Tensor, E: int, BM: int):
    """Sort the T*k slots by expert (stable), pad each expert's run to a multiple of BM.
    Returns sorted_slots int32 [P] (slot = t*k + j; padding = T*k) and block_expert int32 [P/BM]
    (-1 for blocks past the used ones). P = the worst case, so no host sync is needed (CUDA graphs)."""
    T, k = topk_ids.shape
    S = T * k
    dev = topk_ids.device
    P = triton.cdiv(S + E * (BM - 1), BM) * BM
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    sorted_slots = torch.empty((P,), dtype=torch.int32, device=dev)
    block_expert = torch.empty((P // BM,), dtype=torch.int32, device=dev)
    EB, CS = max(16, triton.next_power_of_2(E)), 64
    if S <= ALIGN_ONE_PROGRAM_MAX_SLOTS:
        _moe_align_kernel[(1,)](ids, sorted_slots, block_expert, S, E, P, triton.cdiv(S, CS), triton.cdiv(P, CS),
                                triton.cdiv(P // BM, 64), BM=BM, EB=EB, CS=CS, CB=64, num_warps=4)
        return sorted_slots, block_expert
    n_c = triton.cdiv(S, CS)
    hist = torch.empty((n_c, EB), dtype=torch.int32, device=dev)  # per chunk counts, then first destinations
    _align_count_kernel[(n_c,)](ids, hist, S, EB=EB, CS=CS, num_warps=4)
    _align_offsets_kernel[(1,)](hist, sorted_slots, block_expert, S, E, P, n_c, triton.cdiv(P, CS),
                                triton.cdiv(P // BM, 64), BM=BM, EB=EB, CG=16, CS=CS, CB=64, num_warps=4)
    _align_scatter_kernel[(n_c,)](ids, hist, sorted_slots, S, EB=EB, CS=CS, num_warps=4)
    return sorted_slots, block_expert
