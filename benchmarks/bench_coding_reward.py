"""Time of the coding task's reward for one RL step's responses: in-process for integer arithmetic on x
(`trace.tasks.coding.pure_arithmetic`) against every distinct program in its own sandboxed interpreter;
and the sandbox's time per program with each set of kernel layers (`trace.tasks.sandbox`): all of them
(bubblewrap's namespaces and unprivileged uid, plus seccomp), the set without bubblewrap (a network
namespace as root, plus seccomp), and none (rlimits and the audit hook only).

Run (repo root): `PYTHONPATH=. python benchmarks/bench_coding_reward.py [--prompts 64] [--samples 8]
[--programs 96] [--repeats 5] [--append results/bench/coding_reward.md] [--baseline FILE]`.
Compared against: itself with the in-process path switched off; the scores must be equal (it exits 1 if not).
Per-program times are medians over `--repeats` batches of `--programs` distinct programs per layer set (taken
in turn), run as the coding verifier runs them (one process per program, as many at once as there are cores).
`--append` adds the printed lines, with the command and each layer set's configuration, to a markdown file;
`--baseline` times another version of trace/tasks/sandbox.py (with its own default layers) in the same rounds.
"""
import argparse
import datetime
import importlib.util
import os
import random
import statistics
import sys
import time

import trace.tasks.coding as coding
from trace.tasks import get_task, sandbox

# name -> run_many's `_kernel_layers`
LAYER_SETS = {"all kernel layers": True, "without bubblewrap": ("netns", "seccomp"),
              "no kernel layers": False}


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
    ap.add_argument("--programs", type=int, default=96, help="distinct programs per timed batch")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--append", default=None, help="markdown file to append the results to")
    ap.add_argument("--baseline", default=None, help="another trace/tasks/sandbox.py to time alongside")
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
    lines = [f"{len(responses)} responses: in-process {t_fast:.3f} s wall, {c_fast:.2f} CPU-s; sandbox {t_box:.2f} s "
             f"wall, {c_box:.2f} CPU-s ({os.cpu_count()} cores); scores equal: {fast == boxed}"]
    # distinct programs, as the verifier sends them: the harness around a policy-like expression
    progs = [coding.harness(f"{rng.choice([-3, -2, -1, 1, 2, 3])}*x+{i}", [1, 2, 3, 4, 5])
             for i in range(a.programs)]
    # name -> (run the batch, the layers it gets)
    runs = {name: (lambda layers=layers: sandbox.run_many(progs, _kernel_layers=layers),
                   sandbox.describe_layers(layers)) for name, layers in LAYER_SETS.items()}
    if a.baseline:
        # another version of the sandbox module (`git show REV:trace/tasks/sandbox.py > FILE`), its defaults
        spec = importlib.util.spec_from_file_location("sandbox_baseline", a.baseline)
        base = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = base
        spec.loader.exec_module(base)
        caps = [k for k, v in base.capabilities().items() if v is True and k != "root"]
        runs[f"baseline {a.baseline}"] = (lambda: base.run_many(progs),
                                          "its defaults, here: " + " ".join(caps))
    times = {name: [] for name in runs}
    for _ in range(a.repeats):  # round robin, so that every layer set sees the same load from other jobs
        for name, (run, _) in runs.items():
            res, wall, cpu = timed(run)
            assert all(r.ok for r in res), [r.stderr for r in res if not r.ok][:1]
            times[name].append((1e3 * wall / a.programs, 1e3 * cpu / a.programs))
    for name, (_, layers) in runs.items():
        wall = sorted(w for w, _ in times[name])
        cpu = statistics.median(c for _, c in times[name])
        lines.append(f"sandbox, {name} [{layers}]: {statistics.median(wall):.1f} ms wall "
                     f"(best {wall[0]:.1f}), {cpu:.1f} CPU-ms per program "
                     f"(medians of {a.repeats} batches of {a.programs} programs)")
    for line in lines:
        print(line)
    if a.append:
        with open(a.append, "a", encoding="utf-8") as f:
            args = " ".join(argv if argv is not None else sys.argv[1:])
            cmd = f"PYTHONPATH=. python benchmarks/bench_coding_reward.py {args}".strip()
            f.write(f"\n### {datetime.date.today().isoformat()}, {os.cpu_count()} cores\n\n`{cmd}`\n\n")
            f.writelines(f"- {line}\n" for line in lines)
    sys.exit(0 if fast == boxed else 1)


if __name__ == "__main__":
    main()
