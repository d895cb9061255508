"""Synthetic logged runs for the analysis/figures tests: run dirs shaped exactly like the trainer's
(config.yaml, meta.json, metrics.jsonl, eval.json, done). TEST FIXTURES ONLY: the numbers are made up
(loosely shaped like DESIGN.md section 3's expectations) and must never be written under results/.

    from tests.analysis.synthetic import write_profile
    write_profile(tmp_path / "runs" / "smoke", models=["qwen3_moe-tiny"], seeds=[0, 1])
"""
from __future__ import annotations

import json
import math
import os
import random

import yaml

from trace import config as C

METHODS = ["bf16", "fp4-naive", "qat-independent", "qat-weight-only", "trace"]
ABLATIONS = {
    "trace-rho0.5": ("trace", {"rho": 0.5}),
    "trace-rho1": ("trace", {"rho": 1.0}),
    "trace-fullcodes": ("trace-fullcodes", {}),
    "trace-noalign": ("trace-noalign", {}),
    "trace-noroutingreplay": ("trace-noroutingreplay", {}),
    "trace-align0.01": ("trace", {"align_coef": 0.01}),
    "trace-alignelements": ("trace", {"align_scales": False}),
}
# (k3 level, guidance bytes/token, fp4 accuracy drop, rollout speedup)
LEVEL = {
    "bf16": (2e-5, 0, 0.10, 1.0),
    "fp4-naive": (3e-3, 0, 0.05, 1.8),
    "qat-independent": (1.5e-3, 0, 0.03, 1.8),
    "qat-weight-only": (1.0e-3, 0, 0.04, 1.8),
    "trace": (2e-4, 300, 0.01, 1.7),
    "trace-fullcodes": (1.5e-4, 900, 0.01, 1.6),
    "trace-noalign": (3e-4, 300, 0.02, 1.7),
    "trace-noroutingreplay": (6e-4, 280, 0.02, 1.7),
    "exact": (0.0, 0, 0.01, 1.5),
}

# median seconds per RL step; each seed's runs are slower by the same factor (1 + 0.5 * seed), as if that
# seed's runs had shared a busier device, so only a same-seed comparison gives trace's +60% back
STEP_S = {"bf16": 0.5, "fp4-naive": 0.9, "qat-independent": 1.0, "qat-weight-only": 0.9, "trace": 1.6,
          "trace-fullcodes": 1.8, "trace-noalign": 1.5, "trace-noroutingreplay": 1.55, "exact": 1.4}


def step_times(method: str, seed: int, steps: int) -> list[float]:
    """A warm-up first step 5x the rest, then the arm's step time +-10% (its median exactly, for odd
    counts of the remaining steps)."""
    t = STEP_S[method] * (1 + 0.5 * seed)
    return [5 * t] + [t * (1 + 0.1 * ((-1) ** i) * (i % 3 != 0)) for i in range(1, steps)]


def write_run(run_dir: str, model: str, task: str, arm: str, method: str, seed: int, steps: int = 8,
              n_layers: int = 4, rl_extra: dict | None = None) -> None:
    os.makedirs(os.path.join(run_dir, "ckpt"), exist_ok=True)
    rng = random.Random(hash((model, task, arm, seed)) & 0xFFFF)
    rho = (rl_extra or {}).get("rho", 0.34)
    cfg = {"model": model, "task": {"name": task, "difficulty": "easy", "n_train": 64, "n_test": 16, "seed": 0},
           "rl": {"method": method, "rho": rho, "align_coef": 0.1, "steps": steps, **(rl_extra or {})}, "seed": seed, "device": "cpu"}
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(C.deep_merge(C.DEFAULTS, cfg), f)  # a run directory's config is resolved
    with open(os.path.join(run_dir, "meta.json"), "w") as f:
        json.dump({"commit": "synthetic", "versions": {}, "hardware": "test"}, f)
    k3, gb, drop, speed = LEVEL[method]
    if method.startswith("trace"):
        k3 = k3 * (1.5 - rho)
        gb = gb * rho / 0.34
    times = step_times(method, seed, steps)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for s in range(steps):
            acc = min(1.0, 0.2 + 0.05 * s + 0.02 * rng.random())
            flips = {str(i): (0.02 + 0.03 * i) * (0.2 if method.startswith("trace") and i >= n_layers * (1 - rho) else 1)
                     for i in range(n_layers)}
            rec = {
                "step": s, "reward_mean": acc, "accuracy": acc, "response_len": 12.0 + s,
                "k1": k3 * 0.5, "k3": k3 * (1 + 0.1 * math.sin(s)), "dlp_abs_mean": math.sqrt(k3),
                "dlp_abs_max": 10 * math.sqrt(k3), "ratio_out_frac": k3, "chi2": 2 * k3,
                "code_flip_rate": flips, "scale_flip_rate": {k: v / 10 for k, v in flips.items()},
                "unrecoverable_rate": {k: v / 100 for k, v in flips.items()},
                "routing_flip_rate": {k: v / 5 for k, v in flips.items()},
                "guidance_bytes_per_gen_token": float(gb),
                "guidance_bits_per_element": 1.6 if method.startswith("trace") else None,
                "rollout_gen_tokens_per_s": 100.0 * speed * (1 + 0.01 * rng.random()),
                "record_overhead": 0.2 if method.startswith("trace") else 0.0,
                "time_rollout_s": 1.0, "time_train_s": 0.5, "time_step_s": times[s], "loss": 0.1, "grad_norm": 1.0,
            }
            if method == "exact":  # the differentiated QAT forward's k3 against the rollout (its k3 is 0)
                rec["k3_grad"] = 1e-4 * (1 + s)
            coef = (rl_extra or {}).get("align_coef", 0.1)
            if method in ("trace", "trace-fullcodes", "trace-noroutingreplay") and coef > 0:
                # the alignment term's parts, logged every step it is computed
                rec["align_scales_share"] = (0.0 if (rl_extra or {}).get("align_scales") is False
                                             else 0.1 if method == "trace-fullcodes" else 0.5)
            if s % 4 == 3:
                rec["eval_accuracy"] = acc
                # the trainer's gradient split where the alignment term is in the loss (align / rest = 2 * coef)
                if method in ("trace", "trace-fullcodes", "trace-noroutingreplay") and coef > 0:
                    rec["grad_norm_align"], rec["grad_norm_rest"] = 2 * coef * (1 + s), 1.0 + s
            f.write(json.dumps(rec) + "\n")
    final = 0.2 + 0.05 * steps
    with open(os.path.join(run_dir, "eval.json"), "w") as f:
        json.dump({"checkpoint": os.path.join(run_dir, "ckpt"),
                   "bf16": eval_block([final + d for d in (-0.1, 0.0, 0.1)]),
                   "fp4": eval_block([final - drop + d for d in (-0.1, 0.0, 0.1)])}, f)
    open(os.path.join(run_dir, "done"), "w").close()


def eval_block(per_prompt: list[float], samples: int = 4) -> dict:
    """An eval.json block as trace.eval writes it (accuracy, per-prompt accuracies, clustered SE)."""
    n = len(per_prompt)
    mean = sum(per_prompt) / n
    se = math.sqrt(sum((p - mean) ** 2 for p in per_prompt) / (n - 1) / n)
    return {"accuracy": mean, "reward": mean, "n": n * samples, "n_prompts": n, "per_prompt": per_prompt,
            "se": se}


def write_profile(runs_dir, models=("qwen3_moe-tiny", "mixtral-tiny"), tasks=("reasoning",), seeds=(0,),
                  ablation_models=("qwen3_moe-tiny",), ablations=tuple(ABLATIONS), steps: int = 8) -> list[str]:
    """Write a whole profile's worth of runs plus a manifest.json; returns the run keys."""
    runs_dir = os.fspath(runs_dir)
    entries = []
    for m in models:
        for t in tasks:
            for arm in METHODS:
                for s in seeds:
                    entries.append((m, t, arm, arm, s, {}, False))
            if m in ablation_models:
                for arm in ablations:
                    method, extra = ABLATIONS[arm]
                    for s in seeds:
                        entries.append((m, t, arm, method, s, extra, True))
    for m, t, arm, method, s, extra, _ in entries:
        write_run(os.path.join(runs_dir, m, t, arm, f"seed{s}"), m, t, arm, method, s, steps, rl_extra=extra)
    man = {"profile": os.path.basename(runs_dir), "runs_dir": runs_dir,
           "runs": [{"model": m, "task": t, "arm": a, "seed": s, "method": me, "ablation": ab}
                    for m, t, a, me, s, _, ab in entries]}
    with open(os.path.join(runs_dir, "manifest.json"), "w") as f:
        json.dump(man, f)
    return [f"{m}/{t}/{a}/seed{s}" for m, t, a, _, s, _, _ in entries]
