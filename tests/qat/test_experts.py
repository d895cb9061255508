"""The grouped experts' path (trace/qat/experts.py) against the loop, the reference: for every family and every
arm's trainer forward (its mode, records, replay and alignment term, under BF16 autocast with a record of a float32
"rollout", so codes flip and routing differs), the logits, the loss and every gradient equal within BF16 autocast's
tolerance, and what the FP4 sites compute is the same bit for bit: every fake-quantized operand (activations as
guided or replayed, weights), the trainer's own codes and scales, the records, and the replay's flip, unrecoverable,
routing and alignment-term statistics. The grouped GEMM itself: `torch._grouped_mm` gives the segment loop's
values (CPU forward; on a GPU, forward and backward at a small flavor)."""
from __future__ import annotations

import contextlib

import pytest
import torch

from trace import config as C
from trace.arms import ARMS
from trace.guidance import Method, Recorder, Tee
from trace.models import build_model, list_models
from trace.qat import patch_model, recording
from trace.qat.experts import PATHS, grouped_linear, resolve

FAMILIES = list_models(flavor="tiny")  # every registered family
# every arm's trainer forward: (arm, rho); trace-deep is trace guiding the deepest half; exact's trainer forward is
# its plain QAT forward (no record), which the pinned layer inputs leave unchanged inside each layer
ARM_CASES = [("bf16", 1.0), ("fp4-naive", 1.0), ("qat-independent", 1.0), ("qat-weight-only", 1.0), ("trace", 1.0),
             ("trace", 0.5), ("trace-fullcodes", 0.5), ("trace-noalign", 0.5), ("trace-noroutingreplay", 0.5),
             ("exact", 1.0)]
CASE_IDS = [f"{a}-rho{r}" if a.startswith("trace") else a for a, r in ARM_CASES]


def _batch(dev="cpu", b=2, t=20, seed=0):
    """ids [B, T], seq [B], pos [B, T] with the last 5 positions of sequence 1 padding (-1)."""
    ids = torch.randint(5, 100, (b, t), generator=torch.Generator().manual_seed(seed))
    pos = torch.arange(t).repeat(b, 1)
    pos[1, -5:] = -1
    return ids.to(dev), torch.arange(b, device=dev), pos.to(dev)


class _Spy:
    """Every fake-quantized operand of a forward, in call order: activations by (layer, site), weights by shape."""

    def __init__(self, rt):
        self.rt, self.seen = rt, []
        act, weight = rt.act, rt.weight
        rt.act = lambda layer, site, x: self._keep((layer, site), act(layer, site, x))
        rt.weight = lambda w: self._keep(tuple(w.shape), weight(w))

    def _keep(self, key, t):
        self.seen.append((key, t.detach().clone()))
        return t

    def close(self):
        del self.rt.act, self.rt.weight


def _records_equal(a, b) -> None:
    assert a.sites.keys() == b.sites.keys() and a.routing.keys() == b.routing.keys()
    for k, r in a.sites.items():
        s = b.sites[k]
        for f in ("keys", "mantissa", "scales", "outer", "codes"):
            x, y = getattr(r, f), getattr(s, f)
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), (k, f)
    for i, (keys, ids) in a.routing.items():
        assert torch.equal(keys, b.routing[i][0]) and torch.equal(ids, b.routing[i][1]), i


def _stats(st) -> dict:
    """Every count of a ReplayStats as ints, and its alignment parts' counts; the parts' hinge sums as floats."""
    if st is None:
        return {}
    tot = st.totals()
    out = {}
    for i, s in tot.layers.items():
        out[i] = {f: getattr(s, f) for f in ("elements", "code_flips", "blocks", "scale_flips", "unrecoverable",
                                             "unrec_checked", "routing_tokens", "routing_flips")}
        out[i]["sites"] = {k: [int(v) for v in acc] for k, acc in s.site_codes.items()}
    out["align_parts"] = {k: [float(v[0]), int(v[1]), int(v[2])] for k, v in st.align_parts.items()}
    out["align_count"] = int(st.align_count)
    return out


def _arm_forward(model, rt, method, records, ids, seq, pos, dev, own: Recorder | None):
    """One trainer forward+backward of `method` under BF16 autocast: (logits, loss, grads, stats, operands)."""
    record, diag = records
    spy = _Spy(rt)
    try:
        with torch.autocast(dev, dtype=torch.bfloat16), method.replay(rt, record, diag, seq, pos) as st:
            with recording(model, own, seq, pos) if own is not None else contextlib.nullcontext():
                logits = model(ids).logits.float()
            loss = logits.pow(2).mean()
            al = method.alignment(st)
            loss = al.add_to(loss) if al is not None else loss
        loss.backward()
    finally:
        spy.close()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logits.detach(), loss.detach(), grads, _stats(st), spy.seen


def _rollout_records(model, rt, method, ids, seq, pos):
    """The arm's records of a float32 forward (the loop path): (guidance record, diagnostic record)."""
    guide, diag = method.recorders(len(model.model.layers))
    if guide is None and diag is None:
        return None, None
    rt.experts = "loop"
    with torch.no_grad(), recording(model, Tee(guide, diag), seq, pos):
        model(ids)
    return (guide.finish() if guide is not None else None), (diag.finish() if diag is not None else None)


def _compare_paths(name: str, arm: str, rho: float, dev: str, **overrides):
    """The arm's trainer forward on the loop and on the grouped path; asserts the module docstring's equalities."""
    model = build_model(name, seed=0, device=dev, **overrides)  # rho 0.5 of 2 layers: one guided, one not
    rt = patch_model(model, ARMS[arm].trainer_mode)
    method = Method(arm, ARMS[arm], rho=rho)
    ids, seq, pos = _batch(dev)
    records = _rollout_records(model, rt, method, ids, seq, pos)
    out = {}
    for path in ("loop", "grouped"):
        rt.experts = path
        own = Recorder(full_codes=True) if rt.acts else None  # the trainer's own RTN codes and scales
        out[path] = (*_arm_forward(model, rt, method, records, ids, seq, pos, dev, own),
                     own.finish() if own is not None else None)
    return out


def _assert_same(out, bitwise_operands: bool = True):
    (l0, s0, g0, st0, ops0, own0), (l1, s1, g1, st1, ops1, own1) = out["loop"], out["grouped"]
    tol = dict(rtol=1.6e-2, atol=1e-5)  # BF16 autocast
    torch.testing.assert_close(l1, l0, **tol)
    torch.testing.assert_close(s1, s0, **tol)
    assert g0.keys() == g1.keys() and len(g0) > 0
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], **tol, msg=lambda m, k=k: f"{k}: {m}")
    if not bitwise_operands:
        return
    assert [k for k, _ in ops0] == [k for k, _ in ops1] and len(ops0) > 0
    for (k, a), (_, b) in zip(ops0, ops1, strict=True):
        assert torch.equal(a, b), f"fake-quantized operand {k} differs"
    assert (own0 is None) == (own1 is None)
    if own0 is not None:
        _records_equal(own0, own1)
    for key in ("align_parts",):
        for part, (h0, n0, f0) in st0.get(key, {}).items():
            h1, n1, f1 = st1[key][part]
            assert (n0, f0) == (n1, f1) and h0 == pytest.approx(h1, rel=1e-6, abs=1e-12), part
    strip = lambda d: {k: v for k, v in d.items() if k != "align_parts"}  # noqa: E731
    assert strip(st0) == strip(st1)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize(("arm", "rho"), ARM_CASES, ids=CASE_IDS)
def test_grouped_experts_equal_the_loop(name, arm, rho):
    out = _compare_paths(name, arm, rho, "cpu", num_hidden_layers=2)
    _assert_same(out)
    if ARMS[arm].record == "guide":  # the case checks something: the replay guided, and the own codes flipped
        st = out["loop"][3]
        assert sum(v["unrec_checked"] for k, v in st.items() if isinstance(k, int)) > 0
        assert sum(v["code_flips"] for k, v in st.items() if isinstance(k, int)) > 0


def test_grouped_experts_equal_the_loop_at_top_k_4_with_recompute():
    """More slots per token (the input gradient sums four rows per token in another order) and the recomputed
    expert MLPs (one checkpoint over the grouped gate/up GEMM), replaying with the alignment term."""
    model_kw = dict(num_experts=16, num_experts_per_tok=4, num_hidden_layers=2)
    out = {}
    for recompute in (False, True):
        model = build_model("olmoe-tiny", seed=0, **model_kw)
        rt = patch_model(model, "w4a4kv4")
        rt.recompute_experts = recompute
        method = Method("trace", ARMS["trace"], rho=0.5)
        ids, seq, pos = _batch()
        records = _rollout_records(model, rt, method, ids, seq, pos)
        rt.experts = "grouped"
        out[recompute] = _arm_forward(model, rt, method, records, ids, seq, pos, "cpu", None) + (None,)
        if not recompute:
            rt.experts = "loop"
            ref = _arm_forward(model, rt, method, records, ids, seq, pos, "cpu", None) + (None,)
    _assert_same({"loop": ref, "grouped": out[False]})
    _assert_same({"loop": out[False], "grouped": out[True]})


def test_the_grouped_gemm_op_computes_the_segment_loop():
    """`torch._grouped_mm` (what the grouped path runs on a GPU) over sorted rows with an expert that got none:
    the segment loop's values, bit for bit, on the CPU's forward."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4, 64, 32, generator=gen).bfloat16()  # [E, M, K]
    sizes = [3, 0, 7, 2]
    x = torch.randn(sum(sizes), 32, generator=gen).bfloat16()
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    ref = grouped_linear(x, w, offs, sizes)
    assert torch.equal(grouped_linear(x, w, offs, None), ref)
    assert torch.equal(ref[3:10], x[3:10] @ w[2].T)


def test_the_setting_names_a_path():
    """QATRuntime.experts and the run config's rl.experts (the trainer's setting; absent or null: auto) name the
    same paths."""
    assert resolve("auto", torch.device("cpu")) == "loop" and resolve("auto", torch.device("cuda")) == "grouped"
    assert resolve("loop", torch.device("cuda")) == "loop" and resolve("grouped", torch.device("cpu")) == "grouped"
    with pytest.raises(ValueError, match="experts path"):
        resolve("fast", torch.device("cpu"))
    assert C.SCHEMA["properties"]["rl"]["properties"]["experts"]["enum"] == list(PATHS)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["qwen3_moe-small", "mixtral-small"])
@pytest.mark.parametrize(("arm", "tol"), [("bf16", 2e-2), ("trace", 1e-1)])
def test_grouped_experts_equal_the_loop_on_gpu(name, arm, tol):
    """On a GPU the grouped path runs `torch._grouped_mm` where the loop runs one cuBLAS GEMM per expert: the same
    products up to BF16 rounding, which FP4 sites can turn into a code flip now and then. So: logits, loss and every
    gradient within `tol` in relative norm (a misplaced row is off by ~1), the first layer's expert input codes (not
    yet through a GEMM that differs) the same, and per layer the code-flip and unrecoverable rates within 1e-2."""
    out = _compare_paths(name, arm, 0.5, "cuda")
    (l0, s0, g0, st0, _, own0), (l1, s1, g1, st1, _, own1) = out["loop"], out["grouped"]
    assert _rel(l1, l0) < tol and _rel(s1, s0) < tol
    assert g0.keys() == g1.keys() and len(g0) > 0
    worst = max(g0, key=lambda k: _rel(g1[k], g0[k]))
    assert _rel(g1[worst], g0[worst]) < tol, worst
    if own0 is None:
        return
    assert torch.equal(own0.sites[(0, "moe_in")].codes, own1.sites[(0, "moe_in")].codes)
    for i in (k for k in st0 if isinstance(k, int)):
        for f, n in (("code_flips", "elements"), ("unrecoverable", "unrec_checked")):
            if st0[i][n]:
                assert abs(st0[i][f] - st1[i][f]) / st0[i][n] < 1e-2, (i, f)
