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
