"""The rollout engine's host time per decode step: the Python bookkeeping of `RolloutEngine.generate` between a
step's sync and the next launch, during which the GPU waits.

Runs the engine on the CPU (the bookkeeping is Python: it costs the same with or without a GPU, up to the host's
speed) on a tiny flavor, one warm-up call, then `cProfile` over one `generate` call, and prints `generate`'s own
time (its loop over rows and steps, without the model's forward, the sampling or other callees) per step and per
row-step, beside the call's wall time per step:

    PYTHONPATH=. .venv/bin/python benchmarks/engine_host_loop.py --rows 256 --new-tokens 64

Compared against: the decode step's time on the GPU (`benchmarks/bench_rollout.py`, results/rollout/rollout.csv;
kernels/NOTES.md "Engine: the decode step outside the kernels").
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from trace.models import build_model
from trace.rollout.engine import RolloutEngine


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3_moe-tiny")
    ap.add_argument("--rows", type=int, default=256, help="sequences decoded together (the rollout batch)")
    ap.add_argument("--new-tokens", type=int, default=64)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    m = build_model(a.model, 0, dtype=torch.float32)
    eng = RolloutEngine(m.config, mode="bf16", dtype=torch.float32)
    eng.sync_weights(m)
    prompts = [[5 + i % 50, 7, 9, 11] for i in range(a.rows)]
    eng.generate(prompts, max_new_tokens=4, seed=0)  # warm-up
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    out = eng.generate(prompts, max_new_tokens=a.new_tokens, seed=0)
    prof.disable()
    wall = time.perf_counter() - t
    steps = max(1, out.num_generated_tokens // a.rows)
    own = next(v[2] for k, v in pstats.Stats(prof).stats.items() if k[2] == "generate" and k[0].endswith("engine.py"))
    res = dict(rows=a.rows, steps=steps, host_ms_per_step=round(own / steps * 1e3, 3),
               host_us_per_row_step=round(own / (steps * a.rows) * 1e6, 2), wall_ms_per_step=round(wall / steps * 1e3, 2))
    print(res)
    return res


if __name__ == "__main__":
    main()
