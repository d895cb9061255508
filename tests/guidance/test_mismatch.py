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


def test_empty_mask_gives_none():
    z = torch.zeros(2, 3)
    assert mismatch_metrics(z, z, torch.zeros(2, 3)) == {k: None for k in KEYS}
