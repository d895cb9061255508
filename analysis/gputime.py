"""GPU time of a profile's logged jobs (SFT, RL, evaluations) per model/task and in total, as CSV and Markdown.

    python -m analysis.gputime --runs results/runs/small --out results/tables/small

Writes ``gputime.csv`` / ``gputime.md`` into --out. Only jobs whose meta lists a GPU (``gpu``) count: a profile
run on the CPU gets a table with no job in it.

Jobs and their intervals, from what the run dirs below --runs hold (layout: trace/rundir.py):
* SFT (``<model>/<task>/sft/``) and RL runs (``<model>/<task>/<arm>/seed<k>/``): from meta.json's
  ``start_time`` (taken when the trainer opens its run dir) to its ``end_time`` (written with the ``done``
  marker). An attempt that was resumed (``resumes``) ends at its ``attempt_ends`` entry, or where it has
  none (killed), at the latest where the next began.
* evaluations (``eval.json`` of an RL run or of the SFT base): from the ``start_time`` to the ``end_time``
  of the eval.json's meta.
* Runs made before those end times were written (legacy runs) have only their starts. An RL run's interval
  then reaches to the end of its final evaluation: that eval.json's meta was written after the evaluation,
  so its ``start_time`` is when the evaluation ended; the run, the wait for a free slot and the evaluation
  are one interval. Without that evaluation: start + the sum of the run's logged ``time_step_s`` (a lower
  bound). An SFT run ends, at the latest, where the first job that needs its checkpoint started (the same
  model/task's RL runs and its own evaluation, from the same commit and host, i.e. the same pipeline
  invocation); without one, at start + steps x the mean logged step time (an estimate: SFT logs one step in
  ``log_every``). An evaluation of the SFT base with only its end is counted as no time (its start is unknown).

GPUs: a job runs on one machine (hostname, and meta's ``boot_id`` where recorded) with ``host_gpus`` GPUs, on
the device ``gpu_device`` (both recorded where workflow/scripts/launch.py pinned the job to a GPU slot). The
machine's GPU-seconds are, at each moment, the number of its devices that run a job, integrated over time;
a device's time is shared equally by the jobs on it. Where the device is not recorded (legacy runs), the
machine's jobs are taken to be spread over its GPUs (launch.py takes slots slot-major: the first jobs go to
distinct GPUs), so min(GPUs, GPUs the running jobs use) devices are busy, shared by the jobs in proportion to
the GPUs each uses; and where ``host_gpus`` is not recorded, the machine has cpu_count / ``CORES_PER_GPU`` GPUs.
A group's GPU-seconds are its jobs' shares, so the groups add up to the total; its wall time is the length of
the union of its jobs' intervals, and groups that ran at the same time overlap in it.

Compared against: the wall times of the profile chunks (scripts/gpu/remote_call.sh prints each call's seconds;
those also hold what is not a committed job: installs, GPU tests, SFT rebuilds, failed attempts).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
from dataclasses import dataclass, field

import pandas as pd

from trace.rundir import read_metrics

# The H200 machines the small profile ran on had 16 CPU cores per GPU (one GPU: 16, two: 32, ...); runs
# made before host_gpus was recorded are sized by it.
CORES_PER_GPU = 16


@dataclass
class Job:
    model: str
    task: str
    role: str  # "sft", "rl" (RL run; legacy: with its final evaluation), "eval" (of an RL run), "sft-eval"
    machine: tuple
    host_gpus: int
    devices: tuple[str, ...] | None  # the machine's GPU ids the job ran on; None where not recorded
    width: int  # GPUs the job used
    intervals: list[tuple[float, float]] = field(default_factory=list)
    steps: int = 0  # RL steps (role "rl")
    evaluations: int = 0  # evaluations the job is or holds (a legacy RL run holds its final one)
    legacy_end: bool = False  # its end is inferred (no end_time recorded)
    legacy_host: bool = False  # its machine's GPU count is inferred (no host_gpus recorded)
    commit: str | None = None
    path: str = ""

    @property
    def group(self) -> tuple[str, str]:
        return (self.model, self.task)


def _ts(s: str | None) -> float | None:
    return dt.datetime.fromisoformat(s).timestamp() if s else None


def _load_json(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _placement(meta: dict) -> dict:
    """Job fields that say where it ran, from a meta block (see the module docstring)."""
    width = len(meta.get("gpu") or [])
    dev = meta.get("gpu_device")
    devices = tuple(d.strip() for d in str(dev).split(",") if d.strip()) if dev not in (None, "") else None
    host = meta.get("host_gpus")
    legacy_host = not isinstance(host, int) or host < 1
    if legacy_host:
        host = max(1, int(meta.get("cpu_count") or 0) // CORES_PER_GPU, width)
    # cpu_count tells two legacy machines of one hostname apart where boot_id is missing
    machine = (meta.get("hostname"), meta.get("boot_id") or meta.get("cpu_count"))
    return {"machine": machine, "host_gpus": host, "devices": devices, "width": max(width, len(devices or ())),
            "legacy_host": legacy_host, "commit": meta.get("git_commit")}


def _attempts(meta: dict, end: float) -> list[tuple[float, float]]:
    """A run's attempts: each resumed one ends at its recorded end (``attempt_ends``), else (killed, or made
    before ends were recorded) at the latest where the next started; the last at `end`."""
    starts = [_ts(meta["start_time"])] + [_ts(s) for s in meta.get("resumes") or []]
    ends = list(meta.get("attempt_ends") or [])
    ivs = []
    for k, (a, b) in enumerate(zip(starts, starts[1:], strict=False)):
        e = _ts(ends[k]) if k < len(ends) and ends[k] else None
        ivs.append((a, min(b, e) if e is not None else b))
    return ivs + [(starts[-1], max(end, starts[-1]))]


def _step_sum(run_dir: str) -> tuple[int, float, float]:
    """(steps logged, sum of their time_step_s, mean time_step_s) of a run's metrics.jsonl."""
    path = os.path.join(run_dir, "metrics.jsonl")
    recs = read_metrics(path, last_per_step=True) if os.path.exists(path) else []
    ts = [r["time_step_s"] for r in recs if isinstance(r.get("time_step_s"), (int, float))]
    return len(ts), float(sum(ts)), (float(sum(ts)) / len(ts) if ts else 0.0)


def _eval_job(path: str, model: str, task: str, role: str) -> tuple[Job | None, float | None]:
    """An eval.json's job where it records start and end; else (None, the legacy end time)."""
    ev = _load_json(path)
    meta = (ev or {}).get("meta") or {}
    if not meta.get("gpu") or not meta.get("start_time"):
        return None, None
    if not meta.get("end_time"):
        return None, _ts(meta["start_time"])
    job = Job(model, task, role, **_placement(meta), intervals=[(_ts(meta["start_time"]), _ts(meta["end_time"]))],
              evaluations=1, path=path)
    return job, None


def load_jobs(runs_dir: str) -> list[Job]:
    """Every GPU job under a profile's runs dir (see the module docstring for how its interval is found)."""
    found: list[tuple[str, list[str], dict]] = []
    for root, _dirs, files in os.walk(runs_dir):
        if "meta.json" not in files:
            continue
        rel = os.path.relpath(root, runs_dir).split(os.sep)
        if not (len(rel) == 3 and rel[2] == "sft") and not (len(rel) == 4 and rel[3].startswith("seed")):
            continue
        meta = _load_json(os.path.join(root, "meta.json")) or {}
        if meta.get("gpu") and meta.get("start_time"):
            found.append((root, rel, meta))
    found.sort()
    jobs: list[Job] = []
    legacy_sft = []
    for root, rel, meta in found:
        model, task = rel[0], rel[1]
        role = "sft" if rel[2] == "sft" else "rl"
        ev, ev_end = _eval_job(os.path.join(root, "eval.json"), model, task, "sft-eval" if role == "sft" else "eval")
        if ev is not None:
            jobs.append(ev)
        steps, step_sum, step_mean = _step_sum(root)
        job = Job(model, task, role, **_placement(meta), steps=steps if role == "rl" else 0,
                  legacy_end=not meta.get("end_time"), path=root)
        start = _ts(meta["start_time"])
        if meta.get("end_time"):
            job.intervals = _attempts(meta, _ts(meta["end_time"]))
        elif role == "rl":
            # a resumed attempt's steps are not told apart: the lower bound runs from the first start
            low = max(_ts((meta.get("resumes") or [meta["start_time"]])[-1]), start + step_sum)
            job.intervals = _attempts(meta, max(low, ev_end) if ev_end is not None else low)
            job.evaluations = int(ev_end is not None)
        else:
            done = _load_json(os.path.join(root, "done")) or {}
            est = start + int(done.get("steps") or steps) * step_mean
            legacy_sft.append((job, meta, est, ev_end))
            continue
        jobs.append(job)
    for job, meta, est, ev_end in legacy_sft:
        start = _ts(meta["start_time"])
        after = [iv[0] for j in jobs if j.role == "rl" and j.group == job.group and j.machine == job.machine
                 and j.commit == job.commit for iv in j.intervals[:1] if iv[0] > start]
        if ev_end is not None and ev_end > start:
            after.append(ev_end)
        job.intervals = _attempts(meta, min(after) if after else est)
        jobs.append(job)
        if ev_end is not None:  # its start is unknown: a job of no length at its end
            jobs.append(Job(job.model, job.task, "sft-eval", job.machine, job.host_gpus, None, job.width,
                            [(ev_end, ev_end)], evaluations=1, legacy_end=True, legacy_host=job.legacy_host,
                            commit=job.commit, path=os.path.join(job.path, "eval.json")))
    return jobs


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals."""
    total, cur_a, cur_b = 0.0, None, None
    for a, b in sorted(intervals):
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


def gpu_shares(jobs: list[Job]) -> list[float]:
    """GPU-seconds of each job (same order): per machine, at each moment the busy devices, shared by the
    jobs running (module docstring); their sum is the machines' GPU-seconds."""
    shares = [0.0] * len(jobs)
    by_machine: dict[tuple, list[int]] = {}
    for i, j in enumerate(jobs):
        by_machine.setdefault(j.machine, []).append(i)
    for idx in by_machine.values():
        gpus = max(jobs[i].host_gpus for i in idx)
        pieces = [(a, b, i) for i in idx for a, b in jobs[i].intervals if b > a]
        cuts = sorted({t for a, b, _ in pieces for t in (a, b)})
        for t0, t1 in zip(cuts, cuts[1:], strict=False):
            running = {i for a, b, i in pieces if a <= t0 and b >= t1}
            if not running:
                continue
            span = t1 - t0
            known = [i for i in running if jobs[i].devices is not None]
            unknown = [i for i in running if jobs[i].devices is None]
            on_device: dict[str, list[int]] = {}
            for i in known:
                for d in jobs[i].devices:
                    on_device.setdefault(d, []).append(i)
            for members in on_device.values():
                for i in members:
                    shares[i] += span / len(members)
            width = sum(max(1, jobs[i].width) for i in unknown)
            spare = min(gpus - len(on_device), width)
            for i in unknown:
                shares[i] += span * spare * max(1, jobs[i].width) / width if spare > 0 else 0.0
    return shares


def gputime_table(jobs: list[Job]) -> pd.DataFrame:
    """One row per model/task and an ``all`` row (see COLUMNS and `notes`)."""
    shares = gpu_shares(jobs)
    groups = sorted({j.group for j in jobs})
    rows = []
    for key in groups + [None]:
        sel = [i for i, j in enumerate(jobs) if key is None or j.group == key]
        js = [jobs[i] for i in sel]
        rl = [i for i in sel if jobs[i].role in ("rl", "eval")]
        steps = sum(jobs[i].steps for i in rl)
        gpu_s = sum(shares[i] for i in sel)
        rows.append({
            "model": key[0] if key else "all", "task": key[1] if key else "all",
            "gpus_per_machine": "/".join(str(g) for g in sorted({j.host_gpus for j in js})) or "n/a",
            "sft_jobs": sum(j.role == "sft" for j in js), "rl_runs": sum(j.role == "rl" for j in js),
            "evaluations": sum(j.evaluations for j in js), "rl_steps": steps,
            "sft_s": sum(b - a for j in js if j.role == "sft" for a, b in j.intervals),
            "wall_s": union_length([iv for j in js for iv in j.intervals]),
            "gpu_s": gpu_s, "gpu_h": gpu_s / 3600,
            "rl_gpu_s": sum(shares[i] for i in rl),
            "gpu_s_per_rl_step": sum(shares[i] for i in rl) / steps if steps else math.nan,
        })
    return pd.DataFrame(rows)


COLUMNS = [
    ("gpus_per_machine", "GPUs per machine"),
    ("jobs", "SFT / RL / eval jobs"),
    ("rl_steps", "RL steps"),
    ("sft_s", "SFT s"),
    ("wall_s", "Wall s"),
    ("gpu_s", "GPU-s"),
    ("gpu_h", "GPU-h"),
    ("gpu_s_per_rl_step", "GPU-s / RL step"),
]


def notes(jobs: list[Job], profile: str) -> str:
    """The table's notes: what each column is, and which of the profile's jobs needed which inference."""
    runs = [j for j in jobs if j.role in ("sft", "rl")]
    legacy = sum(j.legacy_end for j in runs)
    timed = [j for j in jobs if any(b > a for a, b in j.intervals)]
    unplaced = sum(j.devices is None for j in timed)
    unsized = sum(j.legacy_host for j in timed)
    text = ("GPU time: the jobs of the profile whose meta.json lists a GPU (SFT runs, RL runs, evaluations) under "
            f"results/runs/{profile}/; not in it: what the GPU machines ran besides them (installs, GPU tests, "
            "benchmarks, SFT checkpoints rebuilt on another machine, failed or out-of-memory attempts whose run was redone). A job's "
            "interval: from meta.json's start_time to its end_time (evaluations: eval.json's meta).")
    if not jobs:
        text = text.replace("GPU time: ", f"GPU time: none (no job of the {profile} profile lists a GPU). Counted: ", 1)
    if legacy:
        text += (f" {legacy} of the {len(runs)} runs were made before end times were recorded and have only their "
                 "start: an RL run is counted from its start to the end of its final evaluation (eval.json's meta "
                 "time, taken when the evaluation had finished; the wait for a free slot between the two included), "
                 "else to start + the sum of its logged step times; an SFT run to the start of the first job that "
                 "needs its checkpoint (its RL runs and its evaluation, same commit), and an evaluation of the SFT "
                 "base, whose start is unknown, as no time.")
    text += (" SFT s: the SFT runs' intervals. Wall s: length of the union of the row's job intervals; rows that "
             "ran at the same time (two families in one chunk) overlap in it, so the rows add up to more than the "
             "all row's union. GPU-s: per machine, at each moment the number of its GPUs that run a job, over time, "
             "each moment's GPUs shared by the jobs running then; the rows add up to the all row.")
    if unplaced:
        text += (f" For {unplaced} of the {len(timed)} timed jobs the GPU they ran on is not recorded (meta.json's "
                 "gpu_device): they are taken to be spread over their machine's GPUs (workflow/scripts/launch.py "
                 "takes slots slot-major), i.e. min(GPUs, running jobs) GPUs busy.")
    if unsized:
        text += (f" The machine's GPU count (host_gpus), unrecorded for {unsized} of them, is taken as cpu_count / "
                 f"{CORES_PER_GPU} (the H200 machines had {CORES_PER_GPU} cores per GPU).")
    text += (" GPU-h: GPU-s / 3600. GPU-s / RL step: the GPU-s of the row's RL runs and their final evaluations "
             "over the RL steps they ran, at the sharing they ran with (gpu_slots_per_device runs per GPU, or the "
             "profile chunk's SLOTS); the main table's s/step is one run's wall time per step.")
    return text


def _fmt(v, col: str) -> str:
    if isinstance(v, str):
        return v
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    if col == "gpu_h":
        return f"{v:.2f}"
    if col == "gpu_s_per_rl_step":
        return f"{v:.2f}"
    return f"{v:,.0f}"


def to_markdown(t: pd.DataFrame, jobs: list[Job], profile: str) -> str:
    heads = ["model", "task"] + [h for _, h in COLUMNS]
    lines = [f"### GPU time ({profile} profile)", "", "| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for _, r in t.iterrows():
        counts = f"{r.sft_jobs} / {r.rl_runs} / {r.evaluations}"
        cells = [r.model, r.task] + [counts if c == "jobs" else _fmt(r[c], c) for c, _ in COLUMNS]
        if r.model == "all":
            cells = [f"**{c}**" for c in cells]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", notes(jobs, profile), ""]
    return "\n".join(lines)


def build(runs_dir: str, out: str) -> pd.DataFrame:
    jobs = load_jobs(runs_dir)
    t = gputime_table(jobs)
    os.makedirs(out, exist_ok=True)
    t.to_csv(os.path.join(out, "gputime.csv"), index=False, float_format="%.6g")
    profile = os.path.basename(os.path.normpath(runs_dir))
    with open(os.path.join(out, "gputime.md"), "w") as f:
        f.write(to_markdown(t, jobs, profile))
    print(f"wrote {out}/gputime.{{csv,md}} ({len(t) - 1} model/task rows)")
    return t


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", required=True, help="profile runs dir, e.g. results/runs/small")
    ap.add_argument("--out", required=True, help="output dir, e.g. results/tables/small")
    a = ap.parse_args(argv)
    build(a.runs, a.out)


if __name__ == "__main__":
    main()
