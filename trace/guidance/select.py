"""Which layers TRACE guides (the deepest fraction rho of the decoder layers, DESIGN.md §3) and what an
arm records during a rollout.

    guided_layer_indices(8, 0.5)                 # -> [4, 5, 6, 7]
    guide, diag = arm_recorders(ARMS["trace"], num_layers=8, rho=0.5)

Deeper layers see the accumulated rounding differences of all layers below them, so a fixed byte
budget buys the most there. Compared against: tests/guidance/test_select.py (rho 0, 1, rounding).
"""
from __future__ import annotations

from trace.guidance.record import Recorder
from trace.settings import RLSettings


def guided_layer_indices(num_layers: int, rho: float) -> list[int]:
    """The deepest round(rho * num_layers) layer indices: rho=0 -> none, 1 -> all."""
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"rho must be in [0, 1], got {rho}")
    n = int(round(rho * num_layers))
    return list(range(num_layers - n, num_layers))


def arm_records(arm, diag_flips: bool = RLSettings.diag_flips) -> tuple[bool, bool]:
    """(whether the arm's rollout takes a guidance record, whether it takes the diagnostic record): the
    guidance record for arms that guide (`arm.record == "guide"`), the diagnostic one (`diag_flips`) for
    every arm whose trainer quantizes activations, except the exact arm (no record at all: its trainer's
    log-probs are the rollout's)."""
    return arm.record == "guide", diag_flips and arm.trainer_mode in ("w4a4", "w4a4kv4") and not arm.exact


def arm_recorders(arm, num_layers: int, rho: float, diag_flips: bool = RLSettings.diag_flips) -> tuple[Recorder | None, Recorder | None]:
    """(the arm's guidance recorder, the diagnostic recorder), each None where `arm_records` says the arm
    takes no such record; the embedded trainer and the OpenRLHF rollout actor both take their recorders
    from here.

    The guidance record holds the deepest `rho` layers' sites and, with routing replay, the expert ids of
    every MoE layer (without it, of the guided layers only: they line up guided expert slots). The
    diagnostic record holds full codes and routing of all layers; it only measures flips and never
    counts in bytes or speed.
    """
    takes_guide, takes_diag = arm_records(arm, diag_flips)
    guide = Recorder(layers=guided_layer_indices(num_layers, rho), full_codes=arm.full_codes,
                     routing=True if arm.routing else "guided") if takes_guide else None
    diag = Recorder(layers=None, full_codes=True) if takes_diag else None
    return guide, diag
