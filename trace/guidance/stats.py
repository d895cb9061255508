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
    align_count: int | torch.Tensor = 0  # guided items (elements and block scales): the term's denominator
    # the term's two parts ("codes": elements, "scales": NVFP4 block scales) per layer:
    # (part, layer) -> [sum of hinges, items, flipped items]
    align_parts: dict[tuple[str, int], list] = field(default_factory=dict)

    def layer(self, i: int) -> LayerStats:
        return self.layers.setdefault(i, LayerStats())

    def add_alignment(self, total: torch.Tensor | None, items, flipped, part: str, layer: int) -> None:
        """One site's part of the term (trace/guidance/align.py): the sum of its hinges, its number of items
        (the term's denominator) and of flipped items (for the logged mean hinge over flipped items)."""
        if total is None:
            return
        self.align_sum = total if self.align_sum is None else self.align_sum + total
        self.align_count = self.align_count + items
        acc = self.align_parts.setdefault((part, layer), [0, 0, 0])
        acc[0], acc[1], acc[2] = acc[0] + total.detach(), acc[1] + items, acc[2] + flipped

    def alignment_loss(self) -> torch.Tensor:
        """The alignment term over every guided site of the forward: the mean hinge over all guided items
        (a scalar; 0 without flips)."""
        return align.alignment_loss(self.align_sum, self.align_count)

    def alignment_parts(self) -> dict:
        """Where the term comes from, read with one host sync: per part ("codes", "scales") the mean hinge
        over its flipped items (`align_<part>_hinge`), the part's share of the term's sum
        (`align_<part>_share`), the fraction of its items that flipped (`align_<part>_flipped`) and its
        mean hinge over flipped items per layer (`align_<part>_hinge_layer`: {layer: hinge}); absent for a
        part with nothing recorded."""
        keys = sorted(self.align_parts)
        if not keys:
            return {}
        cells = [torch.as_tensor(v).detach().double().reshape(()) for k in keys for v in self.align_parts[k]]
        dev = next((c.device for c in cells if c.device.type != "cpu"), cells[0].device)
        vals = torch.stack([c.to(dev) for c in cells]).tolist()
        total = sum(vals[0::3])
        per: dict[str, list] = {}
        out: dict = {}
        for (part, layer), sm, n, f in zip(keys, vals[0::3], vals[1::3], vals[2::3], strict=True):
            acc = per.setdefault(part, [0.0, 0.0, 0.0])
            acc[0], acc[1], acc[2] = acc[0] + sm, acc[1] + n, acc[2] + f
            out.setdefault(f"align_{part}_hinge_layer", {})[layer] = sm / f if f else 0.0
        for part, (sm, n, f) in per.items():
            out[f"align_{part}_hinge"] = sm / f if f else 0.0
            out[f"align_{part}_share"] = sm / total if total > 0 else 0.0
            out[f"align_{part}_flipped"] = f / n if n else 0.0
        return out

    def merge(self, other: ReplayStats | None) -> ReplayStats:
        """A new ReplayStats with the counts of `other` (None: nothing) and of this one added up, the alignment
        sum detached: the statistics of one step's micro-batches as those of the whole batch
        (trace/rl/trainstep.py). Neither input is changed."""
        out = ReplayStats()
        for src in (other, self):
            if src is None:
                continue
            for i, s in src.layers.items():
                o = out.layer(i)
                for name in _COUNTS:
                    setattr(o, name, getattr(o, name) + getattr(s, name))
                for site, acc in s.site_codes.items():
                    have = o.site_codes.setdefault(site, [0] * len(acc))
                    o.site_codes[site] = [a + b for a, b in zip(have, acc, strict=True)]
            if src.align_sum is not None:
                d = src.align_sum.detach()
                out.align_sum = d if out.align_sum is None else out.align_sum + d.to(out.align_sum.device)
            out.align_count = out.align_count + src.align_count
            for k, acc in src.align_parts.items():
                have = out.align_parts.setdefault(k, [0, 0, 0])
                out.align_parts[k] = [a + b for a, b in zip(have, acc, strict=True)]
        return out

    def totals(self) -> ReplayStats:
        """A copy with every count an int: one host sync for all layers (the device counts are stacked)."""
        out = ReplayStats(align_sum=self.align_sum, align_count=self.align_count, align_parts=self.align_parts)
        pending = []  # (container, field name or index, device count)
        for i, s in self.layers.items():
            o = out.layer(i)
            cells = [(o, name, getattr(s, name)) for name in _COUNTS]
            for site, acc in s.site_codes.items():
                o.site_codes[site] = list(acc)
                cells += [(o.site_codes[site], j, v) for j, v in enumerate(acc)]
            for where, k, v in cells:
                if isinstance(v, torch.Tensor):
                    pending.append((where, k, v))
                elif isinstance(k, str):
                    setattr(where, k, v)
        if pending:
            dev = pending[0][2].device
            host = torch.stack([v.detach().to(dev, torch.int64) for _, _, v in pending]).tolist()
            for (where, k, _), v in zip(pending, host, strict=True):
                if isinstance(k, str):
                    setattr(where, k, v)
                else:
                    where[k] = v
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
