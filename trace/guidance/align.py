"""The TRACE alignment term (DESIGN.md §3): pull the trainer's own rounding toward the rollout's.

For each element of a guided site whose own round-to-nearest code, under the RECORDED block scales,
differs in magnitude from the rollout's code, let `d` be the signed distance of the trainer's scaled
value |v| past the rounding boundary into the rollout code's interval, in units of the grid step at
that boundary (d < 0: still on the wrong side). The term is the hinge `relu(margin - d)^2`, averaged
over all flipped elements of the forward:

    total, count = alignment_terms(v, own_codes, target_codes)   # per site, v = x / scales (grad to x)
    loss = alignment_loss(sum of totals, sum of counts)

Its minimum lies `margin` grid steps INSIDE the rollout's interval, so gradient descent carries values
across the boundary and a little beyond; a squared distance to the boundary itself (the earlier form)
has its minimum on the boundary, where round-to-nearest still goes either way, and parks values there.
The boundary is the edge of the rollout code's interval facing the trainer's code, so a flip of
several grid steps is pulled all the way.

Pure functions of tensors; the replay runtime (trace/guidance/replay.py) calls them per site.
Compared against: tests/guidance/test_align.py (hand values; gradient descent on a linear layer's
weights makes its own rounding agree with the recorded rollout's, with and without the margin).
"""
from __future__ import annotations

import torch

from kernels import reference as ref

MARGIN = 0.1  # grid steps past the boundary; ties and the next step's noise stay on the rollout's side


def alignment_terms(scaled: torch.Tensor, own_codes: torch.Tensor, target_codes: torch.Tensor,
                    margin: float = MARGIN) -> tuple[torch.Tensor, torch.Tensor]:
    """scaled [..., K] the trainer's values in grid units under the recorded scales (differentiable);
    own_codes / target_codes [..., K] uint8 FP4 codes (the trainer's RTN of `scaled`, the rollout's).
    Returns (sum over flipped elements of relu(margin - d)^2, their number), both 0-d tensors on the
    device: every element is computed and the unflipped ones are masked out, so nothing waits for the
    device. margin 0 penalizes only the distance still to go to the boundary."""
    own_mag = own_codes.long() & 7
    tgt_mag = target_codes.long() & 7
    flipped = own_mag != tgt_mag  # [..., K]
    grid = torch.tensor(ref.E2M1_GRID, device=scaled.device, dtype=torch.float32)
    a = scaled.abs().float()
    up = tgt_mag > own_mag  # the value must grow in magnitude to reach the rollout's code
    # the target's neighbour facing own (0..7 where flipped: own lies there); any valid code elsewhere
    nb = torch.where(up, tgt_mag - 1, tgt_mag + 1).clamp(0, 7)
    nb = torch.where(flipped, nb, torch.where(tgt_mag == 7, tgt_mag - 1, tgt_mag + 1))
    edge = (grid[tgt_mag] + grid[nb]) / 2  # the boundary of the target's interval facing own
    gap = (grid[tgt_mag] - grid[nb]).abs()  # grid step at that boundary, > 0
    d = torch.where(up, a - edge, edge - a) / gap  # > 0 inside the target's interval
    hinge = torch.where(flipped, torch.relu(margin - d) ** 2, torch.zeros_like(d))
    return hinge.sum(), flipped.sum()


def scale_terms(x: torch.Tensor, own_scales: torch.Tensor, target_scales: torch.Tensor,
                margin: float = MARGIN) -> tuple[torch.Tensor, torch.Tensor]:
    """The same hinge for NVFP4 block scales (1x16 blocks, per-row outer scale). x [..., K] the
    trainer's values (differentiable); own_scales / target_scales [..., K/16] E4M3 bytes (the
    trainer's, the rollout's). A block's unrounded scale is u = amax_blk * S_enc / 6 = 448 *
    amax_blk / amax_row; where its byte differs from the rollout's, d is the distance of u past the
    boundary into the rollout byte's E4M3 interval in units of the E4M3 step there. Returns
    (sum of relu(margin - d)^2 over flipped blocks, their number) as 0-d device tensors (masked, no
    host sync). A flipped scale moves every code of its block, so without this term the trainer's own
    codes keep disagreeing however well the code term aligns the values under the recorded scales."""
    flipped = own_scales != target_scales  # [..., K/16]
    amax_blk = x.float().abs().reshape(*x.shape[:-1], -1, ref.NVFP4_BLOCK).amax(-1)  # [..., K/16]
    u = ref.E4M3_MAX * amax_blk / amax_blk.amax(-1, keepdim=True).clamp(min=1e-30)
    tb, ob = target_scales.long(), own_scales.long()
    up = tb > ob  # positive E4M3 bytes are ordered like their values
    nb = torch.where(up, tb - 1, tb + 1)  # the target's neighbour facing own (a valid byte: own lies there)
    nb = torch.where(flipped, nb, torch.where(tb > 0, tb - 1, tb + 1))  # any other byte where unflipped
    vt, vn = ref.e4m3_decode(tb.to(torch.uint8)), ref.e4m3_decode(nb.to(torch.uint8))
    edge, gap = (vt + vn) / 2, (vt - vn).abs()
    gap = torch.where(flipped, gap, torch.ones_like(gap))
    d = torch.where(up, u - edge, edge - u) / gap
    hinge = torch.where(flipped, torch.relu(margin - d) ** 2, torch.zeros_like(d))
    return hinge.sum(), flipped.sum()


def alignment_loss(total: torch.Tensor | None, count) -> torch.Tensor:
    """Mean over flipped elements; 0 when there were none (count a number or a 0-d tensor)."""
    if total is None:
        return torch.zeros(())
    if isinstance(count, torch.Tensor):
        return total / count.clamp(min=1)
    return total / count if count else total * 0.0
