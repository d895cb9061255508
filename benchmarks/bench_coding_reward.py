"""Time of the coding task's reward for one RL step's responses: in-process for integer arithmetic on x
(`trace.tasks.coding.pure_arithmetic`) against every distinct program in its own sandboxed interpreter.

Run (repo root): `PYTHONPATH=. python benchmarks/bench_coding_reward.py [--prompts 64] [--samples 8]`.
Compared against: itself with the in-process path switched off; the scores must be equal (it exits 1 if not).
"""
import argparse
import os
import random
import sys
import time

import trace.tasks.coding as coding
from trace.tasks import get_task


def timed(fn):
    """-> (result, wall s, CPU s of this process and its children)."""
    c0, t0 = os.times(), time.perf_counter()
    out = fn()
    c1, t1 = os.times(), time.perf_counter()
    cpu = sum(getattr(c1, k) - getattr(c0, k) for k in ("user", "system", "children_user", "children_system"))
    return out, t1 - t0, cpu


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    a = ap.parse_args(argv)
    task = get_task("coding", difficulty="easy")
    rng = random.Random(0)
    batch, responses = [], []
    # a policy's guesses: linear expressions, repeats in a group, and one in six with a misspelt name (a
    # character-level SFT base sampled at temperature 1 wrote 84 such of 512 responses: `2*xk+1`, `-x-Mx+2`)
    for ex in task.make_split("train", a.prompts, 0):
        for _ in range(a.samples):
            batch.append(ex)
            name = "x" if rng.random() < 5 / 6 else rng.choice(["xk", "Mx", "y", "Q3"])
            responses.append(f" {rng.choice([-3, -2, -1, 1, 2, 3])}*{name}+{rng.randint(-3, 3)}\n")
    fast, t_fast, c_fast = timed(lambda: task.score_batch(batch, responses))
    pure = coding.pure_arithmetic
    coding.pure_arithmetic = lambda expr: None
    try:
        boxed, t_box, c_box = timed(lambda: task.score_batch(batch, responses))
    finally:
        coding.pure_arithmetic = pure
    print(f"{len(responses)} responses: in-process {t_fast:.3f} s wall, {c_fast:.2f} CPU-s; sandbox {t_box:.2f} s "
          f"wall, {c_box:.2f} CPU-s ({os.cpu_count()} cores); scores equal: {fast == boxed}")
    sys.exit(0 if fast == boxed else 1)


if __name__ == "__main__":
    main()
