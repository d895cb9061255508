"""One RL step per arm, timed in one process on an otherwise idle device: the like-for-like step time and
TRACE's overhead over qat-independent that the main table's s/step (runs sharing a GPU, different stretches)
cannot give, and the FP4 library's RTN on the quantize kernel against the reference ops (TRACE_FP4_KERNELS).

    PYTHONPATH=. python benchmarks/bench_trainer_step.py --device cuda --model mixtral-small --task long_horizon \
        [--init-ckpt DIR] [--steps 6] [--prompts 64] [--kernels auto off] [--procs N] [--recompute-experts]

Each (arm, kernels) builds a trainer from the profile's run config (seed 0; random weights unless --init-ckpt,
so generations run to their length limit), runs --steps RL steps and keeps the medians of the steps after
the first (warm-up: CUDA graphs, Triton compiles). Rows are APPENDED to --out
(default results/trainer/trainer_step.csv): the step's rollout and train (forward, backward, optimizer,
weight sync) seconds and their sum (step_s), the train time over qat-independent's and over bf16's with the
same kernels setting, the trainer's GPU memory peak, and the rollout/trainer mismatch k3 of the first step and
its median over all steps (the kernel path is bit for bit the reference's, so its k3 must be the reference
ops' k3). Compared against: the bf16 arm (no FP4 in the trainer) and qat-independent (the FP4 trainer without
guidance).

--procs N runs each (arm, kernels) in N processes at once on the device, as N runs of a profile chunk share a
GPU (gpu_slots_per_device): the row's times are the medians over the N processes, and steps_per_s = N / step_s
is the device's throughput in RL steps. One process against N tells whether the device is saturated by N runs
(N times the throughput: not saturated; the same: saturated). The processes start together but build their
trainers in their own time, so use enough --steps that the timed steps overlap.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.results_table import append, git_commit, read, today  # noqa: E402
from benchmarks.trainer_memory import step_config  # noqa: E402
from trace.rl.trainer import RLTrainer  # noqa: E402

FIELDS = ("version", "commit", "gpu", "date", "model", "task", "arm", "fp4_kernels", "prompts", "steps",
          "step_s", "rollout_s", "train_s", "train_vs_qat_independent", "train_vs_bf16", "peak_gb", "k3_first", "k3",
          "procs", "steps_per_s", "recompute_experts", "note")
FP4_ARMS = ("fp4-naive", "qat-independent", "trace")  # the engine quantizes its weights (and these trainers but fp4-naive's)


def time_arm(cfg: dict, steps: int) -> dict:
    """Medians over steps 2..steps of one trainer's step, rollout and train seconds, its GPU peak, and the
    rollout/trainer mismatch k3 of its first step (before any update: the same weights on both sides) and its
    median over all steps."""
    with tempfile.TemporaryDirectory() as out:
        tr = RLTrainer(cfg, out, progress=False)
        ms = [tr.step(i) for i in range(1, steps + 1)]
        recompute = tr.model._trace_rt.recompute_experts  # what the trainer ran, not what was asked
    k3 = [m["k3"] for m in ms]
    ms = ms[1:]
    med = lambda k: statistics.median(m[k] for m in ms)  # noqa: E731
    peak = max((m["gpu_peak_alloc_gb"] or 0.0) for m in ms) if ms[0]["gpu_peak_alloc_gb"] is not None else None
    return {"step_s": med("time_rollout_s") + med("time_train_s"), "rollout_s": med("time_rollout_s"),
            "train_s": med("time_train_s"), "peak_gb": peak,
            "k3_first": k3[0], "k3": statistics.median(k3), "recompute_experts": recompute}


def time_arm_in_procs(argv: list[str], arm: str, kernels: str, procs: int) -> dict:
    """time_arm's fields for one (arm, kernels) run in `procs` processes of this script at once (each --procs 1):
    medians over the processes of their step, rollout and train seconds, the largest peak, the first process's
    k3 (the same in all: same config, same seed)."""
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"p{i}.csv") for i in range(procs)]
        jobs = [subprocess.Popen([sys.executable, __file__, *argv, "--arms", arm, "--kernels", kernels, "--procs", "1",
                                  "--out", o], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                for o in outs]
        errs = [j.communicate()[1] for j in jobs]
        for j, e in zip(jobs, errs, strict=True):
            if j.returncode != 0:
                raise RuntimeError(f"a process of {arm} ({kernels}) failed:\n{e[-3000:]}")
        rows = [read(o)[0] for o in outs]
    med = lambda k: statistics.median(float(r[k]) for r in rows)  # noqa: E731
    peaks = [float(r["peak_gb"]) for r in rows if r["peak_gb"] not in ("", "None")]
    return {"step_s": med("step_s"), "rollout_s": med("rollout_s"), "train_s": med("train_s"),
            "peak_gb": max(peaks) if peaks else None, "k3_first": float(rows[0]["k3_first"]),
            "k3": float(rows[0]["k3"]), "recompute_experts": all(r["recompute_experts"] == "True" for r in rows)}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="experiments/profiles/small.yaml")
    ap.add_argument("--model", default="mixtral-small")
    ap.add_argument("--task", default="long_horizon")
    ap.add_argument("--arms", nargs="+", default=["bf16", "fp4-naive", "qat-independent", "trace"])
    ap.add_argument("--kernels", nargs="+", default=["auto", "off"], choices=["auto", "on", "off"],
                    help="TRACE_FP4_KERNELS settings to run the FP4 arms with (bf16 runs once, auto)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=None, help="prompts per step (default: the profile's)")
    ap.add_argument("--init-ckpt", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--version", default="dev")
    ap.add_argument("--out", default="results/trainer/trainer_step.csv")
    ap.add_argument("--procs", type=int, default=1, help="processes at once per (arm, kernels), as runs share a GPU")
    ap.add_argument("--recompute-experts", action="store_true",
                    help="rl.recompute_experts on: less trainer memory, one more expert forward per step")
    a = ap.parse_args(argv)
    if a.procs < 1:
        ap.error("--procs must be at least 1")
    if a.steps < 2:
        ap.error("--steps must be at least 2 (the first is warm-up)")
    # what each process of --procs gets: every given argument but the arms, kernels, processes and output
    child = [w for k, v in vars(a).items() if v is not None and v is not False
             and k not in ("arms", "kernels", "procs", "out")
             for w in ((f"--{k.replace('_', '-')}",) if v is True else (f"--{k.replace('_', '-')}", str(v)))]
    rows, before = [], os.environ.get("TRACE_FP4_KERNELS")
    gpu = torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "cpu"
    try:
        for arm in a.arms:
            for k in (a.kernels if arm in FP4_ARMS else ["auto"]):
                rc = {"init_ckpt": a.init_ckpt, "recompute_experts": a.recompute_experts}
                cfg, full = step_config(a.profile, a.model, a.task, arm, a.prompts or 1, **rc)
                if not a.prompts:
                    cfg, _ = step_config(a.profile, a.model, a.task, arm, full, **rc)
                cfg["device"] = a.device
                os.environ["TRACE_FP4_KERNELS"] = k
                t0 = time.perf_counter()
                r = time_arm(cfg, a.steps) if a.procs == 1 else time_arm_in_procs(child, arm, k, a.procs)
                rows.append({"version": a.version, "commit": git_commit(), "gpu": gpu, "date": today(),
                             "model": a.model, "task": a.task, "arm": arm, "fp4_kernels": k,
                             "prompts": cfg["rl"]["prompts_per_step"], "steps": a.steps, **r, "procs": a.procs,
                             "steps_per_s": round(a.procs / r["step_s"], 4),
                             "note": f"{time.perf_counter() - t0:.0f} s with setup"})
                print({k2: (round(v, 3) if isinstance(v, float) else v) for k2, v in rows[-1].items()}, flush=True)
    finally:
        if before is None:
            os.environ.pop("TRACE_FP4_KERNELS", None)
        else:
            os.environ["TRACE_FP4_KERNELS"] = before
    for r in rows:
        for base, col in (("qat-independent", "train_vs_qat_independent"), ("bf16", "train_vs_bf16")):
            ref = [b for b in rows if b["arm"] == base and b["fp4_kernels"] in (r["fp4_kernels"], "auto")]
            ref = [b for b in ref if b["fp4_kernels"] == r["fp4_kernels"]] or ref
            r[col] = round(r["train_s"] / ref[0]["train_s"], 3) if ref else None
    append(a.out, rows, FIELDS)
    print(f"appended {len(rows)} rows to {a.out}")
    return rows


if __name__ == "__main__":
    main()
