"""QAT patching on every family's tiny flavor: names/state unchanged, bf16 bit-identical, gradients
reach every weight, routing replay forces the recorded experts and still trains the router, and a
record made in float32 replays into a bfloat16 forward far more closely than an unguided forward."""
import copy

import pytest
import torch

from benchmarks.trainer_memory import SavedStorages
from trace.guidance import Recorder, guided_layer_indices
from trace.models import build_model, list_models
from trace.qat import patch_model, recording, replay

FAMILIES = list_models(flavor="tiny")  # every registered family


def _batch(b=3, t=24, seed=0):
    ids = torch.randint(5, 100, (b, t), generator=torch.Generator().manual_seed(seed))
    return ids, torch.arange(b), torch.arange(t).expand(b, t)


def _recorded_fp32(name):
    """A w4a4kv4 tiny model, a batch, and the full-codes record of its float32 forward."""
    m = build_model(name, seed=0)
    patch_model(m, "w4a4kv4")
    ids, seq, pos = _batch()
    rec = Recorder(full_codes=True)
    with torch.no_grad(), recording(m, rec, seq, pos):
        lp_roll = _token_lp(m, ids)
    return m, ids, seq, pos, rec.finish(), lp_roll


def _token_lp(model, ids):
    lp = torch.log_softmax(model(ids).logits.float(), -1)
    return lp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, T-1]


@pytest.mark.parametrize("name", FAMILIES)
def test_patch_keeps_names_and_bf16_is_bit_identical(name):
    m = build_model(name, seed=0)
    ref_model = copy.deepcopy(m)
    sd0 = {k: v.clone() for k, v in m.state_dict().items()}
    patch_model(m, "bf16").experts = "loop"  # the reference path; the grouped one: tests/qat/test_experts.py
    sd1 = m.state_dict()
    assert list(sd0) == list(sd1)
    assert all(torch.equal(sd0[k], sd1[k]) and sd0[k].dtype == sd1[k].dtype for k in sd0)
    assert [n for n, _ in m.named_parameters()] == [n for n, _ in ref_model.named_parameters()]
    ids, _, _ = _batch()
    with torch.no_grad():
        assert torch.equal(m(ids).logits, ref_model(ids).logits)
    # the expert loop is ours in bf16 mode too (per-expert views through unbind): gradients bit-identical (the
    # grouped path sums a token's expert gradients before autograd adds the router's and shared expert's: float order)
    for model in (m, ref_model):
        model(ids).logits.float().pow(2).mean().backward()
    grads = dict(m.named_parameters())
    for k, p in ref_model.named_parameters():
        assert (p.grad is None) == (grads[k].grad is None) and (p.grad is None or torch.equal(p.grad, grads[k].grad)), k
    m.zero_grad(set_to_none=True)
    # and w4a4kv4 really changes the forward
    patch_model(m, "w4a4kv4")
    with torch.no_grad():
        assert not torch.allclose(m(ids).logits, ref_model(ids).logits, atol=1e-4)


@pytest.mark.parametrize("name", FAMILIES)
def test_gradients_reach_every_weight_through_fake_quant(name):
    m = build_model(name, seed=0)
    patch_model(m, "w4a4kv4")
    ids, _, _ = _batch(b=8, t=32, seed=1)
    out = m(ids, labels=ids)
    out.loss.backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()
               or p.grad.abs().sum() == 0]
    assert missing == []


@pytest.mark.parametrize("name", FAMILIES)
def test_record_fp32_replay_bf16_guided_is_far_closer(name):
    m, ids, seq, pos, record, lp_roll = _recorded_fp32(name)
    ac = torch.autocast("cpu", dtype=torch.bfloat16)
    with torch.no_grad(), ac:
        with replay(m, record, seq, pos, guide=False) as st_un:
            lp_un = _token_lp(m, ids)
        with replay(m, record, seq, pos) as st_g:
            lp_g = _token_lp(m, ids)
    d_un = (lp_un - lp_roll).abs().mean().item()
    d_g = (lp_g - lp_roll).abs().mean().item()
    summ = st_g.summary()
    # every guided element reproduces the recorded code except the reported unrecoverable ones:
    # with all layers guided there are none, and the unguided forward flips many
    assert all(v == 0.0 for v in summ["unrecoverable_rate"].values())
    assert min(st_un.summary()["code_flip_rate"].values()) > 0.01
    assert d_g < d_un / 10, (d_g, d_un)


def test_partial_guidance_reports_unrecoverable_and_helps():
    m, ids, seq, pos, record, lp_roll = _recorded_fp32("mixtral-tiny")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with replay(m, record, seq, pos, guide=False):
            d_un = (_token_lp(m, ids) - lp_roll).abs().mean().item()
        layers = guided_layer_indices(len(m.model.layers), 0.5)
        with replay(m, record, seq, pos, guide_layers=layers) as st:
            d_half = (_token_lp(m, ids) - lp_roll).abs().mean().item()
    unrec = st.summary()["unrecoverable_rate"]
    assert set(layers) <= set(unrec) and sum(unrec[i] for i in layers) > 0  # upstream drift is reported
    assert d_half < d_un


def test_routing_replay_forces_recorded_experts_and_trains_router():
    m = build_model("qwen3_moe-tiny", seed=0)
    patch_model(m, "w4a4")
    ids, seq, pos = _batch()
    rec = Recorder()
    with torch.no_grad(), recording(m, rec, seq, pos):
        m(ids)
    record = rec.finish()
    # perturb every router so that its own top-k differs from the recorded one
    with torch.no_grad():
        for layer in m.model.layers:
            layer.mlp.gate.weight.add_(torch.randn_like(layer.mlp.gate.weight))
    seen = {}
    orig = type(m.model.layers[2].mlp.experts).forward  # one class shared by every layer

    def spy(self, h, idx, w):
        seen[self._trace_layer] = idx.clone()
        return orig(self, h, idx, w)

    type(m.model.layers[2].mlp.experts).forward = spy
    try:
        with replay(m, record, seq, pos, guide=False) as st:
            loss = m(ids, labels=ids).loss
        loss.backward()
    finally:
        type(m.model.layers[2].mlp.experts).forward = orig
    flat_seq, flat_pos = seq[:, None].expand_as(pos).reshape(-1), pos.reshape(-1)
    for i in range(len(m.model.layers)):
        assert torch.equal(seen[i], record.lookup_routing(i, flat_seq, flat_pos))
    assert st.summary()["routing_flip_rate"][2] > 0.1  # its own routing would have differed
    for layer in m.model.layers:
        g = layer.mlp.gate.weight.grad
        assert g is not None and g.abs().sum() > 0


def test_full_codes_replay_reproduces_the_rollout_exactly_and_zero_scales_keep_grads_finite():
    m, ids, seq, pos, record, lp_roll = _recorded_fp32("qwen3_moe-tiny")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        layers = guided_layer_indices(len(m.model.layers), 0.5)
        with replay(m, record, seq, pos, guide_layers=layers) as st_m:
            _token_lp(m, ids)
        with replay(m, record, seq, pos, guide_layers=layers, full_codes=True) as st_f:
            _token_lp(m, ids)
    assert sum(st_m.summary()["unrecoverable_rate"][i] for i in layers) > 0
    assert all(st_f.summary()["unrecoverable_rate"][i] == 0 for i in layers)
    with pytest.raises(Exception, match="full_codes=True"):
        rec2 = Recorder()
        with torch.no_grad(), recording(m, rec2, seq, pos):
            m(ids)
        with torch.no_grad(), replay(m, rec2.finish(), seq, pos, full_codes=True):
            m(ids)
    del lp_roll


@pytest.mark.parametrize("name", ["qwen3_moe-tiny", "qwen2_moe-tiny"])
def test_fake_quant_sites_do_not_read_values_on_the_host(monkeypatch, name):
    """The QAT forward's FP4 sites (weights, activations, KV) never run the library's finiteness check, a
    wait for the device per call on a GPU; the trainers check their logits and loss instead."""
    import trace.fp4.tensor as T

    calls = []
    check = T.check_finite
    monkeypatch.setattr(T, "check_finite", lambda x, name="input": (calls.append(name), check(x, name)))
    m = build_model(name, seed=0)
    patch_model(m, "w4a4kv4")
    ids, _, _ = _batch()
    m(ids).logits.sum().backward()
    assert calls == []
    T.quantize(torch.ones(2, 16))  # the library's own entry still checks
    assert calls == ["input"]


def test_the_kernel_path_trains_bit_for_bit_like_the_reference(monkeypatch, name="mixtral-tiny"):
    """A w4a4kv4 model under BF16 autocast, plain (qat-independent) and recording then replaying with
    partial guidance and the alignment term (trace): logits, alignment loss and every gradient equal with
    the FP4 library on the Triton quantize kernel (TRACE_FP4_KERNELS=on) and on the
    reference ops."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU: the compiled kernel
    ids, seq, pos = (t.to(dev) for t in _batch())
    results = {}
    for mode in ("off", "on"):
        monkeypatch.setenv("TRACE_FP4_KERNELS", mode)
        m = build_model(name, seed=0, device=dev)
        patch_model(m, "w4a4kv4")
        out = {}
        with torch.autocast(dev, dtype=torch.bfloat16):
            lp = _token_lp(m, ids)
            lp.sum().backward()
            out["plain"] = (lp.detach(), {k: p.grad.clone() for k, p in m.named_parameters()})
            m.zero_grad(set_to_none=True)
            rec = Recorder()
            with torch.no_grad(), recording(m, rec, seq, pos):
                _token_lp(m, ids)
            layers = guided_layer_indices(len(m.model.layers), 0.5)
            with replay(m, rec.finish(), seq, pos, guide_layers=layers, align=True) as st:
                lp = _token_lp(m, ids)
                al = st.alignment_loss()
            (lp.sum() + al).backward()
            out["trace"] = (torch.cat([lp.detach().flatten(), al.detach().reshape(1)]),
                            {k: p.grad.clone() for k, p in m.named_parameters()})
        results[mode] = out
    for arm in ("plain", "trace"):
        (a, ga), (b, gb) = results["off"][arm], results["on"][arm]
        assert torch.equal(a, b), arm
        assert ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga), arm


def _layer_outputs(name: str, dev: str) -> dict[str, list[torch.Tensor]]:
    """Each decoder layer's output of a w4a4kv4 `name` under BF16 autocast: plain, and replaying a record
    with partial guidance."""
    ids, seq, pos = (t.to(dev) for t in _batch())
    m = build_model(name, seed=0, device=dev)
    patch_model(m, "w4a4kv4")
    got: dict[str, list] = {"plain": [], "trace": []}
    arm: list = ["plain"]

    def keep(_mod, _inp, out):
        if arm[0] is not None:
            got[arm[0]].append((out[0] if isinstance(out, tuple) else out).detach())

    hooks = [layer.register_forward_hook(keep) for layer in m.model.layers]
    with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16):
        _token_lp(m, ids)
        rec = Recorder()
        arm[0] = None  # the recording forward is the plain one again
        with recording(m, rec, seq, pos):
            _token_lp(m, ids)
        arm[0] = "trace"
        with replay(m, rec.finish(), seq, pos, guide_layers=guided_layer_indices(len(m.model.layers), 0.5)):
            _token_lp(m, ids)
    for h in hooks:
        h.remove()
    return got


@pytest.mark.parametrize("name", [
    "mixtral-tiny",  # the CPU runs the kernel in the interpreter; a small flavor there takes minutes
    pytest.param("mixtral-small", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
    pytest.param("qwen3_moe-small", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
])
def test_the_kernel_path_forward_layer_by_layer(monkeypatch, name):
    """The forward at the runs' widths (small flavors: the experts' 1792, thousands of rows per expert), plain
    and replaying: every decoder layer's output equal on the kernel path and on the reference ops; a failure
    names the first layer that differs."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    outs = {}
    for mode in ("off", "on"):
        monkeypatch.setenv("TRACE_FP4_KERNELS", mode)
        outs[mode] = _layer_outputs(name, dev)
    for arm in ("plain", "trace"):
        a, b = outs["off"][arm], outs["on"][arm]
        assert len(a) == len(b) > 0
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if not torch.equal(x, y)), None)
        assert first is None, f"{arm}: layer {first} is the first whose output differs"


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("autocast", [False, True])
def test_recomputed_experts_change_nothing_but_what_is_kept(name, autocast):
    """`recompute_experts` (the trainer's rl.recompute_experts): the expert MLPs run again in the backward, so
    the forward, every gradient and the guided replay's alignment term are bit-identical to keeping them, under
    BF16 autocast too; and autograd keeps less."""
    m, ids, seq, pos, record, _ = _recorded_fp32(name)
    results = []
    for recompute in (False, True):
        m.zero_grad(set_to_none=True)
        m._trace_rt.recompute_experts = recompute
        kept = SavedStorages(m.parameters())  # each storage once; the parameters' own are not counted
        with kept(), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
                replay(m, record, seq, pos, align=True, guide_layers=guided_layer_indices(4, 0.5)) as stats:
            logits = m(ids).logits.float()
            loss = logits.pow(2).mean() + 0.1 * stats.alignment_loss()
        loss.backward()
        results.append((logits.detach(), loss.detach(), {k: p.grad.clone() for k, p in m.named_parameters()
                                                          if p.grad is not None}, sum(kept.by.values())))
    (l0, s0, g0, kept0), (l1, s1, g1, kept1) = results
    assert torch.equal(l0, l1) and torch.equal(s0, s1)
    assert g0.keys() == g1.keys() and all(torch.equal(g0[k], g1[k]) for k in g0), name
    assert kept1 < kept0
