"""The decode steps' record written by the quantize launches themselves (trace/rollout/graphs.py:
StepRecording.sink, kernels/quantize.py: RecordSink) against the same steps recorded by torch ops after each
launch (`StepRecording.add`, `in_kernel` off), on the Triton path under TRITON_INTERPRET=1: the flushed record
is the same tensors, and a recorded step runs at most a constant number of torch ops per layer more than the
same step without a recorder."""
import os

import pytest
import torch
from rollout_helpers import tiny

from trace.guidance.record import Recorder, Tee
from trace.rollout.engine import RolloutEngine
from trace.rollout.graphs import StepRecording

PROMPTS = [[1, 40, 41, 42], [1, 50, 51, 52], [1, 60, 61, 62]]


def _engine(monkeypatch, family, crossover):
    from trace.rollout import fast as fast_mod

    if os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available():
        pytest.skip("the Triton path on the CPU runs under TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")
    monkeypatch.setenv("TRACE_ROLLOUT_BACKEND", "triton")
    monkeypatch.setenv("TRACE_FP4_CROSSOVER", crossover)
    if not fast_mod.available("cpu", torch.float32):
        pytest.skip("kernels/ (gemm, moe, attention) do not import right now")
    m = tiny(family)
    eng = RolloutEngine(m.config, mode="w4a4", kv_fp4=True, device="cpu")
    eng.sync_weights(m)
    assert eng.fwd.fast is not None
    eng.cuda_graphs = True  # all-row decode steps through DecodeGraphs (run eagerly on the CPU)
    eng.graph_bucket = 1
    return eng


def _record(eng):
    arm, diag = Recorder(layers=[1], routing=True), Recorder(layers=None, full_codes=True, routing="guided")
    out = eng.generate(PROMPTS[:2], n=2, max_new_tokens=3, temperature=1.0, seed=3, recorder=Tee(arm, diag))
    return out, arm.finish(), diag.finish()


def _same_record(a, b):
    assert sorted(a.sites) == sorted(b.sites) and sorted(a.routing) == sorted(b.routing)
    for key, ra in a.sites.items():
        rb = b.sites[key]
        for f in ("keys", "mantissa", "scales", "outer", "codes"):
            x, y = getattr(ra, f), getattr(rb, f)
            assert (x is None and y is None) or (x.dtype == y.dtype and torch.equal(x, y)), (key, f)
    for layer, (k, ids) in a.routing.items():
        assert torch.equal(k, b.routing[layer][0]) and torch.equal(ids, b.routing[layer][1])
    assert a.aliases == b.aliases


# crossover "inf,inf": every projection and the experts on the W4A4 kernels (fp4_linear, fused_moe); "0,inf": the
# projections above the crossover (the quantize kernel's dequantized copy into BF16 GEMMs, `_act_fast`), as at
# the Qwen3-30B-A3B batch of 256 rows
@pytest.mark.slow
@pytest.mark.parametrize("family,crossover", [("qwen3_moe", "inf,inf"), ("mixtral", "inf,inf"), ("qwen3_moe", "0,inf")])
def test_kernel_written_record_equals_the_torch_ops_record(family, crossover, monkeypatch):
    recs = {}
    for in_kernel in (True, False):
        monkeypatch.setattr(StepRecording, "in_kernel", in_kernel)
        eng = _engine(monkeypatch, family, crossover)
        recs[in_kernel] = _record(eng)
        rec = eng._kept[2].recording
        assert rec is not None and bool(rec.sinks) == in_kernel  # the sinks really wrote the record
    (on, an, dn), (og, ag, dg) = recs[True], recs[False]
    assert on.tokens == og.tokens and on.logprobs == og.logprobs
    _same_record(an, ag)
    _same_record(dn, dg)
    assert {s for _, s in dn.sites} >= {"attn_in", "o_in", "k", "v", "moe_in", "moe_down_in"}


class _OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops a block runs, outside Triton launches (the interpreter's own copies of a launch's
    arguments are not ops of the step), and the Triton launches."""

    def __init__(self):
        super().__init__()
        self.ops, self.launches, self._inside = 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._inside:
            self.ops += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        from triton.runtime import interpreter

        self._run, counter = interpreter.GridExecutor.__call__, self

        def run(executor, *a, **k):
            counter.launches += 1
            counter._inside += 1
            try:
                return counter._run(executor, *a, **k)
            finally:
                counter._inside -= 1

        interpreter.GridExecutor.__call__ = run
        return super().__enter__()

    def __exit__(self, *exc):
        from triton.runtime import interpreter

        interpreter.GridExecutor.__call__ = self._run
        return super().__exit__(*exc)


def _step_ops(graphs, recording):
    """(aten ops, Triton launches) of one all-row decode step of `graphs`, with `recording` (or none)."""
    kept, graphs.recording = graphs.recording, recording
    try:
        graphs._run(graphs.cache.cap)  # warm: the first call at a length allocates what later calls reuse
        with _OpCounter() as c:
            graphs._run(graphs.cache.cap)
    finally:
        graphs.recording = kept
    return c.ops, c.launches


# the recording's extra torch ops per layer in a decode step: the expert ids' unsqueeze + index_copy_ (MoE layers);
# every quantized site (attention input, o-proj input, K/V, the experts' two inputs) is written by its quantize launch
EXTRA_OPS_PER_LAYER = 2


@pytest.mark.slow
@pytest.mark.parametrize("in_kernel", [True, False])
def test_recording_adds_at_most_a_constant_number_of_ops_per_layer(in_kernel, monkeypatch):
    """Every layer and site recorded, with full codes and the expert ids: the recorded step runs the same Triton
    launches as the unrecorded one, and at most EXTRA_OPS_PER_LAYER torch ops more per layer. The torch-ops record
    (`in_kernel` off, the path before the sinks) runs ~5 ops per site and must fail the bound."""
    monkeypatch.setattr(StepRecording, "in_kernel", in_kernel)
    eng = _engine(monkeypatch, "qwen3_moe", "inf,inf")
    eng.generate(PROMPTS[:2], max_new_tokens=1, recorder=Recorder(layers=None, full_codes=True, routing=True))
    graphs = eng._kept[2]
    rec = graphs.recording
    assert rec is not None and rec.full_codes and rec.sites == frozenset(range(eng.fwd.a.num_layers))
    bare_ops, bare_launches = _step_ops(graphs, None)
    ops, launches = _step_ops(graphs, rec)
    layers = eng.fwd.a.num_layers
    print(f"in_kernel={in_kernel}: {layers} layers, step ops {bare_ops} -> {ops} (+{ops - bare_ops}), "
          f"Triton launches {bare_launches} -> {launches}")
    within = ops - bare_ops <= EXTRA_OPS_PER_LAYER * layers and launches == bare_launches
    assert within == in_kernel
