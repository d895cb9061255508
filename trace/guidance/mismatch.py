"""Train-rollout mismatch of token log-probs (DESIGN.md §4): the quantities TRACE exists to shrink.

    mm = mismatch_metrics(lp_train, lp_roll, mask)   # [B, T] each; mask: the trainable tokens

k1 = mean(lp_roll - lp_train); r = exp(lp_train - lp_roll); k3 = mean(r - 1 - log r); |dlp| mean and
max; fraction of r outside [0.5, 2]; chi2 = mean((r - 1)^2). Computed in float64. Used by the embedded
trainer (trace/rl) and the OpenRLHF policy actor (trace/integrations/openrlhf), so both log the same
numbers. Compared against: tests/guidance/test_mismatch.py (hand values).
"""
from __future__ import annotations

import torch

KEYS = ("k1", "k3", "dlp_abs_mean", "dlp_abs_max", "ratio_out_frac", "chi2")


def mismatch_metrics(lp_train: torch.Tensor, lp_roll: torch.Tensor, mask: torch.Tensor) -> dict:
    """Mismatch over the tokens in `mask`; every value None when the mask is empty."""
    m = mask.bool()
    if not bool(m.any()):
        return {k: None for k in KEYS}
    dlp = (lp_train.double() - lp_roll.double())[m]
    r = dlp.exp()
    return {
        "k1": float((-dlp).mean()),
        "k3": float((r - 1 - dlp).mean()),
        "dlp_abs_mean": float(dlp.abs().mean()),
        "dlp_abs_max": float(dlp.abs().max()),
        "ratio_out_frac": float(((r < 0.5) | (r > 2.0)).double().mean()),
        "chi2": float(((r - 1) ** 2).mean()),
    }
