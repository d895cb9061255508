"""Recording inside the one-token decode steps (trace/rollout/graphs.py: StepRecording): the rows a
recording engine stores from its all-row steps are the rows its eager per-chunk steps store. On the CPU the
steps are not captured (DecodeGraphs runs them eagerly), which tests the buffers, the step index and the
flush; tests/rollout/test_gpu.py runs the captured version."""
import pytest
import torch
from rollout_helpers import tiny

from trace.guidance.record import Recorder, Tee
from trace.rollout.engine import RolloutEngine

PROMPTS = [[1, 40, 41, 42], [1, 50, 51, 52], [1, 60, 61, 62]]  # one length: every row is fed at every step


def _engines(family):
    m = tiny(family)
    out = []
    for steps in (False, True):
        eng = RolloutEngine(m.config, mode="w4a4", kv_fp4=True, device="cpu")
        eng.sync_weights(m)
        if steps:
            eng.cuda_graphs = True  # all-row decode steps through DecodeGraphs (not captured on the CPU)
            eng.graph_bucket = 1  # attend over exactly the eager step's slots: the same shapes, the same numbers
        out.append(eng)
    return out


def _same_record(a, b):
    assert sorted(a.sites) == sorted(b.sites) and sorted(a.routing) == sorted(b.routing)
    for key, ra in a.sites.items():
        rb = b.sites[key]
        for f in ("keys", "mantissa", "scales", "outer", "codes"):
            x, y = getattr(ra, f), getattr(rb, f)
            assert (x is None and y is None) or torch.equal(x, y), (key, f)
    for layer, (k, ids) in a.routing.items():
        assert torch.equal(k, b.routing[layer][0]) and torch.equal(ids, b.routing[layer][1])
    assert a.aliases == b.aliases


@pytest.mark.parametrize("family,window", [("qwen3_moe", 64), ("mixtral", 64), ("qwen3_moe", 2)])
def test_recorded_steps_store_what_eager_steps_store(family, window, monkeypatch):
    """window: decode steps kept on the device before they are handed over (2: five windows here)."""
    import trace.rollout.engine as E

    monkeypatch.setattr(E, "RECORD_WINDOW", window)
    eager, steps = _engines(family)
    recs = {}
    for name, eng in (("eager", eager), ("steps", steps)):
        arm, diag = Recorder(layers=[1], routing=True), Recorder(layers=None, full_codes=True, routing="guided")
        out = eng.generate(PROMPTS, n=2, max_new_tokens=6, temperature=1.0, seed=3, recorder=Tee(arm, diag))
        recs[name] = (out, arm.finish(), diag.finish())
    (oe, ae, de), (og, ag, dg) = recs["eager"], recs["steps"]
    assert og.tokens == oe.tokens and og.logprobs == oe.logprobs
    _same_record(ag, ae)
    _same_record(dg, de)
    assert steps._kept is not None and steps._kept[2].recording is not None  # the steps really recorded
    assert steps._kept[2].recording.max_steps == min(window, 4 + 6)  # capacity: prompt 4 + 6 new tokens
    n_rows = sum(len(t) for t in og.tokens)  # every (seq, pos), shared prompts as aliases
    assert ag.sites[(1, "attn_in")].keys.numel() == n_rows - (len(og.tokens) - len(PROMPTS)) * len(PROMPTS[0])


def test_recorded_steps_with_rows_that_stop_early():
    """Rows finish at different steps (a stop token): idle rows' buffer rows must not reach the record, and
    every fed (seq, pos) must, at the step it was fed."""
    eager, steps = _engines("qwen3_moe")
    keys = {}
    for name, eng in (("eager", eager), ("steps", steps)):
        rec = Recorder(layers=None, routing=True)
        out = eng.generate(PROMPTS, n=3, max_new_tokens=12, temperature=1.5, seed=5, recorder=rec,
                           stop_token_ids=tuple(range(40, 70)))
        keys[name] = (out, rec.finish())
    (oe, re_), (og, rg) = keys["eager"], keys["steps"]
    assert len({len(t) for t in og.tokens}) > 1  # the rows really stopped at different steps
    for key, rows in rg.sites.items():
        assert key in re_.sites
        if og.tokens == oe.tokens:
            assert torch.equal(rows.keys, re_.sites[key].keys)
        want = {(b << 24) | p for b, t in enumerate(og.tokens) for p in range(len(t))
                if not (b % 3 and p < len(PROMPTS[0]))}  # prompt rows of samples 2, 3 are aliases
        assert set(rows.keys.tolist()) == want, key


def test_recording_steps_keep_their_graphs_per_spec():
    _, steps = _engines("qwen3_moe")
    steps.generate(PROMPTS, n=2, max_new_tokens=4, recorder=Recorder(layers=[1]))
    first = steps._kept[2]
    steps.generate(PROMPTS, n=2, max_new_tokens=4, recorder=Recorder(layers=[1]))
    assert steps._kept[2] is first  # same spec, same shapes: the same graphs
    steps.generate(PROMPTS, n=2, max_new_tokens=4, recorder=Recorder(layers=[0, 1]))
    assert steps._kept[2] is not first and steps._kept[2].recording.sites == frozenset({0, 1})
    steps.generate(PROMPTS, n=2, max_new_tokens=4)
    assert steps._kept[2].recording is None
