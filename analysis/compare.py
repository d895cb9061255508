"""Arm against arm on held-out accuracy, paired by seed and prompt: the differences the main table's
columns only suggest, with their standard errors.

    python -m analysis.compare --runs results/runs/small --out results/tables/small

Inputs: ``<runs>/<model>/<task>/<arm>/seed<k>/eval.json`` of the main arms (ablation arms are not
compared), whose ``bf16`` and ``fp4`` blocks hold per-prompt accuracies. Every final evaluation of a
model/task scores the same unique held-out prompts with the same sampling seed, and seed k of two arms
starts from the same SFT base with the same data order, so arm A's run of seed k is paired with arm B's run
of seed k, prompt by prompt.

Per comparison (``COMPARISONS``: arm and deployment on each side) and model/task, over the seeds both arms
have: the per-seed difference ``d_k = acc_A - acc_B`` and its prompt-clustered SE ``e_k`` (sd over prompts of
the per-prompt difference / sqrt(prompts)); the difference is their mean, and its SE the main table's
convention for a mean over seeds, sqrt(max(variance of d_k over seeds, mean e_k^2) / seeds): the
evaluation SE is a floor, since 3 seeds can agree by chance more closely than one evaluation resolves.
``z`` = difference / SE; ``A > B`` counts the seeds whose difference is positive. The comparisons of a profile
are many (every comparison of every model/task), so each also gets its two-sided normal p-value, the
Holm-adjusted p-value over the whole table (``p_holm``), and a Holm interval (``lo_holm``, ``hi_holm``): the
difference ± z(1 - a/2) SE at the level a = 0.05 / (m - rank + 1) that Holm's step-down procedure tests it
at (rank of its p-value among the m comparisons), so the interval excludes 0 exactly where Holm rejects at
family-wise level 0.05 (given the smaller p-values were rejected). Writes ``compare.csv`` and ``compare.md`` into --out, and for tasks with a
per-prompt difficulty label (``GROUPS``: long-horizon's bisection guesses) the same comparisons within each
label's prompts into ``compare_groups.csv`` / ``.md`` (the prompts are the run config's held-out examples, in
the order eval.json scores them).
Compared against: the main table (analysis/tables.py), whose per-arm means and SEs these differences are
consistent with (difference of the means; a smaller SE where seeds and prompts are shared).
"""
from __future__ import annotations

import argparse
import json
import math
import os
from statistics import NormalDist

import numpy as np
import pandas as pd

from analysis.runs import load_runs, se_clustered
from trace.episode import build_task, heldout_examples
from trace.tasks.long_horizon import bisection_guesses

# (arm A, its deployment, arm B, its deployment): the method's claims at this scale (DESIGN.md §4)
COMPARISONS = [
    ("trace", "fp4", "qat-independent", "fp4"),  # guidance beyond QAT alone
    ("trace", "fp4", "fp4-naive", "fp4"),        # FP4 rollout with vs without the method
    ("qat-independent", "fp4", "fp4-naive", "fp4"),
    ("trace", "fp4", "bf16", "fp4"),             # against the BF16 policy quantized after training (posthoc-fp4)
    ("trace", "fp4", "bf16", "bf16"),            # back to the BF16 curve: FP4-deployed TRACE vs BF16 RL in BF16
    ("fp4-naive", "fp4", "bf16", "bf16"),        # what naive FP4 rollout costs against BF16 RL
]
FAMILY_ALPHA = 0.05  # family-wise error rate of the Holm correction over a profile's comparisons

# per-prompt breakdowns: task -> (what the label is, held-out Example -> label)
GROUPS = {"long_horizon": ("bisection guesses", bisection_guesses)}


COLUMNS = ["model", "task", "a", "b", "acc_a", "acc_b", "diff", "se", "z", "n_seeds", "a_better", "per_seed",
           "n_prompts", "p", "p_holm", "lo_holm", "hi_holm"]


def holm(t: pd.DataFrame, alpha: float = FAMILY_ALPHA) -> pd.DataFrame:
    """Adds p (two-sided, normal), p_holm (Holm-adjusted over all rows) and the Holm interval [lo_holm,
    hi_holm] (see the module docstring) to a table with `diff`, `se`, `z`."""
    t = t.copy()
    z = t["z"].to_numpy(dtype=float)
    p = np.array([math.erfc(abs(v) / math.sqrt(2)) if np.isfinite(v) else math.nan for v in z])
    t["p"] = p
    order = [i for i in np.argsort(np.where(np.isfinite(p), p, np.inf), kind="stable") if np.isfinite(p[i])]
    m = len(order)
    p_holm, lo, hi = np.full(len(t), np.nan), np.full(len(t), np.nan), np.full(len(t), np.nan)
    running = 0.0
    diff, se = t["diff"].to_numpy(dtype=float), t["se"].to_numpy(dtype=float)
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        p_holm[i] = running
        half = NormalDist().inv_cdf(1 - alpha / (m - rank) / 2) * se[i]
        lo[i], hi[i] = diff[i] - half, diff[i] + half
    t["p_holm"], t["lo_holm"], t["hi_holm"] = p_holm, lo, hi
    return t


def _per_prompt(eval_json: dict | None, deploy: str) -> np.ndarray | None:
    blk = (eval_json or {}).get(deploy) or {}
    return np.asarray(blk["per_prompt"], dtype=float) if isinstance(blk.get("per_prompt"), list) else None


def paired(a: list[np.ndarray], b: list[np.ndarray], cluster: np.ndarray | None = None) -> dict:
    """Seed-paired difference of two arms' per-prompt accuracies (a[k], b[k]: seed k, same prompts); each seed's
    SE clustered by `cluster` (the prompts' clusters, eval.json's `cluster`; None: every prompt its own)."""
    if any(x.shape != y.shape for x, y in zip(a, b, strict=True)):
        raise ValueError("paired runs scored different prompt sets")
    d = [x - y for x, y in zip(a, b, strict=True)]
    per_seed = np.array([x.mean() for x in d])
    e = np.array([se_clustered(x, cluster) for x in d])
    n = len(d)
    var_seed = float(np.var(per_seed, ddof=1)) if n > 1 else 0.0
    se = math.sqrt(max(var_seed, float(np.mean(e**2))) / n)
    diff = float(per_seed.mean())
    return {"acc_a": float(np.mean([x.mean() for x in a])), "acc_b": float(np.mean([y.mean() for y in b])),
            "diff": diff, "se": se, "z": diff / se if se > 0 else math.nan, "n_seeds": n,
            "a_better": int((per_seed > 0).sum()), "per_seed": " ".join(f"{v:+.3f}" for v in per_seed),
            "n_prompts": int(a[0].size)}


def main_evals(runs_dir: str, manifest: str | None):
    """-> ({(model, task, arm, seed): eval.json}, {(model, task): a run's config}) of the main arms' runs."""
    evals: dict[tuple[str, str, str, int], dict] = {}
    configs: dict[tuple[str, str], dict] = {}
    for r in load_runs(runs_dir, manifest):
        if not r.ablation and r.eval:
            evals[(r.model, r.task, r.arm, r.seed)] = r.eval
            configs.setdefault((r.model, r.task), r.config)
    return evals, configs


def _cluster(eval_json: dict | None, deploy: str) -> np.ndarray | None:
    blk = (eval_json or {}).get(deploy) or {}
    return np.asarray(blk["cluster"], dtype=int) if isinstance(blk.get("cluster"), list) else None


def _pairs(evals: dict, model: str, task: str):
    """-> per comparison: (arm A's label, arm B's label, A's per-prompt arrays, B's, the prompts' clusters or None),
    seeds both arms evaluated."""
    for arm_a, dep_a, arm_b, dep_b in COMPARISONS:
        seeds = sorted(s for m, t, arm, s in evals if (m, t, arm) == (model, task, arm_a)
                       and (model, task, arm_b, s) in evals)
        a = [_per_prompt(evals[(model, task, arm_a, s)], dep_a) for s in seeds]
        b = [_per_prompt(evals[(model, task, arm_b, s)], dep_b) for s in seeds]
        keep = [i for i in range(len(seeds)) if a[i] is not None and b[i] is not None]
        if keep:
            yield (f"{arm_a} ({dep_a.upper()})", f"{arm_b} ({dep_b.upper()})",
                   [a[i] for i in keep], [b[i] for i in keep], _cluster(evals[(model, task, arm_a, seeds[keep[0]])], dep_a))


def compare_table(evals: dict) -> pd.DataFrame:
    """The comparisons per model/task of the main arms' evaluations (`main_evals`)."""
    rows = []
    for model, task in dict.fromkeys((m, t) for m, t, _, _ in evals):
        for la, lb, a, b, cl in _pairs(evals, model, task):
            rows.append({"model": model, "task": task, "a": la, "b": lb, **paired(a, b, cl)})
    # the header even without a pair, so the CSV always reads back
    return holm(pd.DataFrame(rows, columns=COLUMNS[:-4])).reindex(columns=COLUMNS)


def group_table(evals: dict, configs: dict) -> pd.DataFrame:
    """The comparisons within each difficulty label's held-out prompts (tasks in GROUPS): column ``group``, from
    `main_evals`'s evaluations and run configs."""
    rows = []
    for model, task in dict.fromkeys((m, t) for m, t, _, _ in evals):
        if task not in GROUPS:
            continue
        what, label = GROUPS[task]
        cfg = configs[(model, task)]
        groups = np.array([label(e) for e in heldout_examples(cfg, build_task(cfg))])  # [prompts]
        for la, lb, a, b, cl in _pairs(evals, model, task):
            if a[0].size != groups.size:
                raise ValueError(f"{model}/{task}: eval.json scored {a[0].size} prompts, the config holds {groups.size}")
            for g in sorted(set(groups.tolist())):
                sel = groups == g
                rows.append({"model": model, "task": task, "group": f"{what} = {g}", "a": la, "b": lb,
                             **paired([x[sel] for x in a], [y[sel] for y in b], None if cl is None else cl[sel])})
    return pd.DataFrame(rows, columns=COLUMNS[:2] + ["group"] + COLUMNS[2:-4])


NOTES = ("Held-out accuracy of arm A minus arm B (deployment in brackets; bf16 (FP4) is the posthoc-fp4 row of the "
         "main table), paired by seed (same SFT base and data order) and by prompt (same held-out prompts and "
         "sampling seed). Difference: mean over the seeds both arms have; ± its SE, sqrt(max(seed variance of the "
         "per-seed differences, mean squared prompt-clustered SE of a seed's difference) / seeds); z = difference / "
         "SE; A > B: seeds whose difference is positive; per seed: the differences, seed 0 first. Holm: the "
         "comparisons of the whole table are one family (Holm's step-down correction at family-wise level 0.05); "
         "p = Holm-adjusted two-sided p-value, interval = the difference ± the normal quantile of the level Holm "
         "tests it at, times its SE (it excludes 0 exactly where the correction rejects).")


GROUP_NOTES = ("The comparisons above within the held-out prompts of one difficulty label (long-horizon: the guesses "
               "a bisection needs to find the secret, 1 at the range's midpoint), same conventions without the "
               "Holm columns; the prompt-weighted mean of a comparison's group differences is its overall difference. "
               "Few prompts per group: a diagnostic of where a difference comes from, not a test of its own.")


def _p(v: float) -> str:
    return "n/a" if not np.isfinite(v) else "<0.001" if v < 0.001 else f"{v:.3f}"


def to_markdown(t: pd.DataFrame, profile: str, groups: bool = False) -> str:
    g = "group | " if groups else ""
    h = "" if groups else " Holm interval | Holm p |"
    lines = [f"### Paired arm comparisons ({profile} profile){' by prompt group' if groups else ''}: held-out "
             "accuracy, A - B", "",
             f"| model | task | {g}A | B | prompts | acc A | acc B | A - B | z |{h} A > B | per seed |",
             "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if groups else "---|---|")]
    for _, r in t.iterrows():
        hv = "" if groups else f" [{r.lo_holm:+.3f}, {r.hi_holm:+.3f}] | {_p(r.p_holm)} |"
        lines.append(f"| {r.model} | {r.task} | {r.group + ' | ' if groups else ''}{r.a} | {r.b} | {r.n_prompts} | "
                     f"{r.acc_a:.3f} | {r.acc_b:.3f} | {r['diff']:+.3f} ± {r.se:.3f} | {r.z:+.1f} |{hv} "
                     f"{r.a_better}/{r.n_seeds} | {r.per_seed} |")
    return "\n".join(lines + ["", GROUP_NOTES if groups else NOTES, ""])


def build(runs_dir: str, out: str, manifest: str | None = None) -> pd.DataFrame:
    evals, configs = main_evals(runs_dir, manifest)  # the runs are read once for both tables
    t = compare_table(evals)
    profile = os.path.basename(os.path.normpath(runs_dir))
    os.makedirs(out, exist_ok=True)
    t.to_csv(os.path.join(out, "compare.csv"), index=False, float_format="%.6g")
    with open(os.path.join(out, "compare.md"), "w") as f:
        f.write(to_markdown(t, profile) if not t.empty
                else f"### Paired arm comparisons ({profile} profile)\n\nno pair of arms with evaluations\n")
    tg = group_table(evals, configs)
    tg.to_csv(os.path.join(out, "compare_groups.csv"), index=False, float_format="%.6g")
    with open(os.path.join(out, "compare_groups.md"), "w") as f:
        f.write(to_markdown(tg, profile, groups=True) if not tg.empty
                else f"### Paired arm comparisons ({profile} profile) by prompt group\n\nno task with prompt "
                     f"groups ({', '.join(GROUPS)}) has a pair of arms with evaluations\n")
    return t


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--manifest", default=None)
    a = ap.parse_args(argv)
    t = build(a.runs, a.out, a.manifest)
    print(json.dumps({"comparisons": len(t)}))


if __name__ == "__main__":
    main()
