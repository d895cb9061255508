"""The TRACE alignment term (DESIGN.md §3): pull the trainer's own rounding toward the rollout's.

For each element of a guided site whose own round-to-nearest code, under the RECORDED block scales,
differs in magnitude from the rollout's code, the term is the squared distance of the trainer's
scaled value |v| to the grid midpoint it must cross to round like the rollout. The loss is the mean
of these over all flipped elements of the forward:

    total, count = alignment_terms(v, own_codes, target_codes)   # per site, v = x / scales (grad to x)
    loss = alignment_loss(sum of totals, sum of counts)

Pure functions of tensors; the replay runtime (trace/guidance/replay.py) calls them per site.
Compared against: tests/guidance/test_align.py (hand values; gradient descent removes the flips).
"""
from __future__ import annotations

import torch

from kernels import reference as ref


def alignment_terms(scaled: torch.Tensor, own_codes: torch.Tensor,
                    target_codes: torch.Tensor) -> tuple[torch.Tensor | None, int]:
    """scaled [..., K] the trainer's values in grid units under the recorded scales (differentiable);
    own_codes / target_codes [..., K] uint8 FP4 codes (the trainer's RTN of `scaled`, the rollout's).
    Returns (sum of squared distances to the crossing midpoint over flipped elements, their number);
    (None, 0) when nothing flipped."""
    own_mag = own_codes.long() & 7
    tgt_mag = target_codes.long() & 7
    flipped = own_mag != tgt_mag
    if not bool(flipped.any()):
        return None, 0
    grid = torch.tensor(ref.E2M1_GRID, device=scaled.device)
    step = torch.where(tgt_mag > own_mag, 1, -1)
    nb = (own_mag + step).clamp(0, 7)
    boundary = (grid[own_mag] + grid[nb]) / 2  # the midpoint between the own grid point and its neighbour
    d2 = (scaled.abs() - boundary)[flipped] ** 2
    return d2.sum(), int(flipped.sum())


def alignment_loss(total: torch.Tensor | None, count: int) -> torch.Tensor:
    """Mean over flipped elements; a zero scalar when there were none."""
    if total is None or count == 0:
        return torch.zeros(())
    return total / count
