"""Replay statistics per layer: code flips, scale flips, unrecoverable elements, routing flips.

Filled by the replay runtime (trace/guidance/replay.py) during a trainer forward against the
REFERENCE record (a full-codes diagnostic record of all layers where the trainer has one, else the
guidance record), read by the RL trainer once per step as per-layer rates (DESIGN.md §3, §4):

    code_flip_rate      the trainer's own RTN code (own scales, before guidance) != the rollout's code
                        (zero codes of either sign count as equal); only against full codes, so absent
                        for a compact record alone; expert-slot rows matched by expert id
    scale_flip_rate     own block scale byte != the rollout's
    unrecoverable_rate  guided code != the rollout's code, at guided sites of a full-codes reference
    routing_flip_rate   own top-k expert set != the rollout's set, per token

The alignment term accumulates here too (sum and count; trace/guidance/align.py defines it).
Compared against: hand counts in tests/guidance/test_replay.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trace.guidance import align


@dataclass
class LayerStats:
    """Counts of one layer; during a replay the counts are 0-d device tensors (adding them waits for
    nothing), `ReplayStats.totals()` turns them into ints."""

    elements: int = 0
    code_flips: int | torch.Tensor = 0
    blocks: int = 0
    scale_flips: int | torch.Tensor = 0
    unrecoverable: int | torch.Tensor = 0
    unrec_checked: int = 0  # elements whose recovery could be checked (records with full codes)
    routing_tokens: int = 0
    routing_flips: int | torch.Tensor = 0
    # site -> [code flips, elements] of the layer's activation sites (where a difference first shows)
    site_codes: dict[str, list] = field(default_factory=dict)


_COUNTS = ("elements", "code_flips", "blocks", "scale_flips", "unrecoverable", "unrec_checked",
           "routing_tokens", "routing_flips")


@dataclass
class ReplayStats:
    layers: dict[int, LayerStats] = field(default_factory=dict)
    align_sum: torch.Tensor | None = None
    align_count: int | torch.Tensor = 0

    def layer(self, i: int) -> LayerStats:
        return self.layers.setdefault(i, LayerStats())

    def add_alignment(self, total: torch.Tensor | None, count) -> None:
        if total is None:
            return
        self.align_sum = total if self.align_sum is None else self.align_sum + total
        self.align_count = self.align_count + count

    def alignment_loss(self) -> torch.Tensor:
        """The alignment term over every guided site of the forward (a scalar; 0 without flips)."""
        return align.alignment_loss(self.align_sum, self.align_count)

    def totals(self) -> ReplayStats:
        """A copy with every count an int: one host sync for all layers (the device counts are stacked)."""
        cells = [(s, name) for s in self.layers.values() for name in _COUNTS]
        cells += [(acc, j) for s in self.layers.values() for acc in s.site_codes.values() for j in (0, 1)]
        vals = [getattr(o, k) if isinstance(k, str) else o[k] for o, k in cells]
        dev = [v for v in vals if isinstance(v, torch.Tensor)]
        if dev:
            host = torch.stack([v.detach().to(dev[0].device, torch.int64) for v in dev]).tolist()
            it = iter(host)
            vals = [next(it) if isinstance(v, torch.Tensor) else v for v in vals]
        out = ReplayStats({i: LayerStats(site_codes={k: [0, 0] for k in s.site_codes})
                           for i, s in self.layers.items()})
        copies = [(out.layers[i], name) for i, s in self.layers.items() for name in _COUNTS]
        copies += [(out.layers[i].site_codes[k], j) for i, s in self.layers.items() for k in s.site_codes
                   for j in (0, 1)]
        for (o, k), v in zip(copies, vals, strict=True):
            if isinstance(k, str):
                setattr(o, k, v)
            else:
                o[k] = v
        out.align_sum, out.align_count = self.align_sum, self.align_count
        return out

    def summary(self) -> dict[str, dict[int, float]]:
        """{rate name: {layer: rate}}; a layer is absent where its denominator is zero."""
        out = {"code_flip_rate": {}, "scale_flip_rate": {}, "unrecoverable_rate": {}, "routing_flip_rate": {}}
        for i, s in sorted(self.totals().layers.items()):
            if s.elements:
                out["code_flip_rate"][i] = s.code_flips / s.elements
            if s.unrec_checked:
                out["unrecoverable_rate"][i] = s.unrecoverable / s.unrec_checked
            if s.blocks:
                out["scale_flip_rate"][i] = s.scale_flips / s.blocks
            if s.routing_tokens:
                out["routing_flip_rate"][i] = s.routing_flips / s.routing_tokens
        return out
