"""Per-sample guidance records as they travel through OpenRLHF: merge turns, renumber, batch, move.

The rollout actor splits the record of each batched engine call per sample (sequence id 0), so
each sample's record stands alone in `Experience.mm_train_inputs` and survives OpenRLHF's concat /
split / shuffle of experiences. The trainer rebuilds one record per micro-batch whose sequence ids
are the batch rows:

    recs = split_record(rec, n)                        # one engine call for n samples -> n records
    packed = pack_split(rec, n)                        # the same, each packed for the object store
    rec = merge_turns([turn1, turn2])                 # one sample, several engine calls (multi-turn)
    batch_rec = batch_records([rec_a, rec_b], device)  # rows 0, 1 of the micro-batch (records or packed)

Records travel between Ray processes packed (`PackedRecord`: one byte buffer per sample and kind):
pickled as they are, their many small tensors each go through torch.save / torch.load, which cost
more than the rollout itself.

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

from trace.guidance.record import POS_BITS, GuidanceRecord, SiteRows

_POS_MASK = (1 << POS_BITS) - 1


def _rekey(keys: torch.Tensor, seq: int) -> torch.Tensor:
    return (keys & _POS_MASK) | (int(seq) << POS_BITS)


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


def batch_records(recs: list, device=None) -> GuidanceRecord:
    """Sample records (GuidanceRecords or PackedRecords) -> one record with seq id = position in
    `recs` (the micro-batch row). Packed records of one layout are batched a site at a time."""
    out = _batch_packed(recs) if recs and all(isinstance(r, PackedRecord) for r in recs) else None
    if out is None:
        out = _combine([as_record(r) for r in recs], list(range(len(recs))), first_wins=False)
    return out.on(device) if device is not None else out


def split_record(rec: GuidanceRecord, n: int) -> list[GuidanceRecord]:
    """A record of samples 0..n-1 from one engine call -> one record per sample (sequence id 0),
    aliased prompt rows (samples sharing a prefilled prompt) copied into each sample's record.
    A finished record's keys are sorted, so each sample's rows are one contiguous block (found by
    one search per site for all samples) and an alias is a prefix of its source's block."""
    bounds = torch.arange(n + 1, dtype=torch.long) << POS_BITS
    alias = sorted(rec.aliases.items())
    alias_at = torch.tensor([(src << POS_BITS) | upto for _, (src, upto) in alias], dtype=torch.long)

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

    def split(keys: torch.Tensor, fields: list[torch.Tensor | None]):
        """Per sample: (positions, its rows of each field), in position order."""
        pos = keys & _POS_MASK
        for parts in blocks(keys):
            p = take(pos, parts)
            rows = [take(t, parts) if t is not None else None for t in fields]
            if len(parts) > 1 and len(p) > 1 and not bool((p[1:] > p[:-1]).all()):
                order = torch.argsort(p)  # an aliased sample that also recorded prompt positions itself
                p, rows = p[order], [t[order] if t is not None else None for t in rows]
            yield p, rows

    out = [GuidanceRecord(full_codes=rec.full_codes) for _ in range(n)]
    for key, s in rec.sites.items():
        for r, (p, rows) in zip(out, split(s.keys, [s.mantissa, s.scales, s.outer, s.codes]), strict=True):
            r.sites[key] = SiteRows(p, *rows, s.fmt)
    for layer, (k, v) in rec.routing.items():
        for r, (p, (ids,)) in zip(out, split(k, [v]), strict=True):
            r.routing[layer] = (p, ids)
    return out


@dataclass(frozen=True)
class PackedRecord:
    """One sample's record as it travels through Ray's object store: all its bytes in one uint8
    array (a NumPy buffer, which Ray serializes out of band and maps without a copy) plus the
    layout. Per (layer, site) and per routing layer the rows are one block of a row matrix
    [rows, row_bytes] whose columns hold that row's key (the position), outer scale, mantissa bits,
    scale bytes and codes (or expert ids). Pickling a GuidanceRecord instead pickles each of its
    tensors through torch.save / torch.load, per sample, which costs more than the rollout itself."""

    layout: tuple  # (full_codes, ((kind, key, fmt, rows, row_bytes, offset, field specs), ...))
    buf: np.ndarray  # [nbytes] uint8

    def total_bytes(self, compact_only: bool = False) -> int:
        """`GuidanceRecord.total_bytes` of the unpacked record (SiteRows.nbytes per site, routing
        ids), from the layout alone."""
        total = 0
        for kind, _, _, rows, _, _, specs in self.layout[1]:
            n = [rows * math.prod(sp[1]) if sp is not None else None for sp in specs]
            if kind == "routing":
                total += n[1] * getattr(torch, specs[1][0]).itemsize
                continue
            _, mantissa, scales, outer, codes = n
            total += scales + 4 * outer + (codes if codes is not None and not compact_only else mantissa)
        return total

    def bytes_per_generated_token(self, n_generated: int, compact_only: bool = False) -> float:
        """`GuidanceRecord.bytes_per_generated_token` of the unpacked record."""
        if n_generated <= 0:
            raise ValueError(f"n_generated must be positive, got {n_generated}")
        return self.total_bytes(compact_only) / n_generated


_ALIGN = 8  # row bytes and block offsets are multiples of the widest element (int64 keys)
_DTYPE_NAME = {getattr(torch, n): n for n in ("uint8", "int16", "int32", "int64", "float32", "bfloat16", "float16")}


def _row_matrix(fields: list[torch.Tensor | None]) -> tuple[torch.Tensor, int, tuple]:
    """Tensors with the same first dim N -> ([N, row_bytes] uint8, row_bytes, per field (dtype name,
    shape after N, column) or None). Wider elements first, so every column is aligned to its type."""
    N = fields[0].shape[0]
    cols, specs, c = [], [None] * len(fields), 0
    for j in sorted((j for j, t in enumerate(fields) if t is not None), key=lambda j: -fields[j].element_size()):
        t = fields[j]
        b = t.contiguous().reshape(N, math.prod(t.shape[1:])).view(torch.uint8)
        specs[j] = (_DTYPE_NAME[t.dtype], tuple(t.shape[1:]), c)
        cols.append(b)
        c += b.shape[1]
    pad = -c % _ALIGN
    if pad:
        cols.append(torch.zeros(N, pad, dtype=torch.uint8, device=fields[0].device))
    return torch.cat(cols, 1), c + pad, tuple(specs)


def pack_split(rec: GuidanceRecord, n: int) -> list[PackedRecord]:
    """A record of samples 0..n-1 from one engine call -> one PackedRecord per sample, equal to
    `pack(r)` for each `r` of `split_record(rec, n)`, with a few tensor operations per site rather
    than per site and sample: each sample's rows are a contiguous block of the site's row matrix
    (aliased prompt rows gathered in front of the sample's own)."""
    bounds = torch.arange(n + 1, dtype=torch.long) << POS_BITS
    alias = {i: a for i, a in rec.aliases.items() if i < n}
    alias_at = torch.tensor([(src << POS_BITS) | upto for src, upto in alias.values()], dtype=torch.long)
    tables = []  # per entry: (kind, key, fmt, matrix in sample order, row_bytes, specs, rows per sample)
    for kind, key, fmt, keys, fields in (
            [("site", k, r.fmt, r.keys, [r.mantissa, r.scales, r.outer, r.codes]) for k, r in rec.sites.items()]
            + [("routing", k, None, kk, [v]) for k, (kk, v) in rec.routing.items()]):
        if len(keys) > 1 and not bool((keys[1:] >= keys[:-1]).all()):
            raise ValueError("pack_split needs a finished record (keys sorted)")
        pos = keys & _POS_MASK
        b = torch.searchsorted(keys, bounds)
        counts = (b[1:] - b[:-1]).tolist()
        mat, rb, specs = _row_matrix([pos, *fields])
        if alias:
            starts, lens = b[:-1].tolist(), list(counts)
            ends = dict(zip(alias, torch.searchsorted(keys, alias_at).tolist(), strict=True))
            seg_s, seg_l = [], []
            for i in range(n):
                if i in alias:
                    src = alias[i][0]
                    pre = ends[i] - starts[src]
                    seg_s.append(starts[src])
                    seg_l.append(pre)
                    counts[i] += pre
                seg_s.append(starts[i])
                seg_l.append(lens[i])
            seg_s, seg_l = torch.tensor(seg_s), torch.tensor(seg_l)
            idx = torch.repeat_interleave(seg_s - (seg_l.cumsum(0) - seg_l), seg_l) + torch.arange(int(seg_l.sum()))
            p = pos[idx]
            first = torch.zeros(len(idx) + 1, dtype=torch.bool)  # row j starts a sample
            first[torch.tensor(counts).cumsum(0)] = True
            if len(p) > 1 and not bool(((p[1:] > p[:-1]) | first[1:-1]).all()):
                # an aliased sample that also recorded prompt positions itself: the general path
                return [pack(r) for r in split_record(rec, n)]
            mat = mat[idx]
        tables.append((kind, key, fmt, mat, rb, specs, counts))
    out = []
    row0 = [0] * len(tables)
    for i in range(n):
        entries, pieces, off = [], [], 0
        for t, (kind, key, fmt, mat, rb, specs, counts) in enumerate(tables):
            rows = counts[i]
            pieces.append(mat[row0[t]:row0[t] + rows].reshape(-1))
            row0[t] += rows
            entries.append((kind, key, fmt, rows, rb, off, specs))
            off += rows * rb
        buf = torch.cat(pieces).cpu() if pieces else torch.empty(0, dtype=torch.uint8)
        out.append(PackedRecord((rec.full_codes, tuple(entries)), buf.numpy()))
    return out


def pack(rec: GuidanceRecord) -> PackedRecord:
    """One sample's record (sequence id 0, no aliases: what split_record / merge_turns give) -> PackedRecord."""
    if rec.aliases:
        raise ValueError("pack a per-sample record (split_record materializes aliases)")
    return pack_split(rec, 1)[0]


def unpack(p: PackedRecord) -> GuidanceRecord:
    """PackedRecord -> GuidanceRecord whose tensors are views of the packed bytes (read-only when
    they come from the object store: the trainer only reads and concatenates them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the object store's buffers are not writable
        buf = torch.from_numpy(p.buf)
    full_codes, entries = p.layout
    rec = GuidanceRecord(full_codes=full_codes)
    for kind, key, fmt, rows, rb, off, specs in entries:
        mat = buf[off:off + rows * rb].view(rows, rb)
        keys, *rest = (_field(mat, sp) for sp in specs)
        keys = keys.contiguous()  # searched (torch.searchsorted wants it contiguous)
        if kind == "site":
            rec.sites[key] = SiteRows(keys, *rest, fmt)
        else:
            rec.routing[key] = (keys, rest[0])
    return rec


def _batch_packed(ps: list[PackedRecord]) -> GuidanceRecord | None:
    """batch_records of packed records with the same sites: per site, the samples' row blocks
    concatenated (keys stay sorted: samples in order, each sorted by position) and its fields cut
    once; None where the layouts differ."""
    sig = lambda p: (p.layout[0], [(e[0], e[1], e[2], e[4], e[6]) for e in p.layout[1]])  # noqa: E731
    first = sig(ps[0])
    if any(sig(p) != first for p in ps[1:]):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the object store's buffers are not writable
        bufs = [torch.from_numpy(p.buf) for p in ps]
    full_codes, entries = first
    rec = GuidanceRecord(full_codes=full_codes)
    seq = torch.arange(len(ps), dtype=torch.long) << POS_BITS
    for j, (kind, key, fmt, rb, specs) in enumerate(entries):
        counts, blocks = [], []
        for p, b in zip(ps, bufs, strict=True):
            _, _, _, rows, _, off, _ = p.layout[1][j]
            counts.append(rows)
            blocks.append(b[off:off + rows * rb])
        mat = torch.cat(blocks).view(-1, rb)
        keys, *rest = (_field(mat, sp) for sp in specs)
        keys = keys | torch.repeat_interleave(seq, torch.tensor(counts))
        if kind == "site":
            rec.sites[key] = SiteRows(keys, *rest, fmt)
        else:
            rec.routing[key] = (keys, rest[0])
    return rec


def _field(mat: torch.Tensor, spec) -> torch.Tensor | None:
    """One field of a row matrix [rows, row_bytes] as its own dtype and shape (a view)."""
    if spec is None:
        return None
    dtype, shape, c = spec
    dt = getattr(torch, dtype)
    return mat[:, c:c + math.prod(shape) * dt.itemsize].view(dt).view(mat.shape[0], *shape)


def as_record(r) -> GuidanceRecord:
    """A record as shipped (packed) or kept in process (a GuidanceRecord) -> GuidanceRecord."""
    return unpack(r) if isinstance(r, PackedRecord) else r


def coverages(rec: GuidanceRecord, n: int) -> torch.Tensor:
    """[n] coverage (below) of each sequence 0..n-1 of a batched record, on the record's device."""
    keys = [s.keys for s in rec.sites.values()] + [k for k, _ in rec.routing.values()]
    dev = keys[0].device if keys else "cpu"
    cov = torch.zeros(n, dtype=torch.long, device=dev)
    for k in keys:
        cov.scatter_reduce_(0, k >> POS_BITS, (k & _POS_MASK) + 1, "amax")
    return cov


def coverage(rec: GuidanceRecord) -> int:
    """Positions 0..coverage-1 of a one-sample record are recorded. A multi-turn sample's final
    environment feedback follows its last action and is never fed to the engine; the trainer
    forwards it, but causally it cannot change any trained log-prob, so it is left unguided."""
    keys = [s.keys for s in rec.sites.values()] + [k for k, _ in rec.routing.values()]
    return max((int((k & _POS_MASK).max()) + 1 for k in keys if k.numel()), default=0)


__all__ = ["PackedRecord", "as_record", "batch_records", "coverage", "coverages", "merge_turns", "pack", "pack_split", "split_record",
           "unpack"]
