"""The per-site replay runtime on its own (no model): guided rounding reproduces the rollout,
statistics count by hand against the rollout's codes (a diagnostic record for every layer, expert
slots lined up by expert id), padding rows get plain RTN, routing replay forces the recorded experts."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trace import fp4
from trace.guidance import Recorder, RecordMismatch, Runtime, Tee, recording, replay


def _rows(n):
    return torch.zeros(1, dtype=torch.long), torch.arange(n)[None]  # seq [1], pos [1, n]


def test_plain_runtime_is_rtn_fake_quant():
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(4)).requires_grad_(True)
    y = Runtime().act(0, "attn_in", x)
    assert torch.equal(y, fp4.fake_quant(x, "nvfp4", "row"))
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_recording_then_replay_counts_flips_by_hand_and_reproduces_the_rollout():
    g = torch.Generator().manual_seed(0)
    x_roll = torch.randn(16, 64, generator=g)
    rt, rec = Runtime(), Recorder(full_codes=True)
    with recording(rt, rec, *_rows(16)):
        rt.act(3, "o_in", x_roll)
    record = rec.finish()
    x = x_roll * (1 + 0.05 * torch.randn(x_roll.shape, generator=g))
    own = fp4.quantize(x, "nvfp4", "row")
    roll = fp4.quantize(x_roll, "nvfp4", "row")
    with replay(rt, record, *_rows(16), guide=False) as st:
        y = rt.act(3, "o_in", x)
    assert torch.equal(y, own.dequantize())  # unguided: own RTN
    s = st.layer(3)
    want = int(((own.codes != roll.codes) & ((own.codes | roll.codes) & 7 != 0)).sum())
    assert s.code_flips == want > 0 and s.elements == x.numel()
    assert s.site_codes == {"o_in": [want, x.numel()]}  # the per-site split of the same count
    assert s.scale_flips == int((own.scales != roll.scales).sum()) and s.blocks == own.scales.numel()
    with replay(rt, record, *_rows(16), full_codes=True) as st:
        y = rt.act(3, "o_in", x)
    assert torch.equal(y, roll.dequantize())
    assert st.summary()["unrecoverable_rate"][3] == 0.0


def test_a_zero_code_that_changes_sign_is_not_a_flip():
    """-0 and +0 dequantize alike: elements that round to zero in both forwards but change sign are no code flip,
    while 1.0 -> 1.3 (past the midpoint 1.25 to 1.5) is one. The row's amax 6 makes the scaled values the inputs."""
    x_roll = torch.tensor([[6.0, 0.01, -0.01, 0.1, -0.2, 1.0, 2.0, -3.0] * 2])
    x = x_roll.clone()
    x[0, 1:5] = -x[0, 1:5]  # four zeros change sign
    x[0, 13] = 1.3
    rt, rec = Runtime(), Recorder(full_codes=True)
    with recording(rt, rec, *_rows(1)):
        rt.act(0, "attn_in", x_roll)
    own, roll = fp4.quantize(x, "nvfp4", "row"), fp4.quantize(x_roll, "nvfp4", "row")
    assert int((own.codes != roll.codes).sum()) == 5  # four sign bits of zero codes and one magnitude
    with replay(rt, rec.finish(), *_rows(1), guide=False) as st:
        rt.act(0, "attn_in", x)
    assert (st.layer(0).code_flips, st.layer(0).elements) == (1, 16)


def test_padding_rows_get_rtn_and_are_not_recorded():
    """Valid rows replay the rollout's quantization (guided: the trainer's values are 2% off the rollout's, so their
    own RTN differs), padding rows keep the trainer's own RTN."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 32, generator=g)
    seq, pos = torch.zeros(1, dtype=torch.long), torch.tensor([[0, 1, 2, 3, -1, -1]])
    rt, rec = Runtime(), Recorder()
    with recording(rt, rec, seq, pos):
        rt.act(0, "attn_in", x)
    record = rec.finish()
    assert record.sites[(0, "attn_in")].keys.numel() == 4
    x2 = x * (1 + 0.02 * torch.randn(x.shape, generator=g))
    x2[4:] = torch.randn(2, 32, generator=g)
    with replay(rt, record, seq, pos) as st:
        y = rt.act(0, "attn_in", x2)
    assert torch.equal(y[4:], fp4.fake_quant(x2[4:], "nvfp4", "row"))
    assert torch.equal(y[:4], fp4.quantize(x[:4], "nvfp4", "row").dequantize())
    assert not torch.equal(y[:4], fp4.fake_quant(x2[:4], "nvfp4", "row"))  # what plain RTN would give
    assert st.layer(0).blocks == 4 * 2 and st.layer(0).elements == 0  # a compact record: scales only
    with pytest.raises(RecordMismatch, match="token rows"):
        with replay(rt, record, seq, pos):
            rt.act(0, "attn_in", x[:5])


def test_route_replays_recorded_ids_with_weights_of_own_logits():
    rt, rec = Runtime(), Recorder()
    ids_roll = torch.tensor([[0, 1], [2, 3], [1, 3]])
    with recording(rt, rec, *_rows(3)):
        rt.record_routing(1, ids_roll)
    record = rec.finish()
    logits = torch.randn(3, 4, generator=torch.Generator().manual_seed(6)).requires_grad_(True)
    own = torch.topk(logits, 2).indices
    assert rt.route(1, logits, own, renorm=True) is None  # not replaying
    with replay(rt, record, *_rows(3)) as st:
        w, ids = rt.route(1, logits, own, renorm=True)
    assert torch.equal(ids, ids_roll)
    probs = torch.softmax(logits.detach(), -1).gather(1, ids_roll)
    torch.testing.assert_close(w.detach(), probs / probs.sum(-1, keepdim=True))
    same = (own.sort(-1).values == ids_roll.sort(-1).values).all(-1)
    assert st.layer(1).routing_flips == int((~same).sum()) and st.layer(1).routing_tokens == 3
    w.sum().backward()  # the router still trains
    assert logits.grad is not None
    with replay(rt, record, *_rows(3), routing=False):
        assert rt.route(1, logits, own, renorm=True) is None


def test_zero_scale_block_keeps_alignment_gradient_finite():
    g = torch.Generator().manual_seed(7)
    x_roll = torch.randn(4, 32, generator=g)
    x_roll[:, :16] = 0.0
    r = Recorder()
    r.add(0, "attn_in", fp4.quantize(x_roll, "nvfp4", "row"), torch.zeros(4, dtype=torch.long), torch.arange(4))
    x = (x_roll + 0.05 * torch.randn(4, 32, generator=g)).requires_grad_(True)
    rt = Runtime()
    with replay(rt, r.finish(), torch.zeros(1, dtype=torch.long), torch.arange(4)[None], align=True) as st:
        (rt.act(0, "attn_in", x).sum() + st.alignment_loss()).backward()
    assert torch.isfinite(x.grad).all()


def test_alignment_gradient_is_the_terms_and_saves_only_the_inputs():
    """The alignment term of a guided site is recomputed in the backward (a checkpoint): its value and
    gradient equal the terms of trace/guidance/align.py computed directly, bit for bit, while the
    forward keeps no fp32 intermediate of the site for the backward (those were half of the trainer's
    saved memory on mixtral-small)."""
    from kernels import reference as ref
    from trace.guidance.align import alignment_loss, alignment_terms, scale_terms

    g = torch.Generator().manual_seed(1)
    x_roll = torch.randn(24, 128, generator=g)
    rt, rec = Runtime(), Recorder()
    with recording(rt, rec, *_rows(24)):
        rt.act(2, "o_in", x_roll)
    record = rec.finish()
    x0 = x_roll * (1 + 0.1 * torch.randn(x_roll.shape, generator=g))
    x = x0.clone().requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with replay(rt, record, *_rows(24), align=True) as st:
            rt.act(2, "o_in", x)
    loss = st.alignment_loss()
    loss.backward()
    big = [t for t in saved if t.dtype == torch.float32 and t.numel() >= x.numel() and t.data_ptr() != x.data_ptr()]
    assert not big, [tuple(t.shape) for t in big]  # only x itself (and byte codes) kept
    own = fp4.quantize(x0, "nvfp4", "row")
    v = record.view(torch.zeros(24, dtype=torch.long), torch.arange(24)).guide(2, "o_in")
    res = fp4.guided_quantize(x0, v.mantissa, v.scales, v.outer, "nvfp4")
    xd = x0.clone().requires_grad_(True)
    scaled = fp4.scaled_values(xd, v.scales, v.outer, "nvfp4")
    c = alignment_terms(scaled, ref.e2m1_encode(scaled.detach()), res.tensor.codes)
    sc = scale_terms(xd, own.scales, v.scales)
    want = alignment_loss(c[0] + sc[0], c[1] + sc[1])
    want.backward()
    assert float(loss) > 0 and torch.equal(loss.detach(), want.detach())
    assert torch.equal(x.grad, xd.grad) and bool(xd.grad.abs().sum() > 0)


def test_flips_count_against_the_rollout_code_not_the_guided_code():
    """A compact record cannot tell the rollout's code, and the guided code is not it where the
    trainer is more than a grid step away; code flips are counted only against full codes: the
    diagnostic record (all layers, never guiding), and for every layer it has, guided or not."""
    g = torch.Generator().manual_seed(1)
    x_roll = {i: torch.randn(8, 32, generator=g) for i in range(3)}
    rt, guide, diag = Runtime(), Recorder(layers=[2]), Recorder(full_codes=True)
    with recording(rt, Tee(guide, diag), *_rows(8)):
        for i in range(3):
            rt.act(i, "o_in", x_roll[i])
    guide, diag = guide.finish(), diag.finish()
    assert guide.layers == [2] and diag.layers == [0, 1, 2]
    x = {i: x_roll[i] * (1 + 0.3 * torch.randn(8, 32, generator=g)) for i in range(3)}  # far off: some unrecoverable
    with replay(rt, guide, *_rows(8)) as st_compact:
        rt.act(2, "o_in", x[2])
    assert "code_flip_rate" in st_compact.summary() and st_compact.summary()["code_flip_rate"] == {}
    with replay(rt, guide, *_rows(8), diag=diag) as st:
        y = {i: rt.act(i, "o_in", x[i]) for i in range(3)}
    summ = st.summary()
    assert sorted(summ["code_flip_rate"]) == [0, 1, 2]  # every layer, guided or not
    for i in range(3):
        own, roll = fp4.quantize(x[i], "nvfp4", "row"), fp4.quantize(x_roll[i], "nvfp4", "row")
        want = ((own.codes != roll.codes) & ((own.codes | roll.codes) & 7 != 0)).sum()
        assert st.layer(i).code_flips == int(want) > 0
    guided = fp4.guided_quantize(x[2], roll.codes & 1, roll.scales, roll.outer)
    assert st.layer(2).unrecoverable == int(((guided.tensor.codes != roll.codes)
                                               & ((guided.tensor.codes | roll.codes) & 7 != 0)).sum()) > 0
    assert torch.equal(y[0], fp4.fake_quant(x[0], "nvfp4", "row"))  # the diagnostic record guides nothing
    with replay(rt, None, *_rows(8), diag=diag) as st_only:  # unguided arms: statistics only
        rt.act(1, "o_in", x[1])
    assert st_only.layer(1).code_flips == st.layer(1).code_flips


def test_expert_slots_are_compared_and_guided_by_expert_id():
    """Down-projection inputs are rows per (token, slot). Without routing replay the trainer's slot j
    may hold another expert than the rollout's slot j: token 0 has its two experts in swapped slots,
    token 1 routes its second slot to expert 5, which the rollout did not use. Slots are matched by
    expert id: the swapped pair compares equal rows (0 flips; slot by slot it was 2 x 32 elements of
    two different experts), the unmatched slot is left out (3 x 32 elements counted) and keeps its
    own RTN, while matched slots are guided with the rows of their own expert."""
    g = torch.Generator().manual_seed(2)
    h_roll = torch.randn(2, 2, 32, generator=g)  # [N, k, I]
    ids_roll = torch.tensor([[0, 1], [2, 3]])
    rt, rec = Runtime(), Recorder(full_codes=True)
    with recording(rt, rec, *_rows(2)):
        rt.record_routing(0, ids_roll)
        rt.act(0, "moe_down_in", h_roll)
    record = rec.finish()
    ids_own = torch.tensor([[1, 0], [2, 5]])
    h_own = torch.stack([h_roll[0].flip(0), torch.stack([h_roll[1, 0], torch.randn(32, generator=g)])])
    logits = torch.randn(2, 6, generator=g)
    with replay(rt, record, *_rows(2), routing=False, guide=False) as st:
        assert rt.route(0, logits, ids_own, renorm=True) is None
        rt.act(0, "moe_down_in", h_own)
    s = st.layer(0)
    assert (s.elements, s.code_flips, s.routing_tokens, s.routing_flips) == (3 * 32, 0, 2, 1)
    h_near = h_own * (1 + 0.01 * torch.randn(h_own.shape, generator=g))
    with replay(rt, record, *_rows(2), routing=False) as st:
        rt.route(0, logits, ids_own, renorm=True)
        y = rt.act(0, "moe_down_in", h_near)
    roll = fp4.quantize(h_roll, "nvfp4", "row").dequantize()
    assert torch.equal(y[0], roll[0].flip(0)) and torch.equal(y[1, 0], roll[1, 0])
    assert torch.equal(y[1, 1], fp4.fake_quant(h_near[1, 1], "nvfp4", "row"))
    with replay(rt, record, *_rows(2)) as st:  # routing replayed: the record's slots, in order
        _, ids = rt.route(0, logits, ids_own, renorm=True)
        assert torch.equal(ids, ids_roll)
        assert torch.equal(rt.act(0, "moe_down_in", h_roll), roll)
    assert st.layer(0).elements == 4 * 32 and st.layer(0).code_flips == 0


class _HostSyncs(TorchDispatchMode):
    """Counts the ops that make the host wait for the device on a GPU (a value read on the host, or an
    output size that depends on values): on the GPU each one stalls the launch queue."""

    OPS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.equal.default",
           "aten.masked_select.default", "aten.is_nonzero.default"}

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        bool_index = name.startswith(("aten.index.Tensor", "aten.index_put")) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or []))
        self.n += name in self.OPS or bool_index
        return func(*args, **(kwargs or {}))


def test_replay_never_makes_the_host_wait():
    """Neither the trainer's plain RTN sites nor a guided replay with alignment, routing replay, expert
    slots, padding rows and a diagnostic record wait for the device: the finiteness of activations is
    checked through the logits and the loss, lookups, flip counts and the alignment term stay on the
    device, and whether every row was found is checked once, when the block ends."""
    g = torch.Generator().manual_seed(3)
    seq, pos = torch.arange(2), torch.tensor([[0, 1, 2, -1], [0, 1, 2, 3]])  # one padding row
    n, k = 8, 2
    xs = {(layer, site): torch.randn(n, *shape, generator=g) for layer in (0, 1)
          for site, shape in (("attn_in", (64,)), ("moe_down_in", (k, 32)))}
    ids = torch.randint(0, 4, (n, 1), generator=g) + torch.tensor([[0, 4]])  # [n, k] distinct experts
    rt, guide, diag = Runtime(), Recorder(layers=[1]), Recorder(full_codes=True)
    with recording(rt, Tee(guide, diag), seq, pos):
        for (layer, site), x in xs.items():
            rt.record_routing(layer, ids) if site == "attn_in" else None
            rt.act(layer, site, x)
    guide, diag = guide.finish(), diag.finish()
    near = {key: (x * 1.01).requires_grad_(True) for key, x in xs.items()}
    with _HostSyncs() as plain:
        for key, x in near.items():
            rt.act(*key, x)
    with replay(rt, guide, seq, pos, align=True, diag=diag) as st:
        with _HostSyncs() as guided:
            for (layer, site), x in near.items():
                if site == "attn_in":
                    rt.route(layer, torch.randn(n, 8, generator=g), ids.flip(-1), renorm=True)
                rt.act(layer, site, x)
            st.alignment_loss().backward()
    with _HostSyncs() as control:  # the counter sees a library call that does wait (its value check)
        fp4.quantize(near[(0, "attn_in")].detach(), "nvfp4", "row")
    assert control.n > 0
    assert plain.n == 0 and guided.n == 0, (plain.n, guided.n)
    assert st.summary()["code_flip_rate"].keys() == {0, 1}


@pytest.mark.parametrize("align_scales", [True, False])
def test_fused_alignment_term_equals_the_torch_term(monkeypatch, align_scales):
    """A replay step with alignment on the fused kernels (kernels/align.py, TRACE_FP4_ALIGN=on; the Triton
    interpreter here) against the torch ops (off): the same flip counts, the loss within fp32 summation order
    (rtol 1e-5: a sum of >= 0 hinges in another order), and x's gradients bit-equal except at each row's amax
    element, whose share of the row amax's gradient is a sum over the row's blocks in another order (rtol 1e-5,
    atol 1e-6 of the largest gradient); dense and expert-slot [n, k, I] sites, routing replayed."""
    g = torch.Generator().manual_seed(12)
    n, k = 6, 2
    xs = {(0, "attn_in"): torch.randn(n, 64, generator=g), (0, "moe_down_in"): torch.randn(n, k, 48, generator=g)}
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [0, 3], [3, 1], [2, 0]])
    rt, rec = Runtime(), Recorder()
    with recording(rt, rec, *_rows(n)):
        rt.record_routing(0, ids)
        for (layer, site), x in xs.items():
            rt.act(layer, site, x)
    record = rec.finish()
    near = {key: x * (1 + 0.1 * torch.randn(x.shape, generator=g)) for key, x in xs.items()}
    w = {key: torch.randn(x.shape, generator=g) for key, x in xs.items()}
    logits = torch.randn(n, 4, generator=g)

    def step(mode):
        monkeypatch.setenv("TRACE_FP4_ALIGN", mode)
        xg = {key: x.clone().requires_grad_(True) for key, x in near.items()}
        with replay(rt, record, *_rows(n), align=True, align_scales=align_scales) as st:
            rt.route(0, logits, ids.flip(-1), renorm=True)
            out = sum((rt.act(*key, x) * w[key]).sum() for key, x in xg.items())
        loss = st.alignment_loss()
        (out + loss).backward()
        return loss.detach(), {key: x.grad for key, x in xg.items()}, st

    want, gw, sw = step("off")
    got, gg, sg = step("on")
    assert float(want) > 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    for key, x in near.items():
        a = x.abs()
        at_max = (a == a.amax(-1, keepdim=True)) if align_scales else torch.zeros_like(a, dtype=torch.bool)
        assert torch.equal(gg[key][~at_max], gw[key][~at_max]), key
        torch.testing.assert_close(gg[key][at_max], gw[key][at_max], rtol=1e-5,
                                   atol=1e-6 * float(gw[key].abs().max()))
    assert sg.align_parts.keys() == sw.align_parts.keys() == ({("codes", 0), ("scales", 0)} if align_scales
                                                             else {("codes", 0)})
    for key, (total, items, flipped) in sw.align_parts.items():
        assert int(sg.align_parts[key][1]) == int(items) and int(sg.align_parts[key][2]) == int(flipped) > 0
        torch.testing.assert_close(torch.as_tensor(sg.align_parts[key][0]).detach(),
                                   torch.as_tensor(total).detach(), rtol=1e-5, atol=0)


def test_fused_alignment_saves_only_the_inputs_and_never_waits(monkeypatch):
    """With the fused term the forward keeps no fp32 tensor of the site's size but x for the backward, and the
    host never waits for the device."""
    monkeypatch.setenv("TRACE_FP4_ALIGN", "on")
    g = torch.Generator().manual_seed(13)
    x_roll = torch.randn(16, 128, generator=g)
    rt, rec = Runtime(), Recorder()
    with recording(rt, rec, *_rows(16)):
        rt.act(1, "o_in", x_roll)
    record = rec.finish()
    x = (x_roll * (1 + 0.1 * torch.randn(x_roll.shape, generator=g))).requires_grad_(True)
    saved = []
    with replay(rt, record, *_rows(16), align=True) as st:
        with _HostSyncs() as syncs:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                rt.act(1, "o_in", x)
            st.alignment_loss().backward()
    big = [t for t in saved if t.dtype == torch.float32 and t.numel() >= x.numel() and t.data_ptr() != x.data_ptr()]
    assert not big, [tuple(t.shape) for t in big]
    assert syncs.n == 0, syncs.n
    assert bool(x.grad.abs().sum() > 0)
