"""Which layers TRACE guides: the deepest fraction rho of the decoder layers (DESIGN.md §3).

    guided_layer_indices(8, 0.5)  # -> [4, 5, 6, 7]

Deeper layers see the accumulated rounding differences of all layers below them, so a fixed byte
budget buys the most there. Compared against: tests/guidance/test_select.py (rho 0, 1, rounding).
"""
from __future__ import annotations


def guided_layer_indices(num_layers: int, rho: float) -> list[int]:
    """The deepest round(rho * num_layers) layer indices: rho=0 -> none, 1 -> all."""
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"rho must be in [0, 1], got {rho}")
    n = int(round(rho * num_layers))
    return list(range(num_layers - n, num_layers))
