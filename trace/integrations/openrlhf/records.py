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
    aliased prompt rows (samples sharing a prefilled prompt) copied into each sample's record."""
    def pick(keys: torch.Tensor, i: int) -> torch.Tensor:
        seqs, pos = keys >> _POS_BITS, keys & _POS_MASK
        m = seqs == i
        if i in rec.aliases:
            src, upto = rec.aliases[i]
            m = m | ((seqs == src) & (pos < upto))
        idx = m.nonzero().squeeze(-1)
        return idx[torch.argsort(keys[idx] & _POS_MASK)]

    out = []
    for i in range(n):
        r = GuidanceRecord(full_codes=rec.full_codes)
        for key, s in rec.sites.items():
            idx = pick(s.keys, i)
            r.sites[key] = SiteRows(s.keys[idx] & _POS_MASK, s.mantissa[idx], s.scales[idx], s.outer[idx],
                                    s.codes[idx] if s.codes is not None else None, s.fmt)
        for layer, (k, v) in rec.routing.items():
            idx = pick(k, i)
            r.routing[layer] = (k[idx] & _POS_MASK, v[idx])
        out.append(r)
    return out


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


__all__ = ["batch_records", "coverage", "merge_turns", "split_record", "to_device"]
