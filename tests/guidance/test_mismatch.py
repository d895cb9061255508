"""mismatch_metrics on hand-computed values, and the empty-mask case."""
import math

import torch

from trace.guidance.mismatch import KEYS, mismatch_metrics


def test_hand_values():
    lp_train = torch.tensor([[0.0, -1.0, -2.0]])
    lp_roll = torch.tensor([[0.0, -1.5, -5.0]])
    mask = torch.tensor([[1, 1, 0]])
    mm = mismatch_metrics(lp_train, lp_roll, mask)
    d = [0.0, 0.5]  # lp_train - lp_roll over the masked tokens
    assert math.isclose(mm["k1"], -sum(d) / 2)
    assert math.isclose(mm["k3"], sum(math.exp(x) - 1 - x for x in d) / 2)
    assert math.isclose(mm["dlp_abs_max"], 0.5) and math.isclose(mm["dlp_abs_mean"], 0.25)
    assert mm["ratio_out_frac"] == 0.0  # exp(0.5) = 1.65 is inside [0.5, 2]
    assert math.isclose(mm["chi2"], ((math.exp(0.5) - 1) ** 2) / 2)


def test_ratio_out_frac_counts_ratios_outside_half_to_two():
    """r = exp(lp_train - lp_roll) at 1, 2.23, 0.45, 2.72, 0.55 and 1.65: three lie outside [0.5, 2] (one below,
    two above); r = 3 on a masked-out token is not counted. Ratios between 2 and 4 count as outside, ratios
    between 0.25 and 0.5 too."""
    d = [0.0, 0.8, -0.8, 1.0, -0.6, 0.5, math.log(3.0)]
    lp_roll = torch.full((1, len(d)), -2.0)
    lp_train = lp_roll + torch.tensor([d])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0]])
    mm = mismatch_metrics(lp_train, lp_roll, mask)
    assert mm["ratio_out_frac"] == 3 / 6
    assert math.isclose(mm["dlp_abs_max"], 1.0, rel_tol=1e-6)
    assert math.isclose(mm["k1"], -sum(d[:6]) / 6, rel_tol=1e-6)
    # the two sides separately: only ratios above 2, only ratios below 0.5
    assert mismatch_metrics(lp_roll[:, :2] + 0.75, lp_roll[:, :2], torch.ones(1, 2))["ratio_out_frac"] == 1.0
    assert mismatch_metrics(lp_roll[:, :2] - 0.75, lp_roll[:, :2], torch.ones(1, 2))["ratio_out_frac"] == 1.0
    assert mismatch_metrics(lp_roll[:, :2] + 0.6, lp_roll[:, :2], torch.ones(1, 2))["ratio_out_frac"] == 0.0


def test_empty_mask_gives_none():
    z = torch.zeros(2, 3)
    assert mismatch_metrics(z, z, torch.zeros(2, 3)) == {k: None for k in KEYS}
