"""The per-site runtime of TRACE: recording a forward's FP4 decisions and replaying them in another.

Both adapters call it at every quantization site (SITES in trace/guidance/record.py):
trace/qat (a patched Hugging Face model, the trainer) and trace/rollout (the engine, recording only).
Token rows are the flattened [N] rows of one forward, addressed by `Rows` (sequence id and position
per row, position -1 for padding):

    rt = Runtime(fmt="nvfp4")
    with recording(rt, recorder, seq, pos):          # seq [B], pos [B, T]
        ... forward calling rt.act(layer, site, x) and rt.record_routing(layer, ids) ...
    with replay(rt, record, seq, pos, align=True) as stats:
        ... forward calling rt.act(...) and rt.route(...) ...
        loss = ... + coef * stats.alignment_loss()

`Runtime.act` fake-quantizes x [N, *inner, K] per row with a straight-through gradient: plain RTN
(qat-independent), or at a site the record has, guided rounding with the recorded mantissa bits and
scales at the guided layers (TRACE), or the recorded full codes themselves (the full-codes ablation).
It also counts flips (trace/guidance/stats.py) and accumulates the alignment term
(trace/guidance/align.py). `Runtime.route` is routing replay: the rollout's expert ids, weights
recomputed from this forward's router logits so the router still trains. Padding rows get plain RTN
and are never recorded or looked up.

Compared against: the unguided RTN forward and the recorded rollout codes (tests/guidance/test_replay.py,
tests/qat/test_patch.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from kernels import reference as ref
from trace import fp4
from trace.guidance import align
from trace.guidance.record import GuidanceRecord, Recorder, RecordMismatch
from trace.guidance.stats import ReplayStats


@dataclass
class Rows:
    """Addressing of the N flattened token rows of one forward."""

    seq: torch.Tensor  # [N] sequence id per row
    pos: torch.Tensor  # [N] position per row, -1 = padding
    valid: torch.Tensor = field(init=False)  # [N] bool

    def __post_init__(self):
        self.valid = self.pos >= 0

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
        m = self.valid.to(t.codes.device)
        outer = t.outer.expand(*t.codes.shape[:-1], 1)  # [N, *inner, 1]
        return fp4.FP4Tensor(t.codes[m], t.scales[m], outer[m], t.fmt, False, t.dtype)

    @property
    def valid_seq(self) -> torch.Tensor:
        return self.seq[self.valid]

    @property
    def valid_pos(self) -> torch.Tensor:
        return self.pos[self.valid]


@dataclass
class Recording:
    """A recorder and the addressing of the forward it records."""

    recorder: Recorder
    rows: Rows

    def wants(self, layer: int) -> bool:
        return self.recorder.wants(layer)

    def add(self, layer: int, site: str, t: fp4.FP4Tensor) -> None:
        """t: the site's per-row quantization of all N rows; the valid ones are stored."""
        if self.recorder.wants(layer):
            self.recorder.add(layer, site, self.rows.take(t), self.rows.valid_seq, self.rows.valid_pos)

    def add_routing(self, layer: int, expert_ids: torch.Tensor) -> None:
        """expert_ids [N, k] of all N rows."""
        if self.recorder.wants(layer):
            self.rows.check(expert_ids.shape[0])
            ids = expert_ids[self.rows.valid.to(expert_ids.device)]
            self.recorder.add_routing(layer, ids, self.rows.valid_seq, self.rows.valid_pos)


@dataclass
class Replay:
    """A record applied to a forward, and what to do with it."""

    record: GuidanceRecord
    rows: Rows
    guide_layers: set[int] | None  # None: every layer the record has; empty: count flips only
    routing: bool
    full_codes: bool
    align: bool
    stats: ReplayStats

    def guided(self, layer: int) -> bool:
        return self.guide_layers is None or layer in self.guide_layers


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
        own = fp4.quantize(x.detach(), self.fmt, "row")  # [N, *inner, K] the trainer's own RTN
        if self.recording is not None:
            self.recording.add(layer, site, own)
        rtn = fp4.straight_through(x, own.dequantize(x.dtype))
        rp = self.replaying
        if rp is None or not rp.record.has(layer, site):
            return rtn
        rows = rp.rows
        rows.check(x.shape[0])
        seq, pos = rows.valid_seq, rows.valid_pos
        xv = x[rows.valid]
        own = rows.take(own)
        g = rp.record.lookup(layer, site, seq, pos)
        rec_codes = rp.record.lookup_codes(layer, site, seq, pos)
        guided = rp.guided(layer)
        res = None
        if guided and rp.full_codes:
            if rec_codes is None:
                raise RecordMismatch("full-codes replay needs a record made with Recorder(full_codes=True)")
            # the rollout's own operands: nothing left to recover
            res = fp4.GuidedResult(fp4.FP4Tensor(rec_codes, g.scales, g.outer, self.fmt, False, x.dtype),
                                   torch.zeros_like(rec_codes, dtype=torch.bool))
        elif guided:
            res = fp4.guided_quantize(xv.detach(), g.mantissa, g.scales, g.outer, self.fmt, ref_codes=rec_codes)
        self._count(rp, layer, own, g, rec_codes, res)
        if res is None:
            return rtn
        if rp.align:
            scaled = fp4.scaled_values(xv, g.scales, g.outer, self.fmt)  # grad flows to x
            total, n = align.alignment_terms(scaled, ref.e2m1_encode(scaled.detach()), res.tensor.codes)
            if n:
                rp.stats.add_alignment(total, n)
        guided_vals = fp4.straight_through(xv, res.tensor.dequantize(x.dtype))
        if bool(rows.valid.all()):
            return guided_vals
        return rtn.index_put((rows.valid.nonzero().squeeze(-1),), guided_vals)  # padding rows keep RTN

    @staticmethod
    def _count(rp: Replay, layer: int, own: fp4.FP4Tensor, g: fp4.Guide, rec_codes, res) -> None:
        st = rp.stats.layer(layer)
        st.elements += own.codes.numel()
        st.blocks += own.scales.numel()
        st.scale_flips += int((own.scales != g.scales).sum())
        target = rec_codes if rec_codes is not None else (res.tensor.codes if res is not None else None)
        if target is not None:  # -0 and +0 are the same value
            st.code_flips += int(((own.codes != target) & ((own.codes | target) & 7 != 0)).sum())
        if res is not None and res.unrecoverable is not None:
            st.unrecoverable += int(res.unrecoverable.sum())
            st.unrec_checked += res.unrecoverable.numel()

    def route(self, layer: int, logits: torch.Tensor, expert_ids: torch.Tensor,
              renorm: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Routing replay. logits [N, E], expert_ids [N, k] this forward's top-k. Returns (weights
        [N, k] float32, ids [N, k]) with the recorded ids at valid rows and softmax weights of this
        forward's logits at those ids (renormalized over the k if `renorm`), or None when the
        layer's routing is not replayed."""
        rp = self.replaying
        if rp is None or not rp.routing or layer not in rp.record.routing:
            return None
        rows = rp.rows
        rows.check(expert_ids.shape[0])
        valid = rows.valid.to(expert_ids.device)
        ids = expert_ids.clone()
        ids[valid] = rp.record.lookup_routing(layer, rows.valid_seq, rows.valid_pos).to(ids.device)
        st = rp.stats.layer(layer)
        st.routing_tokens += int(valid.sum())
        same = (expert_ids[valid].sort(-1).values == ids[valid].sort(-1).values).all(-1)
        st.routing_flips += int((~same).sum())
        w = torch.softmax(logits.float(), dim=-1).gather(1, ids)
        if renorm:
            w = w / w.sum(-1, keepdim=True)
        return w, ids


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
def replay(rt: Runtime, record: GuidanceRecord, seq: torch.Tensor, pos: torch.Tensor, *, guide: bool = True,
           guide_layers=None, routing: bool = True, align: bool = False, full_codes: bool = False):
    """Within the block, forwards through `rt` use guided rounding at the record's layers (or
    `guide_layers`), routing replay, and collect flip statistics and the alignment term into the
    yielded ReplayStats. guide=False measures flips against the record without guiding (the unguided
    arms). full_codes=True guides with the recorded 4-bit codes themselves (the full-codes ablation;
    the record must hold them); otherwise full codes in a record only serve the statistics."""
    old = rt.replaying
    layers = set() if not guide else (None if guide_layers is None else set(guide_layers))
    stats = ReplayStats()
    rt.replaying = Replay(record, Rows.of_batch(seq, pos), layers, routing, full_codes, align, stats)
    try:
        yield stats
    finally:
        rt.replaying = old
