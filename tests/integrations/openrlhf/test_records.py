"""Per-sample records, merged per micro-batch, give exactly the rows of a record made for the batch;
packed for the object store they come back byte for byte."""
import pickle

import torch

from trace.guidance.record import Recorder
from trace.integrations.openrlhf.records import (
    PackedRecord,
    as_record,
    batch_records,
    coverage,
    coverages,
    merge_turns,
    pack,
    pack_split,
    split_record,
    unpack,
)
from trace.models import build_model
from trace.qat import patch_model, recording


def _record(model, ids, seq_id, pos0=0):
    rec = Recorder(layers=None, full_codes=True)
    pos = torch.arange(pos0, pos0 + ids.shape[1])[None]
    with torch.no_grad(), recording(model, rec, torch.tensor([seq_id]), pos):
        model(input_ids=ids)
    return rec.finish()


def test_batch_and_turns():
    torch.manual_seed(0)
    model = build_model("qwen3_moe-tiny", seed=0)
    patch_model(model, "w4a4kv4")
    a, b = torch.randint(5, 90, (1, 6)), torch.randint(5, 90, (1, 4))
    # the engine records every sample as seq 0; the trainer renumbers them to their batch rows
    rec = batch_records([_record(model, a, 0), _record(model, b, 0)])
    direct = [_record(model, a, 0), _record(model, b, 1)]
    for layer, site in rec.sites:
        for s, (ids, d) in enumerate(zip((a, b), direct, strict=True)):
            pos = torch.arange(ids.shape[1])
            got = rec.lookup(layer, site, torch.full_like(pos, s), pos)
            want = d.lookup(layer, site, torch.full_like(pos, s), pos)
            assert torch.equal(got.mantissa, want.mantissa) and torch.equal(got.scales, want.scales)
    for layer in rec.routing:
        pos = torch.arange(4)
        assert torch.equal(rec.lookup_routing(layer, torch.ones_like(pos), pos),
                           direct[1].lookup_routing(layer, torch.ones_like(pos), pos))
    # a second turn re-records positions 0..5 (prefill of the longer context): the first turn wins
    turn1 = _record(model, a, 0)
    longer = torch.cat([a, torch.randint(5, 90, (1, 3))], dim=1)
    turn2 = _record(model, longer, 0)
    merged = merge_turns([turn1, turn2])
    for (layer, site), rows in merged.sites.items():
        assert rows.keys.tolist() == list(range(9))
        assert torch.equal(rows.mantissa[:6], turn1.sites[(layer, site)].mantissa)


def test_split_record_materializes_aliases():
    model = build_model("qwen3_moe-tiny", seed=0)
    patch_model(model, "w4a4kv4")
    a = torch.randint(5, 90, (1, 5))
    full = _record(model, a, 0)
    # a batch record where sample 1 shares sample 0's first 3 positions (alias) and owns 3..4
    rec = Recorder(layers=None, full_codes=True)
    with torch.no_grad(), recording(model, rec, torch.tensor([0]), torch.arange(5)[None]):
        model(input_ids=a)
    with torch.no_grad(), recording(model, rec, torch.tensor([1]), torch.arange(3, 5)[None]):
        model(input_ids=a[:, 3:5])  # rows at positions 3, 4 (values differ; only the keys matter here)
    rec.alias(1, 0, 3)
    s0, s1 = split_record(rec.finish(), 2)
    for key in full.sites:
        assert torch.equal(s0.sites[key].keys, full.sites[key].keys)
        assert s1.sites[key].keys.tolist() == list(range(5))
        assert torch.equal(s1.sites[key].mantissa[:3], full.sites[key].mantissa[:3])


def _tensors(rec):
    for key, r in rec.sites.items():
        yield from ((key, f, getattr(r, f)) for f in ("keys", "mantissa", "scales", "outer", "codes"))
    for layer, (k, v) in rec.routing.items():
        yield from (((layer,), "keys", k), ((layer,), "ids", v))


def test_pack_round_trip_is_exact():
    model = build_model("qwen3_moe-tiny", seed=0)
    patch_model(model, "w4a4kv4")
    ids = torch.randint(5, 90, (1, 7))
    for full in (True, False):
        rec = Recorder(layers=[1, 3], full_codes=full)
        with torch.no_grad(), recording(model, rec, torch.tensor([0]), torch.arange(7)[None]):
            model(input_ids=ids)
        rec = rec.finish()
        packed = pickle.loads(pickle.dumps(pack(rec)))
        assert isinstance(packed, PackedRecord)
        packed.buf.setflags(write=False)  # as the object store hands it out
        got = as_record(packed)
        assert got.full_codes == rec.full_codes and list(got.sites) == list(rec.sites)
        assert list(got.routing) == list(rec.routing) and len(list(_tensors(rec))) > 0
        for (k1, f1, a), (k2, f2, b) in zip(_tensors(rec), _tensors(got), strict=True):
            assert (k1, f1) == (k2, f2) and (a is None) == (b is None)
            if a is not None:
                assert a.dtype == b.dtype and torch.equal(a, b), (k1, f1)
        assert all(got.sites[k].fmt == rec.sites[k].fmt for k in rec.sites)
        for compact in (True, False):  # the bytes column, from the layout alone
            assert packed.total_bytes(compact) == rec.total_bytes(compact)
            assert packed.bytes_per_generated_token(3, compact) == rec.bytes_per_generated_token(3, compact)
        assert as_record(rec) is rec
        # the trainer batches unpacked records like any other
        both = batch_records([got, unpack(pack(rec))])
        key = next(iter(rec.sites))
        assert torch.equal(both.sites[key].mantissa, torch.cat([rec.sites[key].mantissa] * 2))


def _same(a, b):
    """Same sites, routing layers and tensors (in any dict order)."""
    ta, tb = sorted(_tensors(a), key=lambda e: (str(e[0]), e[1])), sorted(_tensors(b), key=lambda e: (str(e[0]), e[1]))
    assert ta and len(ta) == len(tb)
    for (k1, f1, x), (k2, f2, y) in zip(ta, tb, strict=True):
        assert (k1, f1) == (k2, f2) and (x is None) == (y is None)
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), (k1, f1)


def test_pack_split_and_batch_of_packed_records():
    """pack_split (the rollout's path) == pack(split_record(...)), aliases included, and a micro-batch
    of packed records == the micro-batch of the same records unpacked."""
    model = build_model("qwen3_moe-tiny", seed=0)
    patch_model(model, "w4a4kv4")
    a = torch.randint(5, 90, (1, 5))
    rec = Recorder(layers=[0, 2], full_codes=True)
    with torch.no_grad(), recording(model, rec, torch.tensor([0, 2]), torch.arange(5).expand(2, 5)):
        model(input_ids=a.expand(2, 5))
    with torch.no_grad(), recording(model, rec, torch.tensor([1]), torch.arange(3, 6)[None]):
        model(input_ids=a[:, 2:5])
    rec.alias(1, 0, 3)  # sample 1 shares sample 0's positions 0..2 and owns 3..5
    rec = rec.finish()
    split = split_record(rec, 3)
    packed = pack_split(rec, 3)
    for r, p in zip(split, packed, strict=True):
        _same(r, unpack(p))
        assert p.layout == pack(r).layout and (p.buf == pack(r).buf).all()
    order = [2, 0, 1]  # OpenRLHF shuffles samples into micro-batches
    got = batch_records([packed[i] for i in order])
    want = batch_records([split[i] for i in order])
    _same(want, got)
    assert coverages(got, 3).tolist() == [coverage(split[i]) for i in order] == [5, 5, 6]
