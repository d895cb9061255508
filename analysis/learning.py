"""Does RL learn in this profile? Held-out accuracy of one arm's final policies against their SFT base.

    python -m analysis.learning --runs results/runs/smoke --out results/tables/smoke [--arm bf16] \
        [--min-se 3] [--strict]

Inputs: ``<runs>/<model>/<task>/sft/eval.json`` or, with one base per seed, ``sft/seed<k>/eval.json`` (the SFT base, i.e. every RL run's step 0, evaluated
with the arm's run config: the same unique held-out prompts, samples, temperature and seed as the final
evaluations) and ``<runs>/<model>/<task>/<arm>/seed<k>/eval.json``. Both hold per-prompt accuracies.

Per model, task and seed: the rise ``d = acc_final - acc_base`` in BF16 deployment and its standard
error clustered by prompt: sd over prompts of the per-prompt rise / sqrt(prompts). Both evaluations
score the same prompts with the same sampling seed, so their per-prompt accuracies are correlated (a
hard prompt stays hard) and this paired SE is the standard error of the rise; the unpaired
``sqrt(se_base^2 + se_final^2)``, which treats them as independent samples and overstates it, is written
beside it. The check is on the arm's accuracy as the tables show it, the mean over seeds: per prompt,
the seeds' final accuracies are averaged, and the check passes when that mean rise exceeds ``min_se``
times its prompt-clustered SE; every seed's own rise and SE are listed too. Writes ``learning.csv`` and ``learning.md`` into --out; with --strict a failed or
missing check exits 1 (the smoke pipeline's tables rule runs it so).
Compared against: DESIGN.md §4 (the smoke profile checks that RL learns from the SFT base).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np
import pandas as pd

from analysis.runs import load_runs, se_clustered

DEPLOY = "bf16"


def _block(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return (json.load(f) or {}).get(DEPLOY)


def rise(base: dict, final: dict) -> dict:
    """Accuracy rise from `base` to `final` (eval.json blocks over the same prompts) and its SEs."""
    p0 = np.asarray(base["per_prompt"], dtype=float)
    p1 = np.asarray(final["per_prompt"], dtype=float)
    if p0.shape != p1.shape:
        raise ValueError(f"base has {p0.size} prompts, final {p1.size}: not the same evaluation set")
    cluster = final.get("cluster")  # the prompts' clusters (eval.json), the same for the base's evaluation
    se0, se1 = se_clustered(p0, cluster), se_clustered(p1, cluster)
    return {"acc_base": float(p0.mean()), "acc_final": float(p1.mean()), "rise": float(p1.mean() - p0.mean()),
            "se_base": se0, "se_final": se1, "se_rise": se_clustered(p1 - p0, cluster),
            "se_rise_unpaired": math.sqrt(se0**2 + se1**2), "n_prompts": int(p0.size)}


def _z(num: float, se: float) -> float:
    return num / se if se > 0 else math.nan


def learning_table(runs_dir: str, arm: str = "bf16", min_se: float = 3.0, manifest: str | None = None):
    """One row per seed and one ``seed = "mean"`` row per model/task (the accuracy the tables show:
    the mean over seeds, per prompt); the check is on the mean rows."""
    rows, problems = [], []
    finals: dict[tuple[str, str], list[np.ndarray]] = {}
    bases: dict[tuple[str, str], list[np.ndarray]] = {}
    clusters: dict[tuple[str, str], list[int] | None] = {}
    for r in load_runs(runs_dir, manifest):
        if r.arm != arm:
            continue
        # the run's own SFT base where the profile trains one per seed (sft/seed<k>/), else the shared one
        base_path = os.path.join(runs_dir, r.model, r.task, "sft", f"seed{r.seed}", "eval.json")
        if not os.path.exists(base_path):
            base_path = os.path.join(runs_dir, r.model, r.task, "sft", "eval.json")
        base, final = _block(base_path), _block(os.path.join(r.dir, "eval.json"))
        if base is None or final is None or "per_prompt" not in base or "per_prompt" not in final:
            problems.append(f"{r.key}: no per-prompt {DEPLOY} evaluation of the base ({base_path}) or the run")
            continue
        row = {"model": r.model, "task": r.task, "arm": r.arm, "seed": str(r.seed), **rise(base, final)}
        rows.append(row)
        bases.setdefault((r.model, r.task), []).append(np.asarray(base["per_prompt"], dtype=float))
        clusters[(r.model, r.task)] = final.get("cluster")
        finals.setdefault((r.model, r.task), []).append(np.asarray(final["per_prompt"], dtype=float))
    for (model, task), fs in finals.items():
        # per prompt, the mean over seeds of the bases (one shared base: that base) and of the final policies
        base = {"per_prompt": list(np.mean(bases[(model, task)], axis=0))}
        mean = {"model": model, "task": task, "arm": arm, "seed": "mean",
                **rise(base, {"per_prompt": list(np.mean(fs, axis=0)), "cluster": clusters[(model, task)]}),
                "n_seeds": len(fs)}
        rows.append(mean)
    for row in rows:
        row["z"] = _z(row["rise"], row["se_rise"])
        row["z_unpaired"] = _z(row["rise"], row["se_rise_unpaired"])
        row["passed"] = bool(row["z"] > min_se) if row["seed"] == "mean" else None
        if row["passed"] is False:
            problems.append(f"{row['model']}/{row['task']}/{arm}: held-out accuracy (mean over {row['n_seeds']} seeds) "
                            f"{row['acc_base']:.3f} -> {row['acc_final']:.3f}, rise {row['rise']:+.3f} is not above "
                            f"{min_se:g} SE ({min_se * row['se_rise']:.3f})")
    if not rows and not problems:
        problems.append(f"no {arm} runs under {runs_dir}")
    return pd.DataFrame(rows), problems


def _verdict(passed) -> str:
    return "" if passed is None or passed != passed else ("yes" if passed else "NO")


def to_markdown(t: pd.DataFrame, arm: str, min_se: float) -> str:
    lines = [f"### Learning check: {arm} arm, held-out accuracy ({DEPLOY} deployment), SFT base -> end of RL", "",
             "| model | task | seed | prompts | base | final | rise | SE of rise | rise / SE | SE unpaired | rise / SE unpaired | passed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for _, r in t.iterrows():
        lines.append(f"| {r.model} | {r.task} | {r.seed} | {r.n_prompts} | {r.acc_base:.3f} ± {r.se_base:.3f} | "
                     f"{r.acc_final:.3f} ± {r.se_final:.3f} | {r.rise:+.3f} | {r.se_rise:.3f} | {r.z:.1f} | "
                     f"{r.se_rise_unpaired:.3f} | {r.z_unpaired:.1f} | {_verdict(r.passed)} |")
    lines += ["", f"Checked on the mean over seeds (per prompt); passes when its rise > {min_se:g} x its prompt-clustered SE: sd over prompts of the per-prompt rise / "
              "sqrt(prompts) (both evaluations score the same prompts with the same sampling seed). SE unpaired = "
              "sqrt(se_base^2 + se_final^2), as if the two evaluations were independent. ± = prompt-clustered SE.", ""]
    return "\n".join(lines)


def build(runs_dir: str, out: str, arm: str = "bf16", min_se: float = 3.0, manifest: str | None = None,
          strict: bool = False) -> pd.DataFrame:
    t, problems = learning_table(runs_dir, arm, min_se, manifest)
    os.makedirs(out, exist_ok=True)
    t.to_csv(os.path.join(out, "learning.csv"), index=False, float_format="%.6g")
    with open(os.path.join(out, "learning.md"), "w") as f:
        f.write(to_markdown(t, arm, min_se) if not t.empty else f"### Learning check\n\nno data: {problems}\n")
    for p in problems:
        print(("ERROR: " if strict else "warning: ") + p, file=sys.stderr)
    if strict and problems:
        raise SystemExit(f"learning check failed ({len(problems)} problem(s), see above)")
    print(f"wrote {out}/learning.{{csv,md}} ({len(t)} rows)")
    return t


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--arm", default="bf16")
    ap.add_argument("--min-se", type=float, default=3.0)
    ap.add_argument("--manifest")
    ap.add_argument("--strict", action="store_true")
    a = ap.parse_args(argv)
    build(a.runs, a.out, a.arm, a.min_se, a.manifest, a.strict)


if __name__ == "__main__":
    main()
