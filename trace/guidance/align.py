"""The TRACE alignment term (DESIGN.md §3): pull the trainer's own rounding toward the rollout's.

Items are the guided elements' FP4 codes and, for NVFP4, their 1x16 block scales. An item is flipped
where the trainer's own round-to-nearest (a code under the RECORDED block scales, or a scale byte)
differs in magnitude from the rollout's. For a flipped item let `d` be the signed distance of the
trainer's unrounded value past the rounding boundary into the rollout's interval, in units of the grid
step at that boundary (d < 0: still on the wrong side), and r = relu(margin - max(d, -CAP)) the distance
still to go to a point `margin` steps inside, capped at CAP = 1 grid step past the boundary. The item's
hinge is r^2 (0 for an unflipped item), and the term is the MEAN OVER ALL GUIDED ITEMS:

    term = (sum of code hinges + sum of block-scale hinges) / (guided elements + guided blocks)

    total, items, flipped = alignment_terms(v, own_codes, target_codes)   # per site, v = x / scales
    total, items, flipped = scale_terms(x, own_scales, target_scales)     # NVFP4 block scales
    loss = alignment_loss(sum of totals, sum of items)

Why this form (DESIGN.md §3 gives the numbers):
- A mean over all guided items, not over flipped ones: each flipped item weighs the same, whatever the
  number of flips, so the term's gradient grows with the amount of disagreement instead of
  concentrating 1/(number of flips) on the few items of a well-aligned model.
- The cap: an item further than one grid step from the rollout's interval counts (1 + margin)^2 and
  pulls no more (no gradient); every hinge lies in [0, (1 + margin)^2], so the term does too. Such an
  item is one guided rounding cannot reproduce (codes) or one whose block amax differs from the
  rollout's by more than an E4M3 step (scales): nudging it across takes a large change of the
  activation, which would fight the policy loss.
- A block scale counts as one item, like one element: its hinge is a function of one activation (the
  block's amax, relative to the row's), so its gradient moves one value, as a code's does. Weighted by
  its 16 elements instead, the scale part would be 16x a code's pull on the block's amax element and
  most of the term by construction; as it is, at most 1/17 of the items are scales.
The minimum lies `margin` grid steps INSIDE the rollout's interval, so gradient descent carries values
across the boundary and a little beyond (a squared distance to the boundary itself has its minimum on
the boundary, where round-to-nearest still goes either way, and parks values there). The boundary is
the edge of the rollout's interval facing the trainer's code, so a flip of several grid steps is pulled
toward that edge (at the capped strength).

Pure functions of tensors; the replay runtime (trace/guidance/replay.py) calls them per site, the
replay statistics (trace/guidance/stats.py) add the sums and item counts up over a forward.
Compared against: tests/guidance/test_align.py (hand values, the cap, the mean over all items; gradient
descent on a linear layer's weights makes its own rounding agree with the recorded rollout's).
"""
from __future__ import annotations

import torch

from trace.fp4 import reference as ref

MARGIN = 0.1  # grid steps past the boundary; ties and the next step's noise stay on the rollout's side
CAP = 1.0  # grid steps on the wrong side of the boundary beyond which an item's distance stops growing


def _hinge(d: torch.Tensor, flipped: torch.Tensor, margin: float) -> torch.Tensor:
    """relu(margin - max(d, -CAP))^2 where flipped, else 0: at most (CAP + margin)^2, and no gradient to an
    item more than CAP grid steps on the wrong side."""
    r = torch.relu(margin - d.clamp(min=-CAP))
    return torch.where(flipped, r ** 2, torch.zeros_like(r))


def alignment_terms(scaled: torch.Tensor, own_codes: torch.Tensor, target_codes: torch.Tensor,
                    margin: float = MARGIN) -> tuple[torch.Tensor, int, torch.Tensor]:
    """scaled [..., K] the trainer's values in grid units under the recorded scales (differentiable);
    own_codes / target_codes [..., K] uint8 FP4 codes (the trainer's RTN of `scaled`, the rollout's).
    Returns (sum of the capped hinge over the flipped elements, the number of elements (an int: every
    element is an item of the mean), the number of flipped ones (a 0-d tensor)). Every element is
    computed and the unflipped ones are masked out, so nothing waits for the device. margin 0 penalizes
    only the distance still to go to the boundary."""
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
    return _hinge(d, flipped, margin).sum(), flipped.numel(), flipped.sum()


def scale_terms(x: torch.Tensor, own_scales: torch.Tensor, target_scales: torch.Tensor,
                margin: float = MARGIN) -> tuple[torch.Tensor, int, torch.Tensor]:
    """The same capped hinge for NVFP4 block scales (1x16 blocks, per-row outer scale). x [..., K] the
    trainer's values (differentiable); own_scales / target_scales [..., K/16] E4M3 bytes (the
    trainer's, the rollout's). A block's unrounded scale is u = amax_blk * S_enc / 6 = 448 *
    amax_blk / amax_row; where its byte differs from the rollout's, d is the distance of u past the
    boundary into the rollout byte's E4M3 interval in units of the E4M3 step there. Returns (sum of the
    capped hinge over flipped blocks, the number of blocks (an int), the number of flipped ones (a 0-d
    tensor)), masked, no host sync. A flipped scale moves every code of its block, so without this
    part the trainer's own codes keep disagreeing however well the code part aligns the values under
    the recorded scales."""
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
    return _hinge(d, flipped, margin).sum(), flipped.numel(), flipped.sum()


def alignment_loss(total: torch.Tensor | None, items) -> torch.Tensor:
    """The mean over all guided items: total / items (items a number or a 0-d tensor); 0 without items."""
    if total is None:
        return torch.zeros(())
    if isinstance(items, torch.Tensor):
        return total / items.clamp(min=1)
    return total / items if items else total * 0.0
