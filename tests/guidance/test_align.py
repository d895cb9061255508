"""The alignment term alone: hand values on the E2M1 grid, no term without flips, gradient sign."""
import torch

from kernels import reference as ref
from trace.guidance import alignment_loss, alignment_terms


def _codes(v):
    return ref.e2m1_encode(torch.tensor(v))


def test_hand_values_on_the_grid():
    # own 1.2 -> code of 1.0; the rollout chose 1.5: cross the midpoint 1.25 -> (1.2 - 1.25)^2
    # own -2.6 -> -3.0 (rounds up in magnitude past 2.5); the rollout chose -2.0: midpoint 2.5 -> 0.1^2
    scaled = torch.tensor([1.2, -2.6, 0.4])
    own = _codes([1.2, -2.6, 0.4])
    target = _codes([1.5, -2.0, 0.5])  # the third element agrees with its own rounding
    total, n = alignment_terms(scaled, own, target)
    assert n == 2
    torch.testing.assert_close(total, torch.tensor(0.05 ** 2 + 0.1 ** 2))
    torch.testing.assert_close(alignment_loss(total, n), total / 2)


def test_no_flips_no_term_and_zero_loss():
    scaled = torch.tensor([0.4, 1.0, -3.0])
    c = _codes([0.4, 1.0, -3.0])
    assert alignment_terms(scaled, c, c) == (None, 0)
    assert alignment_loss(None, 0).item() == 0.0


def test_sign_of_zero_is_not_a_flip():
    scaled = torch.tensor([0.1, -0.1])
    own = _codes([0.1, -0.1])
    target = own ^ 8  # +0 <-> -0
    assert alignment_terms(scaled, own, target) == (None, 0)


def test_gradient_moves_the_value_toward_the_rollout_side():
    scaled = torch.tensor([1.2], requires_grad=True)
    total, n = alignment_terms(scaled, _codes([1.2]), _codes([1.5]))
    alignment_loss(total, n).backward()
    assert scaled.grad.item() < 0  # descending increases the value toward 1.5
