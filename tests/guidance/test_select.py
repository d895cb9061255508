"""Layer selection: the deepest round(rho * L) layers."""
import pytest

from trace.guidance import guided_layer_indices


def test_deepest_fraction_of_layers():
    assert guided_layer_indices(8, 0.0) == []
    assert guided_layer_indices(8, 1.0) == list(range(8))
    assert guided_layer_indices(8, 0.5) == [4, 5, 6, 7]
    assert guided_layer_indices(3, 0.5) == [1, 2]  # round(1.5) = 2


def test_rho_outside_unit_interval_raises():
    with pytest.raises(ValueError, match="rho"):
        guided_layer_indices(4, 1.5)


def test_arm_recorders_follow_the_arm_table():
    from trace.arms import ARMS
    from trace.guidance import arm_recorders

    guide, diag = arm_recorders(ARMS["trace"], 8, 0.5)
    assert guide.wants(7) and not guide.wants(3) and guide.routing is True and not guide.full_codes
    assert diag is not None and diag.wants(0) and diag.full_codes  # flip diagnostic over all layers
    guide, _ = arm_recorders(ARMS["trace-noroutingreplay"], 8, 0.5)
    assert guide.routing == "guided"  # expert ids of the guided layers only: they line up expert slots
    assert arm_recorders(ARMS["trace-fullcodes"], 8, 0.5)[0].full_codes
    assert arm_recorders(ARMS["trace"], 8, 0.5, diag_flips=False)[1] is None
    guide, diag = arm_recorders(ARMS["qat-independent"], 8, 0.5)
    assert guide is None and diag is not None
    for name in ("bf16", "fp4-naive", "qat-weight-only"):
        assert arm_recorders(ARMS[name], 8, 0.5) == (None, None)
