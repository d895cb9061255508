"""`trace.guidance.Method`: the one object both trainers hold for an arm's method.

What it must do: make the recorders, the replay call and the weighted alignment term the trainers made
themselves before (argument for argument), and be the only place the trainers reach the method's
settings, so that a new knob of the method touches the config schema, method.py and the guidance code
it switches (at most 3 files), never a trainer.
"""
from __future__ import annotations

import ast
import contextlib
from pathlib import Path

import pytest
import torch

from trace import config as C
from trace.arms import ARMS
from trace.guidance import Alignment, Method, ReplayStats, arm_recorders
from trace.guidance import method as method_mod

ROOT = Path(__file__).resolve().parents[2]
TRAINERS = ("trace/rl/trainer.py", "trace/rl/trainstep.py", "trace/integrations/openrlhf/actor.py",
            "trace/integrations/openrlhf/rollout.py")


def _method(arm: str, *over: str) -> Method:
    return Method.from_config(C.load_config(None, [f"rl.method={arm}", *over])["rl"])


@pytest.mark.parametrize("arm", sorted(ARMS))
def test_recorders_are_the_arm_tables(arm):
    m = _method(arm, "rl.rho=0.25", "rl.diag_flips=true")
    got, want = m.recorders(8), arm_recorders(ARMS[arm], 8, 0.25, True)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if g is not None:
            assert (g.layers, g.full_codes, g.routing) == (w.layers, w.full_codes, w.routing)
    assert m.records() == tuple(r is not None for r in want)


@pytest.mark.parametrize("arm", sorted(ARMS))
@pytest.mark.parametrize("align_scales", [True, False])
def test_replay_is_the_call_the_trainers_made(monkeypatch, arm, align_scales):
    calls = []
    monkeypatch.setattr(method_mod, "_replay", lambda *a, **kw: calls.append((a, kw)) or contextlib.nullcontext("s"))
    m = _method(arm, f"rl.align_scales={str(align_scales).lower()}")
    a = ARMS[arm]
    rt, rec, diag, seq, pos = object(), object(), object(), torch.zeros(2), torch.zeros(2, 3)
    with m.replay(rt, rec, diag, seq, pos) as stats:
        assert stats == "s"
    (args, kw), = calls
    assert args == (rt, rec, seq, pos)
    assert kw == dict(routing=a.routing, align=a.align, full_codes=a.full_codes, diag=diag, align_scales=align_scales)
    with m.replay(rt, None, None, seq, pos) as stats:  # no record: no replay
        assert stats is None
    assert len(calls) == 1


class _Stats(ReplayStats):
    def __init__(self, term):
        super().__init__()
        self.term = term

    def alignment_loss(self):
        return self.term

    def alignment_parts(self):
        return {"align_codes_hinge": 0.5}


@pytest.mark.parametrize("arm", sorted(ARMS))
def test_alignment_term_weighted_only_where_the_arm_aligns(arm):
    m = _method(arm, "rl.align_coef=0.25")
    term = torch.tensor(2.0, requires_grad=True)
    al = m.alignment(_Stats(term))
    assert m.alignment(None) is None
    if not (ARMS[arm].record == "guide" and ARMS[arm].align):
        assert al is None
        return
    assert isinstance(al, Alignment) and al.term is term and al.parts == {"align_codes_hinge": 0.5}
    loss = torch.tensor(1.0)
    assert float(al.add_to(loss)) == 1.0 + 0.25 * 2.0
    al.add_to(loss).backward()
    assert float(term.grad) == 0.25


def test_alignment_without_weight_or_gradient_leaves_the_loss():
    loss = torch.tensor(1.0)
    for m, term in ((_method("trace", "rl.align_coef=0"), torch.tensor(2.0, requires_grad=True)),
                    (_method("trace"), torch.tensor(0.0))):  # no flips: a constant term
        al = m.alignment(_Stats(term))
        assert al.weighted is None and al.add_to(loss) is loss and float(al.term) == float(term)


@pytest.mark.parametrize("arm", sorted(ARMS))
def test_engine_arguments_are_the_arm_tables(arm):
    a = ARMS[arm]
    assert _method(arm).engine_kwargs() == {"mode": a.engine_mode, "kv_fp4": a.kv_fp4, "batch_invariant": a.exact}
    assert _method(arm).logprobs_from_engine is a.exact


def test_device_problem_only_for_the_exact_arm_on_a_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "TRITON_INTERPRET=1" in _method("exact").device_problem("cpu")
    assert _method("exact").device_problem("cuda") is None and _method("trace").device_problem("cpu") is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _method("exact").device_problem("cpu") is None


@pytest.mark.parametrize("arm", ["bf16", "trace"])
def test_logprobs_are_the_forward_inside_the_replay(monkeypatch, arm):
    calls = []
    monkeypatch.setattr(method_mod, "_replay", lambda *a, **kw: calls.append(a) or contextlib.nullcontext("s"))
    lp = torch.randn(2, 3, requires_grad=True)
    seq, pos, valid = torch.arange(2), torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool)
    out = _method(arm).logprobs(lambda: lp, "rt", "rec", None, seq, pos, valid, score=lambda: 1 / 0)
    assert out.lp is lp and out.stats == "s" and out.grad_lp is None and out.engine_s is None and len(calls) == 1
    out = _method(arm).logprobs(lambda: lp, "rt", None, None, seq, pos, valid)  # no record: a plain forward
    assert out.lp is lp and out.stats is None and len(calls) == 1


def test_exact_logprobs_take_the_engines_values_and_the_pinned_forwards_gradient():
    v = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.25, -3.0]])
    g = torch.tensor([[-1.1, -2.2, 5.0], [-0.4, -0.2, -2.0]], requires_grad=True)
    valid = torch.tensor([[True, True, False], [True, True, True]])
    pinned = []

    class Pin:
        def __enter__(self):
            pinned.append("in")

        def __exit__(self, *exc):
            pinned.append("out")

    def forward():
        assert pinned == ["in"]  # the forward runs with the layer inputs pinned
        return g * 1.0

    out = _method("exact").logprobs(forward, "rt", None, None, None, None, valid, score=lambda: (v, Pin()))
    assert torch.equal(out.lp.detach(), v) and pinned == ["in", "out"] and out.stats is None
    assert torch.equal(out.grad_lp, g.detach()) and out.engine_s >= 0
    out.lp.sum().backward()
    assert torch.equal(g.grad, valid.float())  # g's gradient at the real tokens, none at padding
    mm = _method("exact").mismatch(out.lp.detach(), out.grad_lp, v, valid)
    assert mm["k3"] == 0.0 and mm["k3_grad"] > 0
    assert "k3_grad" not in _method("trace").mismatch(v, None, v, valid)


class _Items(ReplayStats):
    """ReplayStats of a chunk: a hinge sum over `count` guided items."""

    def __init__(self, hinge_sum, count):
        super().__init__(align_sum=hinge_sum, align_count=count)


def test_step_alignment_is_the_mean_over_all_the_steps_items():
    m = _method("trace", "rl.align_coef=0.5")
    h1, h2 = torch.tensor(3.0, requires_grad=True), torch.tensor(5.0, requires_grad=True)
    whole = m.step_alignment(10)  # one chunk of all 10 rows: its own weighted term, unscaled
    s = _Items(h1, 40)
    assert float(whole.part(s, 10)) == float(m.alignment(s).weighted) == pytest.approx(0.5 * 3.0 / 40)
    whole.check()
    step = m.step_alignment(10)  # chunks of 6 + 4 rows, 4 guided items per row
    total = step.part(_Items(h1, 24), 6) + step.part(_Items(h2, 16), 4)
    step.check()
    assert float(total) == pytest.approx(0.5 * (3.0 + 5.0) / 40)
    bad = m.step_alignment(10)
    bad.part(_Items(h1, 24), 6)
    bad.part(_Items(h2, 12), 4)  # fewer items than the first chunk's rows predict
    with pytest.raises(RuntimeError, match="alignment items"):
        bad.check()
    with pytest.raises(RuntimeError, match="not whole"):
        m.step_alignment(10).part(_Items(h1, 25), 6)
    assert _method("trace-noalign").step_alignment(10).part(_Items(h1, 24), 6) is None


def test_record_accounting_follows_the_arm():
    class Rec:
        def bytes_per_generated_token(self, n, compact_only):
            return (n, compact_only)

        def bits_per_element(self, compact_only):
            return compact_only

    assert _method("trace").record_bytes_per_generated_token(Rec(), 7) == (7, True)
    assert _method("trace-fullcodes").record_bytes_per_generated_token(Rec(), 7) == (7, False)
    assert _method("trace").record_bits_per_element(Rec()) is True
    assert _method("trace").record_bytes_per_generated_token(None, 7) == 0.0
    assert _method("trace").record_bits_per_element(None) is None


# ------------------------------------------------------------------ the trainers use only the method's API
METHOD_KEYS = ("rho", "diag_flips", "align_coef", "align_scales")  # the rl settings a Method reads
ARM_METHOD_FIELDS = ("record", "routing", "align", "full_codes")  # the arm's method fields (not its modes)
GUIDANCE_CALLS = ("arm_recorders", "arm_records", "alignment_loss", "alignment_parts")


def test_from_config_reads_every_setting():
    fields = {f for f in Method.__dataclass_fields__} - {"name", "arm"}
    assert fields == set(METHOD_KEYS), "a new Method field: add its rl key to METHOD_KEYS"


def _trace_modules():
    return sorted(p for p in (ROOT / "trace").rglob("*.py"))


def test_method_settings_are_read_only_by_the_method():
    """A knob of the method is an rl key read in trace/guidance/method.py (and declared in trace/config.py),
    nowhere else: subscripts like rl["align_coef"] anywhere else would be a second wiring."""
    readers = {}
    for p in _trace_modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
                    and node.slice.value in METHOD_KEYS:
                readers.setdefault(str(p.relative_to(ROOT)), set()).add(node.slice.value)
    assert set(readers) == {"trace/guidance/method.py"}, readers


@pytest.mark.parametrize("path", TRAINERS)
def test_trainers_call_only_the_method_object(path):
    """No replay call but the method's, no arm method field, no alignment-term or recorder wiring of their own."""
    tree = ast.parse((ROOT / path).read_text())
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            owner = f.value if isinstance(f, ast.Attribute) else None
            on_method = isinstance(owner, ast.Attribute) and owner.attr == "method" or \
                isinstance(owner, ast.Name) and owner.id == "method"
            if name == "replay" and not on_method or name in GUIDANCE_CALLS:
                bad.append(f"line {node.lineno}: {name}(...)")
        elif isinstance(node, ast.Attribute) and node.attr in ARM_METHOD_FIELDS and \
                isinstance(node.value, ast.Attribute | ast.Name) and \
                (node.value.attr if isinstance(node.value, ast.Attribute) else node.value.id) == "arm":
            bad.append(f"line {node.lineno}: arm.{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in METHOD_KEYS:
            bad.append(f"line {node.lineno}: {node.value!r}")
    assert bad == []


def test_the_exact_arm_is_read_only_through_the_method():
    """`.exact` and `batch_invariant` appear in trace/ only in guidance/ (the method), the arm table and the rollout
    engine (its constructor's argument and what it switches): the trainers, the config and the integrations ask the
    Method (engine_kwargs, logprobs, device_problem, logprobs_from_engine) or the Arm (setting_error)."""
    import re
    pat = re.compile(r"\.exact\b|batch_invariant")
    bad = [f"{p.relative_to(ROOT)}:{i}" for p in _trace_modules()
           if not str(p.relative_to(ROOT)).startswith(("trace/guidance/", "trace/rollout/", "trace/arms.py"))
           for i, line in enumerate(p.read_text().splitlines(), 1) if pat.search(line)]
    assert bad == []
