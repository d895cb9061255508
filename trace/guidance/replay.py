"""The per-site runtime of TRACE: recording a forward's FP4 decisions and replaying them in another.

Both adapters call it at every quantization site (SITES in trace/guidance/record.py):
trace/qat (a patched Hugging Face model, the trainer) and trace/rollout (the engine, recording only).
Token rows are the flattened [N] rows of one forward, addressed by `Rows` (sequence id and position
per row, position -1 for padding):

    rt = Runtime(fmt="nvfp4")
    with recording(rt, recorder, seq, pos):          # seq [B], pos [B, T]
        ... forward calling rt.act(layer, site, x) and rt.record_routing(layer, ids) ...
    with replay(rt, record, seq, pos, align=True, diag=diag_record) as stats:
        ... forward calling rt.act(...) and rt.route(...) ...
        loss = ... + coef * stats.alignment_loss()

`Runtime.act` fake-quantizes x [N, *inner, K] per row with a straight-through gradient: plain RTN
(qat-independent, or record=None), or at a site the record has, guided rounding with the recorded
mantissa bits and scales at the guided layers (TRACE), or the recorded full codes themselves (the
full-codes ablation). It accumulates the alignment term (trace/guidance/align.py) at guided sites.
`Runtime.route` is routing replay: the rollout's expert ids, weights recomputed from this forward's
router logits so the router still trains. Padding rows get plain RTN and are never recorded or
looked up.

Flip statistics (trace/guidance/stats.py, DESIGN.md §3) are one diagnostic for every arm: at every
site of the REFERENCE record (`diag`, a full-codes record of all layers that guides nothing; else
the guidance record itself) the trainer's own RTN code before guidance is compared with the rollout's
code. Expert-slot rows (moe_down_in, [N, k, I]) are compared per (token, expert): a slot is matched
to the rollout's slot holding the same expert, and slots whose expert the rollout did not route to
are left out, so arms without routing replay compare like with like.

Compared against: the unguided RTN forward and the recorded rollout codes (tests/guidance/test_replay.py,
tests/qat/test_patch.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint

from trace import fp4
from trace.fp4 import align as fp4_align
from trace.guidance.align import MARGIN, alignment_terms, scale_terms
from trace.guidance.record import GuidanceRecord, Recorder, RecordMismatch, RecordView
from trace.guidance.stats import ReplayStats
from trace.settings import RLSettings


@dataclass
class Rows:
    """Addressing of the N flattened token rows of one forward. The valid rows' indices are found once
    (one host sync); every later selection is an index_select on the device."""

    seq: torch.Tensor  # [N] sequence id per row
    pos: torch.Tensor  # [N] position per row, -1 = padding
    valid: torch.Tensor = field(init=False)  # [N] bool
    idx: torch.Tensor = field(init=False)  # [n] indices of the valid rows
    all_valid: bool = field(init=False)
    valid_seq: torch.Tensor = field(init=False)  # [n]
    valid_pos: torch.Tensor = field(init=False)  # [n]

    def __post_init__(self):
        self.valid = self.pos >= 0
        self.idx = self.valid.nonzero().squeeze(-1)
        self.all_valid = self.idx.numel() == self.valid.numel()
        self.valid_seq = self.seq.index_select(0, self.idx)
        self.valid_pos = self.pos.index_select(0, self.idx)

    def select(self, t: torch.Tensor) -> torch.Tensor:
        """The valid rows of t [N, ...] (on t's device)."""
        return t if self.all_valid else t.index_select(0, self.idx.to(t.device))

    @classmethod
    def of_batch(cls, seq: torch.Tensor, pos: torch.Tensor) -> Rows:
        """seq [B], pos [B, T] (-1 = padding) -> one address per row of the flattened [B*T] tokens."""
        if pos.dim() != 2 or seq.dim() != 1 or seq.shape[0] != pos.shape[0]:
            raise RecordMismatch(f"addressing must be seq [B] and pos [B, T], got {tuple(seq.shape)} and "
                                 f"{tuple(pos.shape)}")
        return cls(seq[:, None].expand_as(pos).reshape(-1), pos.reshape(-1))

    def check(self, n: int) -> None:
        if self.seq.numel() != n:
            raise RecordMismatch(f"batch has {n} token rows but the addressing has {self.seq.numel()}")

    def take(self, t: fp4.FP4Tensor) -> fp4.FP4Tensor:
        """The valid rows of a per-row quantized t [N, *inner, K], with a per-row outer scale
        [n, *inner, 1] (MXFP4 has a scalar outer of ones; records want one per row)."""
        self.check(t.codes.shape[0])
        outer = t.outer.expand(*t.codes.shape[:-1], 1)  # [N, *inner, 1]
        return fp4.FP4Tensor(self.select(t.codes), self.select(t.scales), self.select(outer), t.fmt, False, t.dtype)


@dataclass
class Recording:
    """A recorder (or a record.Tee of several) and the addressing of the forward it records."""

    recorder: Recorder
    rows: Rows

    def wants(self, layer: int) -> bool:
        return self.recorder.wants(layer)

    def add(self, layer: int, site: str, t: fp4.FP4Tensor) -> None:
        """t: the site's per-row quantization of all N rows; the valid ones are stored."""
        if self.recorder.wants(layer):
            self.recorder.add(layer, site, self.rows.take(t), self.rows.valid_seq, self.rows.valid_pos)

    def add_routing(self, layer: int, expert_ids: torch.Tensor) -> None:
        """expert_ids [N, k] of all N rows; stored for every MoE layer when the recorder keeps routing."""
        if self.recorder.routing:
            self.rows.check(expert_ids.shape[0])
            ids = self.rows.select(expert_ids)
            self.recorder.add_routing(layer, ids, self.rows.valid_seq, self.rows.valid_pos)


@dataclass
class Replay:
    """A record applied to a forward, and what to do with it."""

    record: GuidanceRecord | None  # the arm's guidance record (None: statistics only)
    rows: Rows
    guide_layers: set[int] | None  # None: every layer the record has; empty: count flips only
    routing: bool
    full_codes: bool
    align: bool
    stats: ReplayStats
    diag: GuidanceRecord | None = None  # the statistics' reference record (default: `record`)
    align_margin: float = MARGIN
    align_scales: bool = RLSettings.align_scales  # the NVFP4 block-scale part of the alignment term (off: elements only)
    ids: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> expert ids [N, k] this forward used
    views: dict[int, RecordView] = field(default_factory=dict)  # id(record) -> its rows for this forward

    def view(self, record: GuidanceRecord) -> RecordView:
        """`record`'s rows addressed by this forward's valid rows (found-checks deferred to `verify`)."""
        if id(record) not in self.views:
            self.views[id(record)] = record.view(self.rows.valid_seq, self.rows.valid_pos)
        return self.views[id(record)]

    def verify(self) -> None:
        for v in self.views.values():
            v.verify()

    def guided(self, layer: int, site: str) -> bool:
        return (self.record is not None and self.record.has(layer, site)
                and (self.guide_layers is None or layer in self.guide_layers))

    @property
    def reference(self) -> GuidanceRecord | None:
        return self.diag if self.diag is not None else self.record


@dataclass
class Runtime:
    """Recording and replay state of one model's FP4 sites (set by the context managers below)."""

    fmt: str = "nvfp4"
    recording: Recording | None = None
    replaying: Replay | None = None

    def record_routing(self, layer: int, expert_ids: torch.Tensor) -> None:
        if self.recording is not None:
            self.recording.add_routing(layer, expert_ids)

    def act(self, layer: int, site: str, x: torch.Tensor) -> torch.Tensor:
        """Fake-quantize activation rows x [N, *inner, K] at (layer, site), in x's dtype."""
        if self.recording is None and self.replaying is None:  # plain RTN: one kernel pass on a GPU
            return fp4.fake_quant(x, self.fmt, "row", check_values=False)
        # [N, *inner, K] the trainer's own RTN; unchecked: a check per site is a device wait per site, and
        # a non-finite activation reaches the logits and the loss, which the trainers check every step
        own = fp4.quantize(x.detach(), self.fmt, "row", check_values=False)
        if self.recording is not None:
            self.recording.add(layer, site, own)
        rtn = fp4.straight_through(x, own.dequantize(x.dtype))
        rp = self.replaying
        if rp is None:
            return rtn
        rows = rp.rows
        rows.check(x.shape[0])
        own = rows.take(own)  # valid rows, per-row outer [n, *inner, 1]
        res = None
        if rp.guided(layer, site):
            xv = rows.select(x)
            view = rp.view(rp.record)
            g = view.guide(layer, site)
            rec_codes = view.codes(layer, site) if rp.full_codes else None
            slots = None
            if site == "moe_down_in":  # expert-slot rows: line them up with this forward's routing
                slots = self._slot_match(rp, rp.record, layer)
                if slots is None and layer in rp.ids and layer not in rp.record.routing:
                    raise RecordMismatch(f"layer {layer}: guiding expert-slot rows needs the record's routing ids")
            if slots is not None:
                src, keep = slots
                g = fp4.Guide(*(_take_slots(t, src) for t in (g.mantissa, g.scales, g.outer)))
                rec_codes = _take_slots(rec_codes, src) if rec_codes is not None else None
            own_rtn = rp.align or slots is not None  # own RTN under the recorded scales, for the term / slots
            if rp.full_codes:
                if rec_codes is None:
                    raise RecordMismatch("full-codes replay needs a record made with Recorder(full_codes=True)")
                # the rollout's own operands: nothing left to recover
                res = fp4.GuidedResult(fp4.FP4Tensor(rec_codes, g.scales, g.outer, self.fmt, False, x.dtype), None)
                vals = res.tensor.dequantize(x.dtype)
                if own_rtn:
                    own_enc = fp4.rtn_codes_under(xv.detach(), g.scales, g.outer, self.fmt)
            else:
                # the bits were unpacked from the record; x is checked through the logits (above); one kernel
                # pass on a GPU for the guided codes, their values and the own RTN codes
                res, vals, own_enc = fp4.guided_dequantize(xv.detach(), g.mantissa, g.scales, g.outer, self.fmt,
                                                           dtype=x.dtype, rtn_codes=own_rtn)
            target, target_scales = res.tensor.codes, g.scales
            if slots is not None:  # slots whose expert the rollout did not route to keep their own RTN
                vals = torch.where(keep[..., None], vals, own.dequantize(x.dtype))
                target = torch.where(keep[..., None], target, own_enc)
                target_scales = torch.where(keep[..., None], target_scales, own.scales)
                res = fp4.GuidedResult(fp4.FP4Tensor(target, g.scales, g.outer, self.fmt, False, x.dtype), None)
        self._count(rp, layer, site, own, res)
        if res is None:
            return rtn
        if rp.align:
            with_scales = self.fmt == "nvfp4" and rp.align_scales
            args = (xv, g.scales, g.outer, own_enc, target, own.scales, target_scales, self.fmt, rp.align_margin,
                    with_scales)
            # the fused kernels (kernels/align.py) read the inputs once per pass and save nothing else; the torch
            # ops are recomputed in the backward from these inputs: their fp32 intermediates over every element
            # of the site were half the trainer forward's saved memory (mixtral-small, coding: benchmarks/trainer_memory.py)
            if fp4_align.align_kernel_on(xv):
                terms = fp4_align.alignment_site(*args)
            elif torch.is_grad_enabled() and xv.requires_grad:
                terms = checkpoint(_alignment_site, *args, use_reentrant=False)
            else:
                terms = _alignment_site(*args)
            rp.stats.add_alignment(*terms[:3], part="codes", layer=layer)
            if with_scales:
                rp.stats.add_alignment(*terms[3:], part="scales", layer=layer)
        guided_vals = fp4.straight_through(xv, vals)
        if rows.all_valid:
            return guided_vals
        return rtn.index_put((rows.idx.to(rtn.device),), guided_vals)  # padding rows keep RTN

    def _count(self, rp: Replay, layer: int, site: str, own: fp4.FP4Tensor, res: fp4.GuidedResult | None) -> None:
        """Flip statistics of the valid rows `own` (the trainer's RTN before guidance) against the
        reference record's rollout codes and scales (DESIGN.md §3 diagnostics)."""
        refr = rp.reference
        if refr is None or not refr.has(layer, site):
            return
        scales, codes = rp.view(refr).reference(layer, site)
        own_codes, own_scales = own.codes, own.scales
        guided = res.tensor.codes if res is not None else None
        keep = None  # [n, k, 1] expert slots compared (slot rows), else all rows
        if site == "moe_down_in":
            if layer in rp.ids and layer not in refr.routing:
                return  # the reference has no routing: expert slots cannot be compared like with like
            slots = self._slot_match(rp, refr, layer)
            if slots is not None:
                src, keep = slots
                keep = keep[..., None]
                scales = _take_slots(scales, src)
                codes = _take_slots(codes, src) if codes is not None else None

        # counts stay on the device until the step reads them (ReplayStats.totals): no host sync here
        def count(differ: torch.Tensor):  # -> (differing, compared) over the compared rows
            if keep is None:
                return differ.sum(), differ.numel()
            return (differ & keep).sum(), keep.sum() * differ.shape[-1]

        st = rp.stats.layer(layer)
        n, total = count(own_scales != scales)
        st.scale_flips += n
        st.blocks += total
        if codes is None:
            return
        flips, total = count(_differ(own_codes, codes))
        st.code_flips += flips
        st.elements += total
        site_acc = st.site_codes.setdefault(site, [0, 0])
        site_acc[0] += flips
        site_acc[1] += total
        if guided is not None:
            n, total = count(_differ(guided, codes))
            st.unrecoverable += n
            st.unrec_checked += total

    @staticmethod
    def _slot_match(rp: Replay, record: GuidanceRecord, layer: int):
        """(src [n, k] long, keep [n, k] bool): for each expert slot of this forward's valid rows,
        the record's slot routed to the same expert and whether there is one. None when nothing needs
        moving: no router ran in this forward (the caller's slots are the record's) or the record has
        no routing for the layer. (Slots that already line up map to themselves; finding that out first
        would cost a host sync.)"""
        if layer not in rp.ids or layer not in record.routing:
            return None
        mine = rp.rows.select(rp.ids[layer])  # [n, k]
        roll = rp.view(record).routing(layer).to(mine.device)  # [n, k]
        match = mine[:, :, None] == roll[:, None, :]  # [n, k, k]; top-k ids are distinct, <= 1 match
        return match.int().argmax(-1), match.any(-1)

    def route(self, layer: int, logits: torch.Tensor, expert_ids: torch.Tensor,
              renorm: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Routing replay. logits [N, E], expert_ids [N, k] this forward's top-k. Returns (weights
        [N, k] float32, ids [N, k]) with the recorded ids at valid rows and softmax weights of this
        forward's logits at those ids (renormalized over the k if `renorm`), or None when the
        layer's routing is not replayed. Counts routing flips (own top-k set != the rollout's)
        against the reference record whenever it has this layer's routing."""
        rp = self.replaying
        if rp is None:
            return None
        rows = rp.rows
        rows.check(expert_ids.shape[0])
        refr = rp.reference
        if refr is not None and layer in refr.routing:
            roll = rp.view(refr).routing(layer).to(expert_ids.device)
            st = rp.stats.layer(layer)
            st.routing_tokens += rows.idx.numel()
            same = (rows.select(expert_ids).sort(-1).values == roll.sort(-1).values).all(-1)
            st.routing_flips += (~same).sum()
        replayed = rp.routing and rp.record is not None and layer in rp.record.routing
        if not replayed:
            rp.ids[layer] = expert_ids
            return None
        rolled = rp.view(rp.record).routing(layer).to(expert_ids.device)
        ids = rolled if rows.all_valid else expert_ids.index_put((rows.idx.to(expert_ids.device),), rolled)
        rp.ids[layer] = ids
        w = torch.softmax(logits.float(), dim=-1).gather(1, ids)
        if renorm:
            w = w / w.sum(-1, keepdim=True)
        return w, ids


def _alignment_site(xv, scales, outer, own_enc, target, own_scales, target_scales, fmt, margin, with_scales):
    """The alignment term's (sum, items, flipped) of one site's elements, then of its block scales if
    with_scales (trace/guidance/align.py); differentiable in xv [n, *inner, K] (the valid rows)."""
    scaled = fp4.scaled_values(xv, scales, outer, fmt)  # grad flows to x
    out = alignment_terms(scaled, own_enc, target, margin=margin)
    return out + scale_terms(xv, own_scales, target_scales, margin=margin) if with_scales else out


def _take_slots(t: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Rows t [n, k, ...] reordered along the slot dim: out[i, j] = t[i, src[i, j]]."""
    return t.gather(1, src.view(*src.shape, *([1] * (t.dim() - 2))).expand(-1, -1, *t.shape[2:]))


def _differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Codes that dequantize differently (-0 and +0 are the same value)."""
    return (a != b) & ((a | b) & 7 != 0)


@contextlib.contextmanager
def recording(rt: Runtime, recorder: Recorder, seq: torch.Tensor, pos: torch.Tensor):
    """Within the block, forwards through `rt` fill `recorder` at every site they quantize and with
    the routing of every MoE layer. seq [B] sequence ids, pos [B, T] positions (-1 for padding)."""
    old = rt.recording
    rt.recording = Recording(recorder, Rows.of_batch(seq, pos))
    try:
        yield recorder
    finally:
        rt.recording = old


@contextlib.contextmanager
def replay(rt: Runtime, record: GuidanceRecord | None, seq: torch.Tensor, pos: torch.Tensor, *,
           guide: bool = True, guide_layers=None, routing: bool = True, align: bool = False,
           full_codes: bool = False, diag: GuidanceRecord | None = None, align_margin: float | None = None,
           align_scales: bool = RLSettings.align_scales):
    """Within the block, forwards through `rt` use guided rounding at the record's layers (or
    `guide_layers`), routing replay, and collect flip statistics and the alignment term into the
    yielded ReplayStats. guide=False measures flips against the record without guiding.
    full_codes=True guides with the recorded 4-bit codes themselves (the full-codes ablation; the
    record must hold them). align_scales=False leaves the block-scale part out of the alignment term
    (elements only). diag: a full-codes record of all layers that the statistics use
    instead of `record` and that guides nothing; record=None with diag: statistics only."""
    if record is None and diag is None:
        raise ValueError("replay needs a guidance record, a diagnostic record, or both")
    old = rt.replaying
    layers = set() if not guide else (None if guide_layers is None else set(guide_layers))
    stats = ReplayStats()
    rt.replaying = Replay(record, Rows.of_batch(seq, pos), layers, routing, full_codes, align, stats, diag,
                          MARGIN if align_margin is None else align_margin, align_scales=align_scales)
    try:
        yield stats
        rt.replaying.verify()  # every lookup of the block found its row (one host sync)
    finally:
        rt.replaying = old
