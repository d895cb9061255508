"""The per-site replay runtime on its own (no model): guided rounding reproduces the rollout,
statistics count by hand, padding rows get plain RTN, routing replay forces the recorded experts,
and gradient descent on the alignment term removes the flips."""
import pytest
import torch

from trace import fp4
from trace.guidance import Recorder, RecordMismatch, Runtime, recording, replay


def _rows(n):
    return torch.zeros(1, dtype=torch.long), torch.arange(n)[None]  # seq [1], pos [1, n]


def test_plain_runtime_is_rtn_fake_quant():
    x = torch.randn(5, 32, requires_grad=True)
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
    assert s.scale_flips == int((own.scales != roll.scales).sum()) and s.blocks == own.scales.numel()
    with replay(rt, record, *_rows(16), full_codes=True) as st:
        y = rt.act(3, "o_in", x)
    assert torch.equal(y, roll.dequantize())
    assert st.summary()["unrecoverable_rate"][3] == 0.0


def test_padding_rows_get_rtn_and_are_not_recorded():
    x = torch.randn(6, 32)
    seq, pos = torch.zeros(1, dtype=torch.long), torch.tensor([[0, 1, 2, 3, -1, -1]])
    rt, rec = Runtime(), Recorder()
    with recording(rt, rec, seq, pos):
        rt.act(0, "attn_in", x)
    record = rec.finish()
    assert record.sites[(0, "attn_in")].keys.numel() == 4
    x2 = x.clone()
    x2[4:] = torch.randn(2, 32)
    with replay(rt, record, seq, pos) as st:
        y = rt.act(0, "attn_in", x2)
    assert torch.equal(y[4:], fp4.fake_quant(x2[4:], "nvfp4", "row"))
    assert torch.equal(y[:4], fp4.quantize(x[:4], "nvfp4", "row").dequantize())
    assert st.layer(0).elements == 4 * 32
    with pytest.raises(RecordMismatch, match="token rows"):
        with replay(rt, record, seq, pos):
            rt.act(0, "attn_in", x[:5])


def test_route_replays_recorded_ids_with_weights_of_own_logits():
    rt, rec = Runtime(), Recorder()
    ids_roll = torch.tensor([[0, 1], [2, 3], [1, 3]])
    with recording(rt, rec, *_rows(3)):
        rt.record_routing(1, ids_roll)
    record = rec.finish()
    logits = torch.randn(3, 4, requires_grad=True)
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


def test_alignment_loss_pulls_trainer_rounding_toward_rollout():
    """Gradient descent on the alignment loss moves the trainer's own RTN rounding (under the
    recorded scales) onto the rollout's codes: the number of flipped elements falls to ~0."""
    g = torch.Generator().manual_seed(0)
    x_roll = torch.randn(64, 128, generator=g)
    rec = Recorder()
    n = x_roll.shape[0]
    rec.add(0, "attn_in", fp4.quantize(x_roll, "nvfp4", "row"), torch.zeros(n, dtype=torch.long), torch.arange(n))
    record = rec.finish()
    x = (x_roll * (1 + 0.02 * torch.randn(x_roll.shape, generator=g))).requires_grad_(True)
    opt = torch.optim.SGD([x], lr=20.0)  # the loss is a mean over flipped elements: small per-element grads
    counts, losses = [], []
    for _ in range(30):
        rt = Runtime()
        with replay(rt, record, torch.zeros(1, dtype=torch.long), torch.arange(n)[None], align=True) as st:
            y = rt.act(0, "attn_in", x)
        assert torch.equal(y.detach(), fp4.quantize(x_roll, "nvfp4", "row").dequantize())  # guided = rollout
        a = st.alignment_loss()
        counts.append(st.align_count)
        losses.append(a.item())
        if st.align_count == 0:
            break
        opt.zero_grad()
        a.backward()
        opt.step()
    assert counts[0] > 50 and losses[0] > 0
    assert counts[-1] <= counts[0] // 20, counts



def test_zero_scale_block_keeps_alignment_gradient_finite():
    x_roll = torch.randn(4, 32)
    x_roll[:, :16] = 0.0
    r = Recorder()
    r.add(0, "attn_in", fp4.quantize(x_roll, "nvfp4", "row"), torch.zeros(4, dtype=torch.long), torch.arange(4))
    x = (x_roll + 0.05 * torch.randn(4, 32)).requires_grad_(True)
    rt = Runtime()
    with replay(rt, r.finish(), torch.zeros(1, dtype=torch.long), torch.arange(4)[None], align=True) as st:
        (rt.act(0, "attn_in", x).sum() + st.alignment_loss()).backward()
    assert torch.isfinite(x.grad).all()
