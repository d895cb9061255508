"""Per-sample guidance records as they travel through OpenRLHF: merge turns, renumber, batch, move.

The rollout actor splits the record of each batched engine call per sample (sequence id 0), so
each sample's record stands alone in `Experience.mm_train_inputs` and survives OpenRLHF's concat /
split / shuffle of experiences. The trainer rebuilds one record per micro-batch whose sequence ids
are the batch rows:

    recs = split_record(rec, n)                        # one engine call for n samples -> n records
    rec = merge_turns([turn1, turn2])                 # one sample, several engine calls (multi-turn)
    batch_rec = batch_records([rec_a, rec_b], device)  # rows 0, 1 of the micro-batch

A multi-turn sample is prefilled again at every turn, so later turns re-record earlier positions;
the first turn's rows are the ones whose rounding produced the sampled tokens, and they win.
Records are keyed (seq << 24 | pos) like trace.guidance.record; these helpers only re-key and
concatenate its SiteRows, so lookups and byte counts are unchanged.
Compared against: a record made directly for the whole batch (tests/integrations/openrlhf/test_records.py).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from trace.guidance.record import _POS_BITS, GuidanceRecord, SiteRows

_POS_MASK = (1 << _POS_BITS) - 1


def _rekey(keys: torch.Tensor, seq: int) -> torch.Tensor:
    return (keys & _POS_MASK) | (int(seq) << _POS_BITS)


def _order(k: torch.Tensor, first_wins: bool) -> torch.Tensor:
    """Indices that sort keys k [n]; with first_wins, only the first of each run of equal keys (a stable
    sort keeps call order among equal keys)."""
    if not first_wins:
        return torch.argsort(k)
    order = torch.sort(k, stable=True).indices
    ks = k[order]
    keep = torch.ones_like(ks, dtype=torch.bool)
    keep[1:] = ks[1:] != ks[:-1]
    return order[keep]


def _site_cat(parts: list[SiteRows], keys: list[torch.Tensor], first_wins: bool) -> SiteRows:
    k = torch.cat(keys)
    cat = lambda name: torch.cat([getattr(p, name) for p in parts])  # noqa: E731
    mant, scales, outer = cat("mantissa"), cat("scales"), cat("outer")
    codes = cat("codes") if all(p.codes is not None for p in parts) else None
    order = _order(k, first_wins)
    return SiteRows(k[order], mant[order], scales[order], outer[order],
                    codes[order] if codes is not None else None, parts[0].fmt)


def _combine(recs: list[GuidanceRecord], seqs: list[int] | None, first_wins: bool) -> GuidanceRecord:
    if any(r.aliases for r in recs):
        raise ValueError("per-sample records carry no aliases (the engine records one sample per call)")
    out = GuidanceRecord(full_codes=all(r.full_codes for r in recs))
    sites = sorted({key for r in recs for key in r.sites})
    for key in sites:
        have = [(i, r.sites[key]) for i, r in enumerate(recs) if key in r.sites]
        keys = [(_rekey(s.keys, seqs[i]) if seqs is not None else s.keys) for i, s in have]
        out.sites[key] = _site_cat([s for _, s in have], keys, first_wins)
    for layer in sorted({lay for r in recs for lay in r.routing}):
        have = [(i, r.routing[layer]) for i, r in enumerate(recs) if layer in r.routing]
        k = torch.cat([(_rekey(kk, seqs[i]) if seqs is not None else kk) for i, (kk, _) in have])
        ids = torch.cat([v for _, (_, v) in have])
        order = _order(k, first_wins)
        out.routing[layer] = (k[order], ids[order])
    return out


def merge_turns(recs: list[GuidanceRecord]) -> GuidanceRecord:
    """One sample's records from successive engine calls (same seq id) -> one record, earliest row wins."""
    if len(recs) == 1:
        return recs[0]
    return _combine(recs, None, first_wins=True)


def batch_records(recs: list[GuidanceRecord], device=None) -> GuidanceRecord:
    """Sample records -> one record with seq id = position in `recs` (the micro-batch row)."""
    out = _combine(recs, list(range(len(recs))), first_wins=False)
    return to_device(out, device) if device is not None else out


def split_record(rec: GuidanceRecord, n: int) -> list[GuidanceRecord]:
    """A record of samples 0..n-1 from one engine call -> one record per sample (sequence id 0),
    aliased prompt rows (samples sharing a prefilled prompt) copied into each sample's record.
    A finished record's keys are sorted, so each sample's rows are one contiguous block (found by
    one search per site for all samples) and an alias is a prefix of its source's block."""
    bounds = torch.arange(n + 1, dtype=torch.long) << _POS_BITS
    alias = sorted(rec.aliases.items())
    alias_at = torch.tensor([(src << _POS_BITS) | upto for _, (src, upto) in alias], dtype=torch.long)

    def blocks(keys: torch.Tensor):
        """Per sample, the (start, end) row slices that make up its rows, in position order."""
        if len(keys) > 1 and not bool((keys[1:] >= keys[:-1]).all()):
            raise ValueError("split_record needs a finished record (keys sorted)")
        b = torch.searchsorted(keys, bounds).tolist()
        out = [[(b[i], b[i + 1])] for i in range(n)]
        if alias:
            ends = torch.searchsorted(keys, alias_at).tolist()
            for (i, (src, _)), end in zip(alias, ends, strict=True):
                if i < n:
                    out[i].insert(0, (b[src], end))
        return out

    def take(t: torch.Tensor, parts) -> torch.Tensor:
        return t[parts[0][0]:parts[0][1]] if len(parts) == 1 else torch.cat([t[a:e] for a, e in parts])

    out = [GuidanceRecord(full_codes=rec.full_codes) for _ in range(n)]
    for key, s in rec.sites.items():
        pos = s.keys & _POS_MASK
        for r, parts in zip(out, blocks(s.keys), strict=True):
            p = take(pos, parts)
            rows = [take(t, parts) if t is not None else None for t in (s.mantissa, s.scales, s.outer, s.codes)]
            if len(parts) > 1 and len(p) > 1 and not bool((p[1:] > p[:-1]).all()):
                order = torch.argsort(p)  # an aliased sample that also recorded prompt positions itself
                p, rows = p[order], [t[order] if t is not None else None for t in rows]
            r.sites[key] = SiteRows(p, *rows, s.fmt)
    for layer, (k, v) in rec.routing.items():
        pos = k & _POS_MASK
        for r, parts in zip(out, blocks(k), strict=True):
            p, ids = take(pos, parts), take(v, parts)
            if len(parts) > 1 and len(p) > 1 and not bool((p[1:] > p[:-1]).all()):
                order = torch.argsort(p)
                p, ids = p[order], ids[order]
            r.routing[layer] = (p, ids)
    return out


@dataclass(frozen=True)
class PackedRecord:
    """A record as it travels through Ray's object store: every tensor's bytes in one uint8 array
    (a NumPy buffer, which Ray serializes out of band and maps without a copy) plus the layout.
    Pickling a GuidanceRecord instead pickles each of its tensors through torch.save / torch.load,
    per tensor and per sample, which costs far more than the rollout itself."""

    layout: tuple  # (full_codes, ((kind, key, fmt, ((dtype, shape, offset) | None, ...)), ...))
    buf: np.ndarray  # [nbytes] uint8


_ALIGN = 8  # every tensor starts at a multiple of the widest element (int64 keys)
_PAD = torch.zeros(_ALIGN, dtype=torch.uint8)
_DTYPE_NAME = {getattr(torch, n): n for n in ("uint8", "int16", "int32", "int64", "float32", "bfloat16", "float16")}


def pack(rec: GuidanceRecord) -> PackedRecord:
    """One sample's record (no aliases) -> PackedRecord, byte for byte (one copy of all its rows)."""
    if rec.aliases:
        raise ValueError("pack a per-sample record (split_record materializes aliases)")
    pieces, off = [], 0

    def place(t):
        nonlocal off
        if t is None:
            return None
        spec = (_DTYPE_NAME[t.dtype], tuple(t.shape), off)
        nb = t.numel() * t.element_size()
        pieces.append(t.reshape(-1).view(torch.uint8))
        pad = -nb % _ALIGN
        if pad:
            pieces.append(_PAD[:pad])
        off += nb + pad
        return spec

    entries = [("site", key, r.fmt, tuple(place(t) for t in (r.keys, r.mantissa, r.scales, r.outer, r.codes)))
               for key, r in rec.sites.items()]
    entries += [("routing", layer, None, (place(k), place(v))) for layer, (k, v) in rec.routing.items()]
    buf = torch.cat(pieces).cpu() if pieces else torch.empty(0, dtype=torch.uint8)
    return PackedRecord((rec.full_codes, tuple(entries)), buf.numpy())


def unpack(p: PackedRecord) -> GuidanceRecord:
    """PackedRecord -> GuidanceRecord whose tensors are views of the packed bytes (read-only when
    they come from the object store: the trainer only reads and concatenates them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the object store's buffers are not writable
        buf = torch.from_numpy(p.buf)

    def view(spec):
        if spec is None:
            return None
        dtype, shape, o = spec
        dt = getattr(torch, dtype)
        return buf[o:o + math.prod(shape) * dt.itemsize].view(dt).view(shape)

    full_codes, entries = p.layout
    rec = GuidanceRecord(full_codes=full_codes)
    for kind, key, fmt, specs in entries:
        if kind == "site":
            rec.sites[key] = SiteRows(*(view(sp) for sp in specs), fmt)
        else:
            rec.routing[key] = tuple(view(sp) for sp in specs)
    return rec


def as_record(r) -> GuidanceRecord:
    """A record as shipped (packed) or kept in process (a GuidanceRecord) -> GuidanceRecord."""
    return unpack(r) if isinstance(r, PackedRecord) else r


def coverage(rec: GuidanceRecord) -> int:
    """Positions 0..coverage-1 of a one-sample record are recorded. A multi-turn sample's final
    environment feedback follows its last action and is never fed to the engine; the trainer
    forwards it, but causally it cannot change any trained log-prob, so it is left unguided."""
    keys = [s.keys for s in rec.sites.values()] + [k for k, _ in rec.routing.values()]
    return max((int((k & _POS_MASK).max()) + 1 for k in keys if k.numel()), default=0)


def to_device(rec: GuidanceRecord, device) -> GuidanceRecord:
    """Keys and rows on `device`, so lookups with positions on that device stay there."""
    dev = torch.device(device)
    out = GuidanceRecord(aliases=dict(rec.aliases), full_codes=rec.full_codes)
    for key, s in rec.sites.items():
        out.sites[key] = SiteRows(s.keys.to(dev), s.mantissa.to(dev), s.scales.to(dev), s.outer.to(dev),
                                  s.codes.to(dev) if s.codes is not None else None, s.fmt)
    out.routing = {layer: (k.to(dev), v.to(dev)) for layer, (k, v) in rec.routing.items()}
    return out


__all__ = ["PackedRecord", "as_record", "batch_records", "coverage", "merge_turns", "pack", "split_record", "to_device",
           "unpack"]
