"""TRACE guidance records: what the rollout stores so the trainer can replay its FP4 rounding.

Per guided site (the deepest `rho` of the layers) and token row: the mantissa bit of every element
(packed 8 per byte), the block scale bytes and the row's FP32 outer scale. Per MoE layer, for EVERY
MoE layer whatever the guided layers are, the routed expert ids (routing replay; `routing=False`
records none). Optionally the full 4-bit codes (the full-codes ablation, and the diagnostic record
that flip statistics are measured against). About 1.5 bits per element for long rows (1 + 8/16 + 32/K).

Rows are addressed by (sequence id, position). The n samples of one prompt share its prompt rows:
the engine records the prompt once and registers the other samples as aliases
(`Recorder.alias(seq, src_seq, upto_pos)`). A lookup that misses a row, or a record whose layers,
sites or row shapes do not match the batch, raises `RecordMismatch`; nothing is silently misaligned.
Records stay on the device their rows come from (the engine's: no host copies while it generates, and a
trainer on the same device looks them up in place); `record.on("cpu")` is the copy that travels between
processes. `record.view(seq, pos)` resolves a forward's rows once on the forward's device (a copy of the
record is made there once, where it is not there already, and kept): every lookup through the view is
then a device-side search and gather with no host sync, and whether every row was found is checked once per
view (`verify`), which the replay context does when its block ends. The `lookup*` methods are the same
with the check at each call.

    rec = Recorder(layers=guided_layers, full_codes=False)
    rec.add(layer, "attn_in", fp4tensor_rows, seq, pos)       # engine, at each quantized site
    rec.add_routing(layer, expert_ids, seq, pos)
    record = rec.finish()                                     # GuidanceRecord
    g = record.lookup(layer, "attn_in", seq, pos)             # trainer: fp4.Guide for those rows
    record.bytes_per_generated_token(n_generated)             # DESIGN.md §3 byte accounting

`Tee(guide_rec, diag_rec)` lets one forward fill the arm's own record and a diagnostic record;
`Recorder.seconds` is the time spent storing rows (the recording overhead of that record alone).

Compared against: nothing upstream has this; tests/guidance checks byte counts by hand.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from trace import fp4
from trace.fp4 import reference as ref

# Quantization sites (DESIGN.md §2). Row shape is [K] for token sites, [H_kv, D] for k/v and
# [top_k, I] for the expert down input (per token and expert slot).
SITES = ("attn_in", "o_in", "k", "v", "moe_in", "moe_down_in", "shared_in", "shared_down_in",
         "mlp_in", "mlp_down_in")
POS_BITS = 24  # key = seq << 24 | pos: 16M positions per sequence


class RecordMismatch(ValueError):
    """A record does not fit the batch it is applied to."""


def _keys(seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return (seq.long() << POS_BITS) | pos.long()


def _check_rows(site: str, n: int, seq: torch.Tensor, pos: torch.Tensor) -> None:
    if site not in SITES:
        raise ValueError(f"unknown site {site!r}; sites are {SITES}")
    if not n == seq.numel() == pos.numel():
        raise RecordMismatch(f"{site}: {n} rows but {seq.numel()} seq ids / {pos.numel()} positions")


@dataclass
class SiteRows:
    """Stored rows of one (layer, site), sorted by key."""

    keys: torch.Tensor  # [N] int64
    mantissa: torch.Tensor  # [N, *inner, K/8] uint8 packed bits
    scales: torch.Tensor  # [N, *inner, K/block] uint8
    outer: torch.Tensor  # [N, *inner, 1] float32
    codes: torch.Tensor | None = None  # [N, *inner, K/2] packed codes (full-codes ablation)
    fmt: str = "nvfp4"

    @property
    def row_shape(self) -> tuple[int, ...]:
        return (*self.mantissa.shape[1:-1], self.mantissa.shape[-1] * 8)

    def nbytes(self, compact_only: bool = False) -> int:
        """Bytes that must travel: scales, outer scales and either the mantissa bits (compact) or,
        for a full-codes record unless compact_only, the 4-bit codes (which contain the mantissa)."""
        n = self.scales.numel() + 4 * self.outer.numel()
        if self.codes is not None and not compact_only:
            return n + self.codes.numel()
        return n + self.mantissa.numel()


@dataclass
class GuidanceRecord:
    """A finished record: sites[(layer, site)] -> SiteRows, routing[layer] -> (keys, ids)."""

    sites: dict[tuple[int, str], SiteRows] = field(default_factory=dict)
    routing: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    aliases: dict[int, tuple[int, int]] = field(default_factory=dict)  # seq -> (src_seq, upto_pos)
    full_codes: bool = False

    @property
    def layers(self) -> list[int]:
        return sorted({layer for layer, _ in self.sites})

    def has(self, layer: int, site: str) -> bool:
        return (layer, site) in self.sites

    def on(self, device) -> GuidanceRecord:
        """This record with its tensors on `device` (made once per device and kept)."""
        device = torch.device(device)
        if device == self.device:
            return self
        cache = self.__dict__.setdefault("_copies", {})
        if device not in cache:
            cache[device] = GuidanceRecord(
                {k: SiteRows(r.keys.to(device), r.mantissa.to(device), r.scales.to(device), r.outer.to(device),
                             None if r.codes is None else r.codes.to(device), r.fmt) for k, r in self.sites.items()},
                {i: (k.to(device), ids.to(device)) for i, (k, ids) in self.routing.items()},
                dict(self.aliases), self.full_codes)
        return cache[device]

    def __getstate__(self):  # device copies stay where they were made (records travel through Ray)
        state = dict(self.__dict__)
        state.pop("_copies", None)
        return state

    @property
    def device(self) -> torch.device:
        for r in self.sites.values():
            return r.keys.device
        for k, _ in self.routing.values():
            return k.device
        return torch.device("cpu")

    def view(self, seq: torch.Tensor, pos: torch.Tensor, defer: bool = True) -> RecordView:
        """Lookups of rows (seq[i], pos[i]) on seq's device; defer=False checks at every lookup."""
        return RecordView(self, seq, pos, defer)

    def lookup(self, layer: int, site: str, seq: torch.Tensor, pos: torch.Tensor) -> fp4.Guide:
        """Guide for rows (seq[i], pos[i]): mantissa [M, *inner, K] (unpacked 0/1), scales, outer."""
        return self.view(seq, pos, defer=False).guide(layer, site)

    def lookup_codes(self, layer: int, site: str, seq, pos) -> torch.Tensor | None:
        """Recorded 4-bit codes [M, *inner, K] on seq's device, or None for a compact record."""
        return self.view(seq, pos, defer=False).codes(layer, site)

    def lookup_reference(self, layer: int, site: str, seq, pos) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scale bytes, 4-bit codes or None) of rows (seq[i], pos[i]) on seq's device, one search:
        what flip statistics compare against."""
        return self.view(seq, pos, defer=False).reference(layer, site)

    def lookup_routing(self, layer: int, seq, pos) -> torch.Tensor:
        """Recorded expert ids [M, k] (int64, slot order = the rollout's top-k order) on seq's device."""
        return self.view(seq, pos, defer=False).routing(layer)

    # -------------------------------------------------------------------- byte accounting
    def bytes_by_site(self, compact_only: bool = True) -> dict[str, int]:
        out: dict[str, int] = {}
        for (_, site), r in self.sites.items():
            out[site] = out.get(site, 0) + r.nbytes(compact_only)
        out["routing"] = sum(ids.numel() * ids.element_size() for _, ids in self.routing.values())
        return out

    def total_bytes(self, compact_only: bool = False) -> int:
        return sum(self.bytes_by_site(compact_only).values())

    def num_tokens(self) -> int:
        """Distinct (seq, pos) tokens the record covers, aliases included."""
        keys = set()
        for r in self.sites.values():
            keys.update(r.keys.tolist())
        for k, _ in self.routing.values():
            keys.update(k.tolist())
        n = len(keys)
        for _, (src, upto) in self.aliases.items():
            n += sum(1 for k in keys if (k >> POS_BITS) == src and (k & ((1 << POS_BITS) - 1)) < upto)
        return n

    def bytes_per_token(self, compact_only: bool = False) -> float:
        """All bytes over the distinct (seq, pos) rows the record covers, aliases included. Not what
        the tables report (prompt rows are stored once but counted per sample here): see
        bytes_per_generated_token."""
        return self.total_bytes(compact_only) / max(self.num_tokens(), 1)

    def bytes_per_generated_token(self, n_generated: int, compact_only: bool = False) -> float:
        """DESIGN.md §3: every byte of the record (prompt rows once, routing ids included) over the
        tokens the rollout generated, i.e. what must travel per trained token."""
        if n_generated <= 0:
            raise ValueError(f"n_generated must be positive, got {n_generated}")
        return self.total_bytes(compact_only) / n_generated

    def guided_elements(self) -> int:
        return sum(r.mantissa.numel() * 8 for r in self.sites.values())

    def bits_per_element(self, compact_only: bool = True) -> float | None:
        """Record bits of the activation sites (mantissa or full codes, scales, outer) per guided
        element, routing excluded; None when the record guides no element (rho 0)."""
        n = self.guided_elements()
        if n == 0:
            return None
        return 8 * sum(r.nbytes(compact_only) for r in self.sites.values()) / n


class RecordView:
    """A record's rows addressed by one forward's tokens (seq [M], pos [M]), on the forward's device.

    The tokens' keys are resolved once (aliases of shared prompt rows included, vectorized); each
    lookup is a searchsorted and a gather on the device. With defer=True the found-check of each lookup
    is kept on the device and `verify()` raises RecordMismatch for the first lookup that missed a row
    (one host sync for all of them); defer=False raises at the lookup."""

    def __init__(self, record: GuidanceRecord, seq: torch.Tensor, pos: torch.Tensor, defer: bool = True):
        self.record = record.on(seq.device)
        self.seq, self.pos, self.defer = seq, pos, defer
        self.want = _keys(self._resolve(seq.long(), pos.long()), pos)  # [M] int64
        self._checks: list[tuple[str, torch.Tensor]] = []  # (what, found [M] bool)

    def _resolve(self, seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        aliases = self.record.aliases
        if not aliases:
            return seq
        for s, (src, _) in aliases.items():
            if src in aliases:
                raise RecordMismatch(f"sequence {s} aliases {src}, itself an alias: chains are not supported")
        a_seq = sorted(aliases)
        table = torch.tensor([[s, *aliases[s]] for s in a_seq], dtype=torch.long).T.contiguous()  # [3, A]
        a_keys, a_src, a_upto = table.to(seq.device).unbind(0)  # sorted sequence ids, their source, alias extent
        i = torch.searchsorted(a_keys, seq).clamp(max=len(a_seq) - 1)  # [M]
        hit = (a_keys.index_select(0, i) == seq) & (pos < a_upto.index_select(0, i))
        return torch.where(hit, a_src.index_select(0, i), seq)

    def _idx(self, keys: torch.Tensor, what: str) -> torch.Tensor:
        if len(keys) == 0:
            if self.want.numel():
                raise RecordMismatch(f"{what}: the record has no rows")
            return torch.zeros(0, dtype=torch.long, device=keys.device)
        idx = torch.searchsorted(keys, self.want).clamp(max=len(keys) - 1)
        found = keys.index_select(0, idx) == self.want  # [M]
        if self.defer:
            self._checks.append((what, found))
        else:
            self._raise_missing(what, found)
        return idx

    def _raise_missing(self, what: str, found: torch.Tensor) -> None:
        if not bool(found.all()):
            miss = int((~found).nonzero()[0, 0])
            raise RecordMismatch(f"{what}: no recorded row for (seq {int(self.seq[miss])}, pos "
                                 f"{int(self.pos[miss])}); the batch does not match the record")

    def verify(self) -> None:
        """Raise RecordMismatch for the first deferred lookup that missed a row (one host sync)."""
        if not self._checks:
            return
        fine = torch.stack([f.all() for _, f in self._checks])
        if not bool(fine.all()):
            what, found = self._checks[int((~fine).nonzero()[0, 0])]
            self._raise_missing(what, found)
        self._checks.clear()

    def _site(self, layer: int, site: str) -> SiteRows:
        if (layer, site) not in self.record.sites:
            raise RecordMismatch(f"record has no site {site!r} in layer {layer} (has layers {self.record.layers})")
        return self.record.sites[(layer, site)]

    def guide(self, layer: int, site: str) -> fp4.Guide:
        """mantissa [M, *inner, K] (unpacked 0/1), scales, outer of the rows."""
        r = self._site(layer, site)
        idx = self._idx(r.keys, f"layer {layer} site {site}")
        return fp4.Guide(ref.unpack_bits(r.mantissa.index_select(0, idx)), r.scales.index_select(0, idx),
                         r.outer.index_select(0, idx))

    def codes(self, layer: int, site: str) -> torch.Tensor | None:
        """Recorded 4-bit codes [M, *inner, K], or None for a compact record."""
        r = self._site(layer, site)
        if r.codes is None:
            return None
        return ref.unpack_fp4(r.codes.index_select(0, self._idx(r.keys, f"layer {layer} site {site}")))

    def reference(self, layer: int, site: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scale bytes, 4-bit codes or None), one search: what flip statistics compare against."""
        r = self._site(layer, site)
        idx = self._idx(r.keys, f"layer {layer} site {site}")
        codes = ref.unpack_fp4(r.codes.index_select(0, idx)) if r.codes is not None else None
        return r.scales.index_select(0, idx), codes

    def routing(self, layer: int) -> torch.Tensor:
        """Recorded expert ids [M, k] (int64, the rollout's top-k order)."""
        if layer not in self.record.routing:
            raise RecordMismatch(f"record has no routing for layer {layer}")
        keys, ids = self.record.routing[layer]
        return ids.index_select(0, self._idx(keys, f"routing layer {layer}")).long()


class Recorder:
    """Collects rows from a forward (the rollout engine's, or a QAT model's under `recording`).

    layers: the guided layer indices (None: all) whose activation sites are stored. routing: True
    stores the expert ids of every MoE layer, whatever `layers` is (routing replay); "guided" only
    those of the guided layers (what lines up guided expert-slot rows when routing is not
    replayed); False none. Recording off costs
    nothing: callers check `wants(layer)` before quantizing anything extra. `seconds` accumulates
    the time spent storing (packing, and the device work of it), after the device has finished the
    forward's work queued so far, so it is this record's overhead alone. Rows are kept on their own
    device until `finish`, which sorts them there."""

    def __init__(self, layers=None, full_codes: bool = False, routing: bool | str = True):
        if routing not in (True, False, "guided"):
            raise ValueError(f"routing must be True, False or 'guided', got {routing!r}")
        self.layers = None if layers is None else set(int(i) for i in layers)
        self.full_codes = full_codes
        self.routing = routing
        self._sites: dict[tuple[int, str], list] = {}
        self._routing: dict[int, list] = {}
        self._aliases: dict[int, tuple[int, int]] = {}
        self.seconds = 0.0

    def wants(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def keeps_routing(self, layer: int) -> bool:
        """Whether this recorder stores the expert ids of MoE layer `layer`."""
        return self.routing is True or (self.routing == "guided" and self.wants(layer))

    def _clock(self, t: torch.Tensor) -> float:
        if t.is_cuda:  # the forward's queued work is not recording time; the store's own work is (below)
            torch.cuda.synchronize(t.device)
        return time.perf_counter()

    def _tick(self, t: torch.Tensor, t0: float) -> None:
        self.seconds += self._clock(t) - t0

    def add(self, layer: int, site: str, t: fp4.FP4Tensor, seq: torch.Tensor, pos: torch.Tensor) -> None:
        """Store rows of an FP4Tensor whose first dim is the token dim: codes [N, *inner, K]."""
        if not self.wants(layer):
            return
        _check_rows(site, t.codes.shape[0], seq, pos)
        if t.block_2d:
            raise ValueError("activation records use 1x16 / 1x32 blocks")
        outer = t.outer.float()
        if outer.dim() == 0 or outer.shape[0] != t.codes.shape[0]:
            raise RecordMismatch(f"{site}: record rows need a per-row outer scale, got shape {tuple(outer.shape)}")
        t0 = self._clock(t.codes)
        self._store(layer, site, _keys(seq, pos), ref.pack_bits(t.codes & 1), t.scales,
                    outer.expand(*t.codes.shape[:-1], 1), ref.pack_fp4(t.codes) if self.full_codes else None, t.fmt)
        self._tick(t.codes, t0)

    def add_rows(self, layer: int, site: str, mantissa: torch.Tensor, scales: torch.Tensor, outer: torch.Tensor,
                 codes: torch.Tensor | None, fmt: str, seq: torch.Tensor, pos: torch.Tensor) -> None:
        """Store rows already in record form: mantissa bits packed [N, *inner, K/8], scale bytes, outer
        [N, *inner, 1] float32, packed codes [N, *inner, K/2] (needed only by a full-codes recorder), at
        sequences seq [N] and positions pos [N]. What `add` stores, for callers that packed the rows
        themselves (the engine's graph decode steps, trace/rollout/graphs.py)."""
        if not self.wants(layer):
            return
        _check_rows(site, mantissa.shape[0], seq, pos)
        if self.full_codes and codes is None:
            raise ValueError("a full-codes recorder needs the packed codes")
        t0 = self._clock(mantissa)
        self._store(layer, site, _keys(seq, pos), mantissa, scales, outer, codes, fmt)
        self._tick(mantissa, t0)

    def _store(self, layer, site, keys, mantissa, scales, outer, codes, fmt) -> None:
        # the rows are the caller's own tensors (fresh results of its packing or of a gather from its
        # buffers), kept where they are
        self._sites.setdefault((layer, site), []).append((
            keys.to(mantissa.device, non_blocking=True), mantissa, scales, outer.float().contiguous(),
            codes if self.full_codes else None, fmt,
        ))

    def add_routing(self, layer: int, expert_ids: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor) -> None:
        if not self.keeps_routing(layer):
            return
        if expert_ids.shape[0] != seq.numel():
            raise RecordMismatch(f"routing: {expert_ids.shape[0]} rows but {seq.numel()} seq ids")
        t0 = self._clock(expert_ids)
        # int16 here, uint8 at `finish` where every id fits (reading the largest id now would wait for the device)
        self._routing.setdefault(layer, []).append((_keys(seq, pos).to(expert_ids.device, non_blocking=True),
                                                    expert_ids.to(torch.int16)))
        self._tick(expert_ids, t0)

    def alias(self, seq: int, src_seq: int, upto_pos: int) -> None:
        """Positions < upto_pos of `seq` are the rows recorded for `src_seq` (shared prompt)."""
        self._aliases[int(seq)] = (int(src_seq), int(upto_pos))

    def finish(self) -> GuidanceRecord:
        rec = GuidanceRecord(aliases=dict(self._aliases), full_codes=self.full_codes)
        twice = []  # per site, whether a (seq, pos) row came twice: read once for all sites (one device sync)
        for key, chunks in self._sites.items():
            keys = torch.cat([c[0] for c in chunks])
            order = torch.argsort(keys)
            keys = keys[order]
            twice.append((keys[1:] == keys[:-1]).any() if len(keys) > 1
                         else torch.zeros((), dtype=torch.bool, device=keys.device))
            cat = lambda i: torch.cat([c[i] for c in chunks])[order]  # noqa: E731
            rec.sites[key] = SiteRows(keys, cat(1), cat(2), cat(3), cat(4) if self.full_codes else None,
                                      chunks[0][5])
        top = []
        for layer, chunks in self._routing.items():
            keys = torch.cat([c[0] for c in chunks])
            order = torch.argsort(keys)
            ids = torch.cat([c[1] for c in chunks])[order]
            rec.routing[layer] = (keys[order], ids)
            top.append(ids.max() if ids.numel() else torch.zeros((), dtype=ids.dtype, device=ids.device))
        if twice:
            flags = torch.stack(twice).tolist()
            for key, bad in zip(self._sites, flags, strict=True):
                if bad:
                    raise RecordMismatch(f"layer {key[0]} site {key[1]}: a (seq, pos) row was recorded twice")
        if top:
            tops = torch.stack(top).tolist()
            for layer, m in zip(self._routing, tops, strict=True):
                if m < 256:  # expert ids as bytes where they fit (what the byte accounting counts)
                    keys, ids = rec.routing[layer]
                    rec.routing[layer] = (keys, ids.to(torch.uint8))
        return rec


class Tee:
    """Several recorders fed by one forward (the arm's own record and a diagnostic one): each gets
    the rows of the layers it wants and keeps its own `seconds`."""

    def __init__(self, *recorders: Recorder):
        self.recorders = [r for r in recorders if r is not None]

    def wants(self, layer: int) -> bool:
        return any(r.wants(layer) for r in self.recorders)

    @property
    def routing(self) -> bool:
        return any(r.routing for r in self.recorders)

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.recorders)

    def add(self, layer, site, t, seq, pos) -> None:
        for r in self.recorders:
            r.add(layer, site, t, seq, pos)

    def add_routing(self, layer, expert_ids, seq, pos) -> None:
        for r in self.recorders:
            r.add_routing(layer, expert_ids, seq, pos)

    def add_rows(self, layer, site, mantissa, scales, outer, codes, fmt, seq, pos) -> None:
        for r in self.recorders:
            r.add_rows(layer, site, mantissa, scales, outer, codes, fmt, seq, pos)

    def alias(self, seq: int, src_seq: int, upto_pos: int) -> None:
        for r in self.recorders:
            r.alias(seq, src_seq, upto_pos)
