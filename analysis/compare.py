"""Arm against arm on held-out accuracy, paired by seed and prompt: the differences the main table's
columns only suggest, with their standard errors.

    python -m analysis.compare --runs results/runs/small --out results/tables/small

Inputs: ``<runs>/<model>/<task>/<arm>/seed<k>/eval.json`` of the main arms (ablation arms are not
compared), whose ``bf16`` and ``fp4`` blocks hold per-prompt accuracies. Every final evaluation of a
model/task scores the same unique held-out prompts with the same sampling seed, and seed k of two arms
starts from the same SFT base with the same data order, so arm A's run of seed k is paired with arm B's run
of seed k, prompt by prompt.

Per comparison (``COMPARISONS``: arm and deployment on each side) and model/task, over the K seeds both arms
have, with d[k, i] = acc_A - acc_B of seed k on prompt i (``trace.stats.two_way_se``): the difference is the mean of d; its
variance is that of a two-way layout whose prompts are shared by every seed (a prompt's difficulty for one
arm against the other recurs in each seed, so it does not shrink with K):
  * the prompt component: the squared prompt-clustered SE of the seed-averaged per-prompt differences
    mean_k d[k, i] (it holds the prompts' own spread and the within-seed evaluation noise, / K);
  * the seed component: the variance over seeds of the per-seed differences mean_i d[k, i], less the part of
    it the evaluation noise explains (the seeds' mean squared clustered SE of the prompt-by-seed residuals,
    times K / (K - 1); an unbiased estimate, floored at 0), / K.
``t`` = difference / SE, referred to Student's t at K - 1 degrees of freedom (``df``): the seed component is
estimated from K seeds, and at 3 seeds a normal reference would reject a true null up to ~18% of the time at
nominal 5% (tests/analysis/test_compare.py's simulation). One seed gives no test (df 0: p and intervals n/a).
``A > B`` counts the seeds whose difference is positive. The comparisons of a profile are one family (every
comparison of every model/task): each gets its two-sided p-value, the Holm-adjusted p-value over the family
(``p_holm``), its ``verdict`` from Holm's step-down decision at family-wise level ``FAMILY_ALPHA``
(higher / lower / no difference detected / not tested), and a simultaneous (Bonferroni) interval
(``lo_sim``, ``hi_sim``): the difference ± the t quantile of level FAMILY_ALPHA / m, times its SE (m tested
comparisons; all m cover together with probability at least 95%). An interval that excludes 0 always comes
with a Holm rejection of the same sign; Holm, stepping down, can also reject where the interval still touches
0. ``p_equiv``: the equivalence test against ``EQUIV_MARGIN`` (DESIGN.md §4), two one-sided t tests (TOST)
of "difference <= -margin" and "difference >= +margin", the larger of their p-values (below 0.05: the
difference lies within ± the margin at level 0.05; not adjusted for multiplicity: analysis/report.py
requires it in every setting of a claim, an intersection-union test). Writes ``compare.csv`` and ``compare.md`` into --out, and for tasks with a
per-prompt difficulty label (``GROUPS``: long-horizon's bisection guesses) the same comparisons within each
label's prompts into ``compare_groups.csv`` / ``.md`` (the prompts are the run config's held-out examples, in
the order eval.json scores them).
Compared against: the main table (analysis/tables.py), whose per-arm means these differences are the
differences of.
"""
from __future__ import annotations

import argparse
import json
import math
import os

import numpy as np
import pandas as pd
from scipy import stats

from analysis.runs import load_runs
from trace.stats import two_way_se
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
EQUIV_MARGIN = 0.02  # absolute held-out accuracy: the equivalence margin fixed in DESIGN.md §4

# per-prompt breakdowns: task -> (what the label is, held-out Example -> label)
GROUPS = {"long_horizon": ("bisection guesses", bisection_guesses)}


COLUMNS = ["model", "task", "a", "b", "acc_a", "acc_b", "diff", "se", "df", "t", "n_seeds", "a_better", "per_seed",
           "n_prompts", "p", "p_equiv", "p_holm", "verdict", "lo_sim", "hi_sim"]
FAMILY = ["p_holm", "verdict", "lo_sim", "hi_sim"]  # the columns `holm` adds over the whole table


def holm(t: pd.DataFrame, alpha: float = FAMILY_ALPHA) -> pd.DataFrame:
    """Adds the family's columns (FAMILY, see the module docstring) to a table with `diff`, `se`, `df`, `p`: Holm's
    step-down over the rows with a p-value, and the Bonferroni intervals at the same family-wise level."""
    t = t.copy()
    p = t["p"].to_numpy(dtype=float)
    order = [i for i in np.argsort(np.where(np.isfinite(p), p, np.inf), kind="stable") if np.isfinite(p[i])]
    m = len(order)
    p_holm = np.full(len(t), np.nan)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        p_holm[i] = running
    diff, se = t["diff"].to_numpy(dtype=float), t["se"].to_numpy(dtype=float)
    half = np.where(np.isfinite(p), stats.t.isf(alpha / max(m, 1) / 2, t["df"].to_numpy(dtype=float)), np.nan) * se
    t["p_holm"] = p_holm
    t["verdict"] = np.where(~np.isfinite(p_holm), "not tested", np.where(
        p_holm >= alpha, "no difference detected", np.where(diff > 0, "higher", "lower")))
    t["lo_sim"], t["hi_sim"] = diff - half, diff + half
    return t


def _per_prompt(eval_json: dict | None, deploy: str) -> np.ndarray | None:
    blk = (eval_json or {}).get(deploy) or {}
    return np.asarray(blk["per_prompt"], dtype=float) if isinstance(blk.get("per_prompt"), list) else None


def paired(a: list[np.ndarray], b: list[np.ndarray], cluster: np.ndarray | None = None,
           margin: float = EQUIV_MARGIN) -> dict:
    """Seed-paired difference of two arms' per-prompt accuracies (a[k], b[k]: seed k, same prompts) with its SE
    (`trace.stats.two_way_se`), t statistic, df, two-sided p and TOST p against `margin` (the module docstring)."""
    if any(x.shape != y.shape for x, y in zip(a, b, strict=True)):
        raise ValueError("paired runs scored different prompt sets")
    d = np.stack([x - y for x, y in zip(a, b, strict=True)])  # [K, N]
    diff, se = (float(v) for v in two_way_se(d, cluster))
    df = d.shape[0] - 1
    tv = diff / se if se > 0 and df > 0 else math.nan
    per_seed = d.mean(1)
    # TOST: H0 difference <= -margin (p of the t of diff + margin) and H0 difference >= +margin
    p_equiv = float(stats.t.sf(min(diff + margin, margin - diff) / se, df)) if np.isfinite(tv) else math.nan
    return {"acc_a": float(np.mean([x.mean() for x in a])), "acc_b": float(np.mean([y.mean() for y in b])),
            "diff": diff, "se": se, "df": df, "t": tv, "n_seeds": d.shape[0],
            "a_better": int((per_seed > 0).sum()), "per_seed": " ".join(f"{v:+.3f}" for v in per_seed),
            "n_prompts": int(d.shape[1]), "p": float(2 * stats.t.sf(abs(tv), df)) if np.isfinite(tv) else math.nan,
            "p_equiv": p_equiv}


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
    return holm(pd.DataFrame(rows, columns=[c for c in COLUMNS if c not in FAMILY])).reindex(columns=COLUMNS)


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
    return pd.DataFrame(rows, columns=COLUMNS[:2] + ["group"] + [c for c in COLUMNS[2:] if c not in FAMILY])


NOTES = ("Held-out accuracy of arm A minus arm B (deployment in brackets; bf16 (FP4) is the posthoc-fp4 row of the "
         "main table), paired by seed (same SFT base and data order) and by prompt (same held-out prompts and "
         "sampling seed). Difference: mean over the seeds both arms have and the prompts; ± its SE, the prompt "
         "component (prompt-clustered SE of the seed-averaged per-prompt differences) and the seed component (spread "
         "of the per-seed differences beyond what the evaluation noise explains, / seeds) added in quadrature; "
         "t = difference / SE on seeds - 1 degrees of freedom (df). Holm: the comparisons of the whole table are one "
         "family, family-wise level 0.05; verdict = Holm's step-down decision (higher / lower / no difference "
         "detected, which is not evidence of equality; not tested: one seed), Holm p = the adjusted p-value. "
         "Simultaneous 95% interval: the difference ± the t quantile at level 0.05 / (comparisons tested), times the "
         "SE (Bonferroni: every interval of the table covers at once with probability at least 95%); one that "
         "excludes 0 always has a Holm verdict of the same sign, and Holm can also decide where it still touches 0. "
         f"Equiv. p: two one-sided t tests of |difference| >= {EQUIV_MARGIN} (DESIGN.md §4), the larger p; below "
         f"0.05, the difference is within ±{EQUIV_MARGIN} (per comparison, not adjusted). A > B: seeds whose "
         "difference is positive; per seed: the differences, seed 0 first.")


GROUP_NOTES = ("The comparisons above within the held-out prompts of one difficulty label (long-horizon: the guesses "
               "a bisection needs to find the secret, 1 at the range's midpoint), same conventions without the "
               "family's columns; the prompt-weighted mean of a comparison's group differences is its overall "
               "difference. Few prompts per group: a diagnostic of where a difference comes from, not a test of its own.")


def _p(v: float) -> str:
    return "n/a" if not np.isfinite(v) else "<0.001" if v < 0.001 else f"{v:.3f}"


def _interval(lo: float, hi: float) -> str:
    return "n/a" if not (np.isfinite(lo) and np.isfinite(hi)) else f"[{lo:+.3f}, {hi:+.3f}]"


def to_markdown(t: pd.DataFrame, profile: str, groups: bool = False) -> str:
    g = "group | " if groups else ""
    h = "" if groups else " simultaneous 95% interval | Holm p | verdict | equiv. p |"
    lines = [f"### Paired arm comparisons ({profile} profile){' by prompt group' if groups else ''}: held-out "
             "accuracy, A - B", "",
             f"| model | task | {g}A | B | prompts | acc A | acc B | A - B | t (df) |{h} A > B | per seed |",
             "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if groups else "---|---|---|---|")]
    for _, r in t.iterrows():
        hv = "" if groups else (f" {_interval(r.lo_sim, r.hi_sim)} | {_p(r.p_holm)} | {r.verdict} | "
                                f"{_p(r.p_equiv)} |")
        tv = f"{r.t:+.1f} ({int(r.df)})" if np.isfinite(r.t) else "n/a"
        lines.append(f"| {r.model} | {r.task} | {r.group + ' | ' if groups else ''}{r.a} | {r.b} | {r.n_prompts} | "
                     f"{r.acc_a:.3f} | {r.acc_b:.3f} | {r['diff']:+.3f} ± {r.se:.3f} | {tv} |{hv} "
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
