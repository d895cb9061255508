"""The rollout engine's host time per decode step: what `RolloutEngine.generate` spends outside the model's
forward and the sampling kernels (bookkeeping, the copies between host and device), during which a GPU
waits unless the next step is already launched.

Runs the engine on the CPU on a tiny flavor through the all-row decode steps a GPU replays as CUDA graphs
(DecodeGraphs, run eagerly here): the bookkeeping is host code and costs the same with or without a GPU,
up to the host's speed. One warm-up call, then one timed `generate` call with the forward and the sampling
wrapped in timers; host time = the call's wall time less those two, per step and per sample-step:

    PYTHONPATH=. .venv/bin/python benchmarks/engine_host_loop.py --rows 256 --new-tokens 64

`--stop-string "\n"` stops samples at that string as the RL tasks do (the project's tokenizer decodes the tokens;
random weights end ~1% of the samples per step there); `--general` times the general loop (the path of
multi-turn calls, one Python iteration per sample and step) instead of the single-turn path.

Compared against: the decode step's time on the GPU (`benchmarks/bench_rollout.py`, results/rollout/rollout.csv;
kernels/NOTES.md "Engine: the decode step outside the kernels").
"""
from __future__ import annotations

import argparse
import time

import torch

from trace.models import build_model
from trace.models.tokenizer import build_tokenizer
from trace.rollout.engine import RolloutEngine


class _Timed:
    """fn, its wall time summed into `seconds`."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __getattr__(self, name):  # the wrapped object's attributes (EngineForward.fast, ...)
        return getattr(self.fn, name)

    def __call__(self, *a, **k):
        t = time.perf_counter()
        try:
            return self.fn(*a, **k)
        finally:
            self.seconds += time.perf_counter() - t


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3_moe-tiny")
    ap.add_argument("--rows", type=int, default=256, help="sequences decoded together (the rollout batch)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--stop-string", default=None, help='e.g. "\\n", the RL tasks\' stop string')
    ap.add_argument("--general", action="store_true", help="time the general (multi-turn) loop")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    m = build_model(a.model, 0, dtype=torch.float32)
    eng = RolloutEngine(m.config, mode="bf16", dtype=torch.float32)
    eng.sync_weights(m)
    eng.cuda_graphs = True  # the all-row steps of the GPU path (trace/rollout/graphs.py), uncaptured on the CPU
    eng.single_turn_path = not a.general
    prompts = [[5 + i % 50, 7, 9, 11] for i in range(a.rows)]
    kw = dict(stop_strings=(a.stop_string,), tokenizer=build_tokenizer()) if a.stop_string is not None else {}
    fwd = eng.fwd = _Timed(eng.fwd)
    sample = eng.sample = _Timed(RolloutEngine.sample)
    # warm-up at the timed call's shapes: the cache and the decode steps are kept for the next call of the
    # same shape (as the GPU engine keeps its graphs across an RL run's rollouts)
    eng.generate(prompts, max_new_tokens=a.new_tokens, seed=1, **kw)
    fwd.seconds = sample.seconds = 0.0
    t = time.perf_counter()
    out = eng.generate(prompts, max_new_tokens=a.new_tokens, seed=0, **kw)
    wall = time.perf_counter() - t
    steps = max(len(lp) for lp in out.logprobs)  # decode steps (samples may stop early)
    host = wall - fwd.seconds - sample.seconds
    res = dict(rows=a.rows, steps=steps, loop="general" if a.general else "single-turn", stop_string=a.stop_string,
               host_ms_per_step=round(host / steps * 1e3, 3), host_us_per_row_step=round(host / (steps * a.rows) * 1e6, 2),
               wall_ms_per_step=round(wall / steps * 1e3, 2))
    print(res)
    return res


if __name__ == "__main__":
    main()
