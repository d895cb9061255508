"""Where an OpenRLHF step's time goes, per run: rollout, weight sync and train, by deployment (GPUs, actor ranks,
engines, colocated or not) and arm.

    python -m analysis.openrlhf_phases --runs results/openrlhf/two-gpus --out results/openrlhf/two-gpus

Inputs: every run dir under --runs made by `trace.integrations.openrlhf.launch` (meta.json kind `rl-openrlhf`),
whatever its layout. Per run, medians over its steps after the first (the first compiles kernels and captures
graphs; a run of one step keeps it): `time_rollout_s` (the rollout and the old-log-prob forwards), `time_sync_s`
(the weight broadcast to the engines that fed that rollout; absent from runs made before the policy actor timed
it), `time_train_s`, `time_step_s`, k3, and the generated tokens per second; the deployment from meta.json's
`openrlhf_launch` and the engine count from the run's OpenRLHF argv. Writes `openrlhf_phases.csv` and `.md`.
Compared against: the metrics lines of trace/integrations/openrlhf/actor.py (`TracePolicyActor.fit`).
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np
import pandas as pd
import yaml

from analysis.openrlhf_compare import write_outputs
from trace.rundir import read_metrics

KIND = "rl-openrlhf"
PHASES = (("rollout_s", "time_rollout_s"), ("sync_s", "time_sync_s"), ("train_s", "time_train_s"),
          ("step_s", "time_step_s"), ("k3", "k3"), ("gen_tok_per_s", "rollout_gen_tokens_per_s"))
COLUMNS = ("run", "arm", "gpus", "ranks", "engines", "colocate", "steps", *(c for c, _ in PHASES), "sync_frac",
           "commit", "gpu")


def find_runs(root: str) -> list[str]:
    """Run dirs under root (root itself included) whose meta.json says kind rl-openrlhf, sorted."""
    out = []
    for d, _, files in os.walk(root):
        if "meta.json" in files and "metrics.jsonl" in files:
            with open(os.path.join(d, "meta.json")) as f:
                if json.load(f).get("kind") == KIND:
                    out.append(d)
    return sorted(out)


def _engines(run: str, ranks: int) -> int:
    """--vllm.num_engines of the run's OpenRLHF argv (the launcher's default: one per actor rank)."""
    path = os.path.join(run, "openrlhf_argv.json")
    if not os.path.exists(path):
        return ranks
    with open(path) as f:
        argv = json.load(f)
    hits = [i for i, t in enumerate(argv) if t == "--vllm.num_engines"]
    return int(argv[hits[-1] + 1]) if hits else ranks


def summarize(run: str, root: str) -> dict:
    with open(os.path.join(run, "meta.json")) as f:
        meta = json.load(f)
    with open(os.path.join(run, "config.yaml")) as f:
        cfg = yaml.safe_load(f)
    launch = meta.get("openrlhf_launch", {})
    gpus = int(launch.get("gpus", 0))
    ranks = int(launch.get("ranks") or max(gpus, 1))
    lines = [m for m in read_metrics(os.path.join(run, "metrics.jsonl")) if m.get("step", 0) > 0]
    kept = lines[1:] if len(lines) > 1 else lines
    row = {"run": os.path.relpath(run, root), "arm": cfg["rl"]["method"], "gpus": gpus, "ranks": ranks,
           "engines": _engines(run, ranks), "colocate": bool(launch.get("colocate", gpus > 0)), "steps": len(lines),
           "commit": str(meta.get("git_commit", ""))[:12], "gpu": meta.get("gpu") or "cpu"}
    for col, key in PHASES:
        vals = [float(m[key]) for m in kept if isinstance(m.get(key), (int, float))]
        row[col] = float(np.median(vals)) if vals else float("nan")
    row["sync_frac"] = row["sync_s"] / row["step_s"] if row["step_s"] > 0 else float("nan")
    return row


def table(root: str) -> pd.DataFrame:
    runs = find_runs(root)
    if not runs:
        raise SystemExit(f"{root}: no OpenRLHF run dirs (meta.json kind {KIND})")
    df = pd.DataFrame([summarize(r, root) for r in runs], columns=list(COLUMNS))
    return df.sort_values(["gpus", "ranks", "engines", "colocate", "arm"]).reset_index(drop=True)


def markdown(df: pd.DataFrame) -> str:
    def fmt(v):
        if isinstance(v, float):
            return "" if np.isnan(v) else (f"{v:.2e}" if 0 < abs(v) < 1e-2 else f"{v:.3g}")
        return str(v)

    head = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    body = ["| " + " | ".join(fmt(r[c]) for c in COLUMNS) + " |" for _, r in df.iterrows()]
    return "\n".join([
        "# OpenRLHF step phases", "",
        "Medians over each run's steps after the first (seconds): rollout (with the old-log-prob forwards), the weight "
        "sync that fed it, train; k3 and generated tokens per second likewise. sync_frac = sync_s / step_s.", "",
        *head, *body, ""])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", required=True, help="a tree of OpenRLHF run dirs")
    p.add_argument("--out", required=True, help="directory for openrlhf_phases.csv and .md")
    a = p.parse_args(argv)
    df = table(a.runs)
    write_outputs(df, a.out, "openrlhf_phases", markdown(df))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
