"""Logged runs -> the paper's main table and ablation table, as CSV and Markdown.

    python -m analysis.tables --runs results/runs/smoke --out results/tables/smoke [--manifest M] [--strict]

Writes into --out:
* ``main.csv`` / ``main.md``: model x task x arm (bf16, fp4-naive, qat-independent, qat-weight-only, trace,
  posthoc-fp4): final accuracy under BF16 and FP4 deployment (``eval.json``) with its standard error,
  mean and final mismatch k3 between trainer and rollout log-probs, guidance bytes per generated token,
  rollout tokens/s of generation alone and its speedup over the ``bf16`` arm of the same model, task and
  seed, the overhead of recording the arm's own guidance record, seconds per RL step and, for arms that
  guide the rollout, the step time's overhead over the ``qat-independent`` run of the same model, task
  and seed. ``posthoc-fp4`` is the ``bf16`` arm's policy quantized to FP4 after training: only its FP4
  accuracy applies, the rest is n/a.
  Values are means over seeds (``n_seeds``), with ``<col>_min`` / ``<col>_max`` over seeds and
  ``acc_*_se`` (see `_aggregate`).
* ``ablation.csv`` / ``ablation.md``: TRACE variants (``rho``, full codes vs compact mantissa+scale
  guidance, alignment loss on/off, routing replay on/off) next to ``qat-independent`` (no guidance),
  for every model/task that has ablation arms, with the same step-time overhead over the main runs'
  ``qat-independent`` run.
* ``runs.csv``: one row per run and seed, every summary scalar (see analysis/runs.py for conventions).

Compared against: the paper's claims (TRACE's FP4 accuracy close to the bf16 arm, above posthoc-fp4
and the naive/independent FP4 arms; k3 falling with rho; compact guidance near full codes at about a
third of the bytes). With --strict (the pipeline's default) a run listed in the manifest that is
missing, unfinished or has a non-finite number in a table cell is an error (exit 1).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np
import pandas as pd

from analysis.runs import MAIN_METHODS, POSTHOC, load_runs, summarize
from trace.arms import ARMS
from trace.stats import two_way_se

EXACT = "exact"  # an ablation arm that is a row of the main table: its k3 is the main table's claim too
ARM_ORDER = list(MAIN_METHODS) + [EXACT, POSTHOC]

MAIN_COLUMNS = [
    ("acc_bf16", "Acc BF16 deploy"),
    ("acc_fp4", "Acc FP4 deploy"),
    ("reward_final", "Train reward (last third)"),
    ("response_len", "Response tokens"),
    ("k3_mean", "k3 mean"),
    ("k3_final", "k3 final (last third)"),
    ("k3_grad_mean", "k3 of the gradient's forward"),
    ("guidance_bytes_per_gen_token", "Guidance B / generated token"),
    ("rollout_gen_tokens_per_s", "Generation tok/s"),
    ("rollout_speedup", "Speedup vs bf16"),
    ("record_overhead", "Recording overhead"),
    ("step_s", "s/step"),
    ("step_overhead_vs_qat", "Step overhead vs qat-independent"),
]
ABLATION_COLUMNS = [
    ("acc_bf16", "Acc BF16 deploy"),
    ("acc_fp4", "Acc FP4 deploy"),
    ("k3_mean", "k3 mean"),
    ("k3_final", "k3 final (last third)"),
    ("dlp_abs_max", "max \\|dlp\\|"),
    ("align_grad_ratio", "Align / rest grad norm"),
    ("align_scale_share", "Align scale share"),
    ("code_flip_rate", "Code flip rate"),
    ("unrecoverable_rate", "Unrecoverable rate"),
    ("guidance_bytes_per_gen_token", "Guidance B / generated token"),
    ("guidance_bits_per_element", "Bits / guided element"),
    ("step_overhead_vs_qat", "Step overhead vs qat-independent"),
]
FACTOR_COLUMNS = ["rho", "guidance", "align_coef", "align_parts", "routing_replay"]
ACC_COLUMNS = ("acc_bf16", "acc_fp4")
# columns shown with the range over seeds beside the mean
RANGE_COLUMNS = ("reward_final", "k3_mean", "k3_final", "k3_grad_mean", "dlp_abs_max", "align_grad_ratio", "align_scale_share", "code_flip_rate",
                 "step_s", "step_overhead_vs_qat")
# logged by the trainer only since a later commit: n/a in older runs, so never required
DIAGNOSTIC_COLUMNS = ("align_grad_ratio", "align_scale_share")
# relative to another run of the profile that may not exist (a profile without qat-independent, seeds
# that do not overlap): n/a then, so never required; its inputs (`step_s` of both rows) are
REFERENCE_COLUMNS = ("step_overhead_vs_qat",)
# shown only where a row has a value (the exact arm's; a profile without that arm has no such column)
OPTIONAL_COLUMNS = ("k3_grad_mean",)
# posthoc-fp4 is an evaluation of the bf16 policy, not a training run: only its FP4 accuracy applies
POSTHOC_COLUMNS = ("acc_fp4",)


def applies(arm: str, method: str, col: str) -> bool:
    """Whether `col` is defined for an arm (a cell that is not is shown as n/a and never checked)."""
    if arm == POSTHOC:
        return col in POSTHOC_COLUMNS
    a = ARMS.get(method)
    if col == "guidance_bits_per_element":
        return a is not None and a.record == "guide"
    if col == "k3_grad_mean":
        return a is not None and a.exact
    if col == "unrecoverable_rate":  # one mantissa bit cannot tell a wrong pick from a right one
        return a is not None and a.record == "guide" and a.full_codes
    if col in ("align_grad_ratio", "align_scale_share"):
        return a is not None and a.record == "guide" and a.align
    if col == "step_overhead_vs_qat":
        return a is not None and a.record == "guide"
    return True


PER_PROMPT, CLUSTER = "_per_prompt_", "_cluster_"  # + an accuracy column: a run's per-prompt arrays (not in runs.csv)


def _prompt_arrays(r, row: dict) -> dict:
    """The run's per-prompt accuracies and their clusters per deployment (eval.json; None where absent), as the
    hidden columns PER_PROMPT + acc_<deploy> and CLUSTER + acc_<deploy> of its row."""
    for dep in ("bf16", "fp4"):
        blk = (r.eval or {}).get(dep) or {}
        pp, cl = blk.get("per_prompt"), blk.get("cluster")
        row[f"{PER_PROMPT}acc_{dep}"] = np.asarray(pp, dtype=float) if isinstance(pp, list) else None
        row[f"{CLUSTER}acc_{dep}"] = list(cl) if isinstance(cl, list) else None
    return row


def runs_frame(runs) -> pd.DataFrame:
    """One row per run (analysis.runs.summarize), the speed ratios against the bf16 and qat-independent runs of
    the same model/task/seed, and the hidden per-prompt columns `_aggregate` reads (dropped before runs.csv)."""
    rows = [_prompt_arrays(r, summarize(r)) for r in runs]
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    # speedup of generation alone over the bf16 arm's, same model/task/seed
    base = df[df["arm"] == "bf16"].set_index(["model", "task", "seed"])["rollout_gen_tokens_per_s"]
    keys = list(zip(df["model"], df["task"], df["seed"], strict=False))
    df["rollout_speedup"] = [
        (row_tps / base.get(k, math.nan)) if base.get(k, math.nan) else math.nan
        for row_tps, k in zip(df["rollout_gen_tokens_per_s"], keys, strict=False)
    ]
    # step time over the (main) qat-independent run's, same model/task/seed: the same FP4 rollout and
    # QAT trainer without guidance, so the difference is what guiding costs
    qat = df[(df["arm"] == "qat-independent") & ~df["ablation"].astype(bool)]
    qbase = qat.set_index(["model", "task", "seed"])["step_s"]
    df["step_overhead_vs_qat"] = [
        (s / qbase[k] - 1.0) if applies(arm, method, "step_overhead_vs_qat") and k in qbase.index and qbase[k] > 0
        else math.nan
        for s, k, arm, method in zip(df["step_s"], keys, df["arm"], df["method"], strict=False)
    ]
    return df


def _per_prompt_se(runs: pd.DataFrame, col: str) -> float:
    """The two-way SE of the seed mean of accuracy column `col` (`trace.stats.two_way_se`: a prompt component
    that does not shrink with the seeds, since every seed scores the same prompts, plus the seed component) from
    the runs' per-prompt accuracies; NaN where a run has none or the runs scored different prompt sets."""
    pp, cl = runs[PER_PROMPT + col], runs[CLUSTER + col]
    if any(v is None for v in pp) or len({len(v) for v in pp}) != 1:
        return math.nan
    clusters = {None if c is None else tuple(c) for c in cl}
    if len(clusters) != 1:
        return math.nan
    (cluster,) = clusters
    return float(two_way_se(np.stack(list(pp)), None if cluster is None else np.asarray(cluster))[1])


def _aggregate(df: pd.DataFrame, keys: list[str], value_cols: list[str]) -> pd.DataFrame:
    """Mean over seeds per group, with min/max over seeds and, for accuracies, the standard error of the seed
    mean: the two-way SE of the runs' per-prompt accuracies (`_per_prompt_se`), the same convention as the paired
    comparisons of compare.md; where a run has no per-prompt accuracies, sqrt(max(variance over seeds, mean
    squared evaluation SE) / seeds). With one seed either is that run's prompt-clustered evaluation SE."""
    g = df.groupby(keys, sort=False, dropna=False)
    out = g[value_cols].mean(numeric_only=True)
    out["n_seeds"] = g.size()
    for c in value_cols:
        out[f"{c}_min"] = g[c].min()
        out[f"{c}_max"] = g[c].max()
    for c in ACC_COLUMNS:
        if c not in value_cols:
            continue
        var_seed = g[c].var(ddof=1).fillna(0.0)
        var_eval = g[f"{c}_se"].apply(lambda s: float(np.mean(np.square(s))) if s.notna().all() else math.nan)
        fallback = np.sqrt(np.maximum(var_seed, var_eval) / out["n_seeds"])
        two_way = g.apply(lambda r, c=c: _per_prompt_se(r, c), include_groups=False) if PER_PROMPT + c in df else None
        out[f"{c}_se"] = fallback if two_way is None else two_way.where(two_way.notna(), fallback)
    return out.reset_index()


def _blank_inapplicable(t: pd.DataFrame, cols: list[str]) -> pd.DataFrame:
    t = t.copy()
    for i, row in t.iterrows():
        for c in cols:
            if not applies(row["arm"], row["method"], c):
                for suffix in ("", "_min", "_max", "_se"):
                    if c + suffix in t.columns:
                        t.at[i, c + suffix] = math.nan
    return t


def _order(df: pd.DataFrame, arm_order: list[str]) -> pd.DataFrame:
    rank = {a: i for i, a in enumerate(arm_order)}
    df = df.copy()
    df["_r"] = [rank.get(a, len(rank)) for a in df["arm"]]
    df = df.sort_values(["model", "task", "_r", "arm"], kind="stable").drop(columns="_r")
    return df.reset_index(drop=True)


def main_table(df: pd.DataFrame) -> pd.DataFrame:
    cols = [c for c, _ in MAIN_COLUMNS]
    main = df[~df["ablation"].astype(bool) | (df["arm"] == EXACT)]
    post = main[main["arm"] == "bf16"].copy()
    post["arm"] = POSTHOC
    post["method"] = POSTHOC
    both = pd.concat([main, post], ignore_index=True)
    t = _aggregate(both, ["model", "task", "arm", "method"], cols)
    return _order(_with_commits(_blank_inapplicable(t, cols), both), ARM_ORDER)


def _with_commits(t: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """Column `commits`: the distinct commits the row's runs were made at (a row made at one commit shows
    one), so a row that mixes code versions says so."""
    if "commit" not in runs:
        return t
    by = runs.groupby(["model", "task", "arm"], sort=False)["commit"].agg(lambda c: " ".join(sorted(set(c) - {""})))
    t = t.copy()
    t["commits"] = [by.get((m, k, a), "") for m, k, a in zip(t["model"], t["task"], t["arm"], strict=True)]
    return t


def ablation_table(df: pd.DataFrame) -> pd.DataFrame:
    cols = [c for c, _ in ABLATION_COLUMNS]
    groups = df[df["ablation"].astype(bool)][["model", "task"]].drop_duplicates()
    if groups.empty:
        return pd.DataFrame(columns=["model", "task", "arm", "method", *FACTOR_COLUMNS, *cols, "n_seeds"])
    sel = df.merge(groups, on=["model", "task"])
    sel = sel[[m in ARMS and (ARMS[m].record == "guide" or m == "qat-independent") for m in sel["method"]]]
    t = _aggregate(sel, ["model", "task", "arm", "method", *FACTOR_COLUMNS], cols)
    order = ["qat-independent", "trace"] + sorted(a for a in t["arm"].unique() if a not in ("qat-independent", "trace"))
    return _order(_blank_inapplicable(t, cols), order)


# ---------------------------------------------------------------------------------------------
def _isnan(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _num(v, col: str) -> str:
    if col.startswith("acc") or col == "reward_final":
        return f"{v:.3f}"
    if col in ("k3_mean", "k3_final", "k3_grad_mean", "code_flip_rate", "unrecoverable_rate", "dlp_abs_max"):
        return f"{v:.2e}" if abs(v) < 1e-2 and v != 0 else f"{v:.3f}"
    if col == "rollout_speedup":
        return f"{v:.2f}x"
    if col == "rollout_gen_tokens_per_s":
        return f"{v:.0f}"
    if col == "record_overhead":
        return f"{100 * v:.0f}%"
    if col == "step_overhead_vs_qat":
        return f"{100 * v:+.0f}%"
    if col == "step_s":
        return f"{v:.2f}" if abs(v) < 100 else f"{v:.0f}"
    if col == "response_len":
        return f"{v:.1f}"
    if col in ("guidance_bytes_per_gen_token", "guidance_bits_per_element"):
        return f"{v:.0f}" if abs(v) >= 10 or v == 0 else f"{v:.2f}"
    if col == "rho":
        return f"{v:g}"
    if col == "n_seeds":
        return f"{int(v)}"
    return f"{v:.4g}"


def _fmt(v, col: str) -> str:
    if isinstance(v, (bool, np.bool_)):
        return "on" if v else "off"
    if isinstance(v, str):
        return v
    if _isnan(v):
        return "default" if col in ("rho", "align_coef") else "n/a"
    return _num(v, col)


def cell(row, col: str) -> str:
    """Mean, then `± SE` for accuracies, `[min, max]` over seeds for the mismatch and step-time columns."""
    s = _fmt(row[col], col)
    if s == "n/a":
        return s
    se = row.get(f"{col}_se")
    if col in ACC_COLUMNS and not _isnan(se):
        return f"{s} ± {se:.3f}"
    lo, hi = row.get(f"{col}_min"), row.get(f"{col}_max")
    if col in RANGE_COLUMNS and row["n_seeds"] > 1 and not (_isnan(lo) or _isnan(hi)):
        return f"{s} [{_num(lo, col)}, {_num(hi, col)}]"
    return s


def to_markdown(t: pd.DataFrame, columns: list[tuple[str, str]], lead: list[str], title: str, notes: str) -> str:
    columns = [(c, h) for c, h in columns if c not in OPTIONAL_COLUMNS or (c in t and t[c].notna().any())]
    commits = "commits" in t.columns
    heads = [h.replace("_", " ") for h in lead] + [h for _, h in columns] + ["seeds"] + (["commits"] if commits else [])
    lines = [f"### {title}", "", "| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for _, row in t.iterrows():
        cells = [_fmt(row[c], c) for c in lead] + [cell(row, c) for c, _ in columns]
        cells.append(_fmt(row["n_seeds"], "n_seeds"))
        if commits:
            cells.append(row["commits"] or "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", notes, ""]
    return "\n".join(lines)


COMMON_NOTES = (
    "Accuracy: fraction of correct samples on the unique held-out test prompts (samples and temperature "
    "as in the run config's eval block), policy deployed in the engine in BF16 or in FP4 (W4A4 + FP4 KV); "
    "± = standard error of the mean over seeds, two-way (every seed scores the same prompts): the prompt-clustered "
    "SE of the seed-averaged per-prompt accuracies, plus the variance over seeds beyond what evaluation noise "
    "explains, / seeds (compare.md's convention). k3 = mean(r - 1 - log r), r = exp(lp_train - "
    "lp_rollout) over sampled tokens at the sampling temperature; *mean* over all RL steps, *final* over "
    "the last third of the steps; [min, max] over seeds. Guidance B / generated token: all bytes of a "
    "step's record (prompt rows once, routing ids included) over the tokens the rollout generated, i.e. "
    "what must travel per trained token (0 without guidance). n/a: the column does not apply to the arm."
)
MAIN_NOTES = COMMON_NOTES + (
    " Response tokens: generated tokens per rollout response, mean over the RL steps and seeds (answers of a "
    "few tokens leave no room for an FP4 mismatch to compound). commits: the commits the row's runs were made "
    "at (meta.json). Train reward: mean rollout reward over the last third of the RL steps, i.e. on the training prompts as the "
    "arm's own rollout samples them (at the sampling temperature); far above the held-out accuracy, it says the "
    "run fit (or memorized) its training prompts. Generation tok/s: generated tokens over generation time with recording excluded, median over steps "
    "on the profile's device; speedup relative to the bf16 arm of the same model/task/seed. Recording "
    "overhead: time spent recording the arm's own guidance record over generation time (diagnostic "
    "records are never counted); where decode steps record inside CUDA graphs (GPU runs after commit "
    "a4c25f8), packing the rows there counts as generation, so compare the arm's tok/s with fp4-naive's. "
    "posthoc-fp4: the bf16 arm's policy quantized to FP4 after training, an "
    "evaluation only (its training columns are n/a). s/step: wall time of an RL step (rollout, "
    "recording, training, and the periodic held-out evaluation in the few steps that have one), median over "
    "a run's steps leaving out the first (warm-up); mean [min, max] over seeds. Runs shared their device "
    "with other runs of the profile (gpu_slots_per_device runs per GPU; on the CPU, as many runs as the "
    "pipeline ran at once), so s/step includes that sharing. Step overhead vs qat-independent: a run's "
    "s/step over that of the qat-independent run of the same model/task/seed, minus 1, for arms that guide "
    "the rollout; mean [min, max] over the seeds that have that qat-independent run; n/a for arms without "
    "guidance and where no seed has it. Both ratios (speedup, step overhead) compare runs that may have run "
    "in different stretches of the profile, next to different jobs (meta.json's start_time says when each "
    "ran), so they carry that difference in load too."
)
EXACT_NOTES = (
    " exact (an ablation arm shown here beside the main arms): the trainer's log-prob values are the batch-invariant "
    "engine's, equal to the rollout's bit for bit, so its k3 is 0 and its TIS weights are exactly 1; what \"exact\" "
    "covers is those values and weights. The gradient is that of the trainer's straight-through QAT forward with "
    "each layer's input pinned to the engine's (DESIGN.md §4), a function whose own log-probs differ from the "
    "rollout's: k3 of the gradient's forward is their k3 against the rollout's (mean over the RL steps; n/a for "
    "the other arms, whose k3 is already that of the forward they differentiate)."
)
ABLATION_NOTES = COMMON_NOTES + (
    " TRACE variants: rho = fraction of the deepest layers guided; guidance = compact (mantissa bit + "
    "block scales) or full 4-bit codes; align coef = weight of the alignment loss (0: off); align parts = what the "
    "term acts on (the elements' codes, and NVFP4's block scales unless `rl.align_scales` is off); routing replay "
    "on/off. qat-independent = FP4 "
    "trainer with its own rounding, no guidance. Align / rest grad norm: median over the steps the trainer "
    "logs it (step 1 and evaluation steps) of the alignment term's gradient norm over that of the rest of "
    "the loss, both before clipping (`rl.grad_clip` clips their sum); n/a without the term and for runs "
    "made before it was logged. Align scale share: median over steps of the block-scale part's share of "
    "the alignment term's sum (the rest is its element part; DESIGN.md §3), n/a as the column before. "
    "Code flip rate: per layer, the fraction of FP4 activation "
    "codes of the trainer *before guidance* that differ from the rollout's codes (rollout's routing), mean "
    "over all layers and steps (a diagnostic record, the same layers for every arm). Bits / guided "
    "element: record bits of the activation sites over the elements they guide. Unrecoverable: guided "
    "elements more than one grid step away, measurable only with full codes. Step overhead vs "
    "qat-independent: the run's median s/step (RL step wall time, the first step left out) over that of "
    "the main table's qat-independent run of the same model/task/seed, minus 1; runs shared their device "
    "with other runs (gpu_slots_per_device runs per GPU), possibly in different stretches of the profile "
    "next to different jobs (meta.json's start_time), so both times include that sharing; mean [min, max] "
    "over the seeds that have that run; n/a for qat-independent and where no seed has it."
)


def check(t: pd.DataFrame, columns: list[tuple[str, str]], what: str) -> list[str]:
    """Every cell that applies to its arm must be a finite number (diagnostics that older runs did not log
    and cells relative to a run the profile may lack excepted: they show n/a)."""
    errs = []
    for _, row in t.iterrows():
        bad = [c for c, _ in columns if c not in DIAGNOSTIC_COLUMNS + REFERENCE_COLUMNS
               and applies(row["arm"], row["method"], c)
               and not (isinstance(row[c], (int, float)) and math.isfinite(row[c]))]
        if bad:
            errs.append(f"{what}: {row['model']}/{row['task']}/{row['arm']}: non-finite {', '.join(bad)}")
    return errs


def build(runs_dir: str, out: str, manifest: str | None = None, strict: bool = False) -> dict[str, pd.DataFrame]:
    runs = load_runs(runs_dir, manifest)
    problems = [f"run {r.key}: {', '.join(r.problems)}" for r in runs if r.problems]
    if not runs:
        raise SystemExit(f"no runs found under {runs_dir}")
    df = runs_frame([r for r in runs if r.metrics])
    if df.empty:
        raise SystemExit(f"no run under {runs_dir} has metrics yet: " + "; ".join(problems))
    main = main_table(df)
    abl = ablation_table(df)
    os.makedirs(out, exist_ok=True)
    df.drop(columns=[c for c in df if c.startswith((PER_PROMPT, CLUSTER))]).to_csv(
        os.path.join(out, "runs.csv"), index=False, float_format="%.6g")
    main.to_csv(os.path.join(out, "main.csv"), index=False, float_format="%.6g")
    abl.to_csv(os.path.join(out, "ablation.csv"), index=False, float_format="%.6g")
    profile = os.path.basename(os.path.normpath(runs_dir))
    with open(os.path.join(out, "main.md"), "w") as f:
        f.write(to_markdown(main, MAIN_COLUMNS, ["model", "task", "arm"],
                            f"Main table ({profile} profile)",
                            MAIN_NOTES + (EXACT_NOTES if (main["arm"] == EXACT).any() else "")))
    with open(os.path.join(out, "ablation.md"), "w") as f:
        f.write(to_markdown(abl, ABLATION_COLUMNS, ["model", "task", "arm", *FACTOR_COLUMNS],
                            f"Ablations ({profile} profile)", ABLATION_NOTES))
    problems += check(main, MAIN_COLUMNS, "main") + check(abl, ABLATION_COLUMNS, "ablation")
    for p in problems:
        print(("ERROR: " if strict else "warning: ") + p, file=sys.stderr)
    if strict and problems:
        raise SystemExit(f"{len(problems)} problem(s) in the tables of {runs_dir} (see above)")
    print(f"wrote {out}/main.{{csv,md}} ({len(main)} rows), ablation.{{csv,md}} ({len(abl)} rows), runs.csv "
          f"({len(df)} runs)")
    return {"runs": df, "main": main, "ablation": abl}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", required=True, help="profile runs dir, e.g. results/runs/smoke")
    ap.add_argument("--out", required=True, help="output dir, e.g. results/tables/smoke")
    ap.add_argument("--manifest", help="the pipeline's manifest.json (default: <runs>/manifest.json if present)")
    ap.add_argument("--strict", action="store_true", help="missing runs or non-finite cells are errors")
    a = ap.parse_args(argv)
    build(a.runs, a.out, a.manifest, a.strict)


if __name__ == "__main__":
    main()
