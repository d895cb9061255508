"""Read logged runs (the trainer's run dirs) into per-run summaries; shared by analysis.tables and figures.

A run dir (``results/runs/<profile>/<model>/<task>/<arm>/seed<k>/``) holds ``config.yaml``,
``metrics.jsonl`` (one JSON object per RL step), ``eval.json`` ({"bf16": {"accuracy", ...}, "fp4": {...}})
and a ``done`` marker (layout: trace/rundir.py, which also holds the metrics reader; arms:
trace/arms.py); a metrics line's fields are `trace.metrics.StepMetrics`'s (documented there, written by both
trainers; `RunData.series` and `layer_profile` take only those names), DESIGN.md section 4 defines the metrics. Runs are found through the
pipeline's ``manifest.json`` (which also says which runs *must* exist) or, without one, by walking
the runs dir for ``metrics.jsonl``.

    from analysis.runs import load_runs
    runs = load_runs("results/runs/smoke")            # list[RunData]

Summary conventions (documented once, used by every table and figure):
* *final* value of a per-step metric = mean over the last third of logged steps (``FINAL_FRAC``; 20 of
  the smoke profile's 60 steps: a window of 6 steps lets single tokens with a large |dlp| decide the
  number), with ``<name>_final_se`` = sd of the window / sqrt(window) beside it;
* *mean* = mean over all logged steps;
* per-layer rates (``code_flip_rate`` etc., dicts {layer: rate}) -> mean over steps per layer, and the
  scalar = mean over layers of that;
* rollout speed = generated tokens / generation time (recording excluded), median over steps, leaving
  out the first step (warm-up) when there are >= 3; record overhead = time spent recording the arm's
  own guidance record / generation time, median over the same steps (0 for arms without a record;
  diagnostic records are never timed in either); seconds per RL step ``step_s`` = the trainer's
  ``time_step_s`` (rollout, recording, training and the periodic evaluation of the steps that have one),
  median over the same steps (``time_step_s`` in runs.csv stays the mean over all steps);
* accuracy = ``eval.json``'s fraction of correct samples on unique held-out prompts, with its
  prompt-clustered standard error ``acc_<deploy>_se`` (``se_clustered``).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import yaml

from trace.arms import ARMS, MAIN_METHODS, POSTHOC, Arm
from trace.metrics import FIELDS, LAYER_FIELDS
from trace.rundir import read_metrics
from trace.settings import migrate
from trace.stats import clustered_se as se_clustered  # the evaluation's own SE (one implementation)

__all__ = ["LAYER_METRICS", "MAIN_METHODS", "POSTHOC", "RunData", "load_run", "load_runs", "summarize"]
FINAL_FRAC = 1 / 3
LAYER_METRICS = LAYER_FIELDS  # the per-layer rates ({layer: rate}) of a metrics line


def _field(name: str) -> str:
    """`name`, a field of the metrics record (trace.metrics.StepMetrics); KeyError for any other name."""
    if name not in FIELDS:
        raise KeyError(f"{name!r} is not a StepMetrics field (trace/metrics.py)")
    return name


@dataclass
class RunData:
    model: str
    task: str
    arm: str
    seed: int
    method: str
    ablation: bool
    dir: str
    config: dict = field(default_factory=dict)
    metrics: list[dict] = field(default_factory=list)
    eval: dict | None = None
    done: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.model}/{self.task}/{self.arm}/seed{self.seed}"

    def series(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of a scalar per-step metric (a StepMetrics field); steps without it are skipped."""
        xs, ys = [], []
        for m in self.metrics:
            v = m.get(_field(name))
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                xs.append(m.get("step", len(xs)))
                ys.append(float(v))
        return np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)

    def layer_profile(self, name: str) -> dict[str, float]:
        """Mean over steps of a per-layer metric (a StepMetrics field): {layer: rate}, layers sorted numerically."""
        acc: dict[str, list[float]] = {}
        for m in self.metrics:
            d = m.get(_field(name))
            if isinstance(d, dict):
                for layer, v in d.items():
                    if isinstance(v, (int, float)):
                        acc.setdefault(str(layer), []).append(float(v))
        return {k: float(np.mean(v)) for k, v in sorted(acc.items(), key=lambda kv: _layer_sort_key(kv[0]))}


def _layer_sort_key(layer: str):
    digits = "".join(c for c in layer if c.isdigit())
    return (int(digits) if digits else 1 << 30, layer)


def _load_yaml(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return yaml.safe_load(f) or {}


def load_run(run_dir: str, model: str, task: str, arm: str, seed: int, method: str | None = None,
             ablation: bool | None = None) -> RunData:
    cfg = _load_yaml(os.path.join(run_dir, "config.yaml"))
    cfg = migrate(cfg) if cfg else cfg  # a config written before some keys had their defaults (trace/settings.py)
    method = method or (cfg.get("rl", {}) or {}).get("method") or arm
    if ablation is None:
        ablation = arm not in MAIN_METHODS
    r = RunData(model, task, arm, int(seed), method, bool(ablation), run_dir, cfg)
    mpath = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(mpath):
        r.metrics = read_metrics(mpath, last_per_step=True)
    else:
        r.problems.append("no metrics.jsonl")
    epath = os.path.join(run_dir, "eval.json")
    if os.path.exists(epath):
        with open(epath) as f:
            r.eval = json.load(f)
    else:
        r.problems.append("no eval.json")
    r.done = os.path.exists(os.path.join(run_dir, "done"))
    if not r.done:
        r.problems.append("not done")
    return r


def load_runs(runs_dir: str, manifest: str | None = None) -> list[RunData]:
    """All runs of a profile. With a manifest, exactly its runs (missing ones carry `problems`);
    without, every ``<model>/<task>/<arm>/seed<k>/metrics.jsonl`` below `runs_dir`."""
    if manifest is None and os.path.exists(os.path.join(runs_dir, "manifest.json")):
        manifest = os.path.join(runs_dir, "manifest.json")
    runs: list[RunData] = []
    if manifest:
        with open(manifest) as f:
            man = json.load(f)
        for e in man["runs"]:
            d = os.path.join(runs_dir, e["model"], e["task"], e["arm"], f"seed{e['seed']}")
            runs.append(load_run(d, e["model"], e["task"], e["arm"], e["seed"], e.get("method"), e.get("ablation")))
        return runs
    for root, _dirs, files in os.walk(runs_dir):
        if "metrics.jsonl" not in files:
            continue
        rel = os.path.relpath(root, runs_dir).split(os.sep)
        if len(rel) != 4 or not rel[3].startswith("seed") or not rel[3][4:].isdigit():
            continue
        model, task, arm, seed = rel
        runs.append(load_run(root, model, task, arm, int(seed[4:])))
    runs.sort(key=lambda r: (r.model, r.task, r.ablation, r.arm, r.seed))
    return runs


def _tail(y: np.ndarray, frac: float = FINAL_FRAC) -> np.ndarray:
    return y[-max(1, int(math.ceil(frac * y.size))):] if y.size else y


def _tail_mean(y: np.ndarray, frac: float = FINAL_FRAC) -> float:
    t = _tail(y, frac)
    return float(np.mean(t)) if t.size else math.nan


def _tail_se(y: np.ndarray, frac: float = FINAL_FRAC) -> float:
    t = _tail(y, frac)
    return float(np.std(t, ddof=1) / math.sqrt(t.size)) if t.size > 1 else math.nan


def eval_block_se(blk: dict) -> float:
    """An eval.json block's clustered SE: its own ``se``, else from its ``per_prompt`` accuracies."""
    if isinstance(blk.get("se"), (int, float)):
        return float(blk["se"])
    if isinstance(blk.get("per_prompt"), list):
        return se_clustered(blk["per_prompt"])
    return math.nan


def _mean(y: np.ndarray) -> float:
    return float(np.mean(y)) if y.size else math.nan


def _arm(method: str) -> Arm:
    """The arm table's entry; an unknown method is treated as an arm without guidance."""
    return ARMS.get(method, Arm("bf16", False, "bf16", None))


def _run_commit(run_dir: str) -> str:
    """The commit a run was made at (meta.json's git_commit, 7 characters; a `-dirty` suffix kept), or ''."""
    path = os.path.join(run_dir, "meta.json")
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        c = str(json.load(f).get("git_commit") or "")
    dirty = c.endswith("-dirty")
    c = c.removesuffix("-dirty")[:7]
    return c + ("-dirty" if dirty and c else "")


def summarize(r: RunData) -> dict:
    """One row of scalars per run (see the module docstring for the conventions)."""
    rl = (r.config.get("rl") or {}) if isinstance(r.config, dict) else {}
    row: dict[str, Any] = {
        "model": r.model, "task": r.task, "arm": r.arm, "seed": r.seed, "method": r.method,
        "ablation": r.ablation, "steps": len(r.metrics),
    }
    ev = r.eval or {}
    for dep in ("bf16", "fp4"):
        blk = ev.get(dep) or {}
        row[f"acc_{dep}"] = float(blk["accuracy"]) if isinstance(blk.get("accuracy"), (int, float)) else math.nan
        row[f"acc_{dep}_se"] = eval_block_se(blk)
        row[f"reward_{dep}"] = float(blk["reward"]) if isinstance(blk.get("reward"), (int, float)) else math.nan
        row[f"n_prompts_{dep}"] = blk.get("n_prompts", math.nan)
    _, reward = r.series("reward_mean")
    _, acc = r.series("accuracy")
    _, rlen = r.series("response_len")
    row["response_len"] = _mean(rlen)  # generated tokens per rollout response, mean over steps
    row["commit"] = _run_commit(r.dir)
    row["reward_final"] = _tail_mean(reward)
    row["train_acc_final"] = _tail_mean(acc)
    for name in ("k3", "k1", "dlp_abs_mean", "ratio_out_frac", "chi2", "k3_grad"):  # k3_grad: the exact arm
        _, y = r.series(name)
        row[f"{name}_mean"] = _mean(y)
        row[f"{name}_final"] = _tail_mean(y)
        row[f"{name}_final_se"] = _tail_se(y)
    _, dmax = r.series("dlp_abs_max")
    row["dlp_abs_max"] = float(np.max(dmax)) if dmax.size else math.nan
    for name in LAYER_METRICS:
        prof = r.layer_profile(name)
        row[name] = float(np.mean(list(prof.values()))) if prof else math.nan
    _, gb = r.series("guidance_bytes_per_gen_token")
    row["guidance_bytes_per_gen_token"] = _mean(gb)
    _, bits = r.series("guidance_bits_per_element")
    row["guidance_bits_per_element"] = _mean(bits)  # NaN for arms that guide nothing
    # the alignment term's gradient norm over the rest of the loss's (before clipping), logged by the trainer
    # at every step whose loss has the term; NaN elsewhere
    sa, ga = r.series("grad_norm_align")
    sr, gr = r.series("grad_norm_rest")
    ok = np.isin(sa, sr)
    ratio = ga[ok] / np.maximum(gr[np.isin(sr, sa)], 1e-30)
    row["align_grad_ratio"] = float(np.median(ratio)) if ratio.size else math.nan
    # the block-scale part's share of the alignment term's sum (the rest is the element part), logged every
    # step the term is computed; NaN elsewhere and in runs whose lines lack it
    _, share = r.series("align_scales_share")
    row["align_scale_share"] = float(np.median(share)) if share.size else math.nan
    for name, col in (("rollout_gen_tokens_per_s", "rollout_gen_tokens_per_s"), ("record_overhead", "record_overhead"),
                      ("time_step_s", "step_s")):
        _, y = r.series(name)
        if y.size >= 3:
            y = y[1:]
        row[col] = float(np.median(y)) if y.size else math.nan
    for name in ("time_rollout_s", "time_train_s", "time_step_s"):
        _, y = r.series(name)
        row[name] = _mean(y)
    # ablation factors: the arm table, and the run's own (resolved) config
    arm = _arm(r.method)
    rho = rl.get("rho")
    # rho: fraction of (deepest) layers guided; 0 for arms without guidance, NaN = trainer default not logged
    if arm.record != "guide":
        rho = 0.0
    row["rho"] = float(rho) if isinstance(rho, (int, float)) and not isinstance(rho, bool) else math.nan
    row["guidance"] = arm.guidance
    # the alignment loss's weight: 0 for arms without it, NaN where the run's config does not say
    align_coef = rl.get("align_coef")
    if not arm.align:
        align_coef = 0.0
    row["align_coef"] = (float(align_coef) if isinstance(align_coef, (int, float)) and not isinstance(align_coef, bool)
                         else math.nan)
    # what the alignment term acts on: the elements' codes, and NVFP4's block scales unless rl.align_scales is off
    parts = "n/a" if not rl else "codes+scales" if rl["align_scales"] and rl["fmt"] == "nvfp4" else "codes"
    row["align_parts"] = "none" if not arm.align else parts
    row["routing_replay"] = bool(arm.routing)
    return row
