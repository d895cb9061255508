"""Logged runs -> the paper's main table and ablation table, as CSV and Markdown.

    python -m analysis.tables --runs results/runs/smoke --out results/tables/smoke [--manifest M] [--strict]

Writes into --out:
* ``main.csv`` / ``main.md``: model x task x arm (bf16, fp4-naive, qat-independent, qat-weight-only, trace,
  posthoc-fp4): final accuracy under BF16 and FP4 deployment (``eval.json``), mean and final mismatch k3
  between trainer and rollout log-probs, guidance bytes per token, rollout tokens/s and its speedup over
  the ``bf16`` arm of the same model, task and seed (same machine, same run). ``posthoc-fp4`` is the
  ``bf16`` arm's policy quantized to FP4 after training (its training columns are the bf16 run's).
  Values are means over seeds (``n_seeds`` column; ``acc_*_std`` when there are several seeds).
* ``ablation.csv`` / ``ablation.md``: TRACE variants (``rho``, full codes vs compact mantissa+scale
  guidance, alignment loss on/off, routing replay on/off) next to ``qat-independent`` (no guidance),
  for every model/task that has ablation arms.
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

ARM_ORDER = list(MAIN_METHODS) + [POSTHOC]

MAIN_COLUMNS = [
    ("acc_bf16", "Acc BF16 deploy"),
    ("acc_fp4", "Acc FP4 deploy"),
    ("k3_mean", "k3 mean"),
    ("k3_final", "k3 final"),
    ("guidance_bytes_per_token", "Guidance B/token"),
    ("rollout_tokens_per_s", "Rollout tok/s"),
    ("rollout_speedup", "Speedup vs bf16"),
]
ABLATION_COLUMNS = [
    ("acc_bf16", "Acc BF16 deploy"),
    ("acc_fp4", "Acc FP4 deploy"),
    ("k3_mean", "k3 mean"),
    ("k3_final", "k3 final"),
    ("dlp_abs_max", "max \\|dlp\\|"),
    ("code_flip_rate", "Code flip rate"),
    ("unrecoverable_rate", "Unrecoverable rate"),
    ("guidance_bytes_per_token", "Guidance B/token"),
]
FACTOR_COLUMNS = ["rho", "guidance", "align_loss", "routing_replay"]
# numbers that must be finite in every table row (rho may be NaN = trainer's default, shown as such)
REQUIRED_MAIN = [c for c, _ in MAIN_COLUMNS]
REQUIRED_ABLATION = [c for c, _ in ABLATION_COLUMNS if c not in ("unrecoverable_rate",)]


def runs_frame(runs) -> pd.DataFrame:
    rows = [summarize(r) for r in runs]
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    # rollout speedup: tokens/s over the bf16 arm's, same model/task/seed
    base = df[df["arm"] == "bf16"].set_index(["model", "task", "seed"])["rollout_tokens_per_s"]
    keys = list(zip(df["model"], df["task"], df["seed"], strict=False))
    df["rollout_speedup"] = [
        (row_tps / base.get(k, math.nan)) if base.get(k, math.nan) else math.nan
        for row_tps, k in zip(df["rollout_tokens_per_s"], keys, strict=False)
    ]
    return df


def _aggregate(df: pd.DataFrame, keys: list[str], value_cols: list[str]) -> pd.DataFrame:
    g = df.groupby(keys, sort=False, dropna=False)
    out = g[value_cols].mean(numeric_only=True)
    out["n_seeds"] = g.size()
    for c in ("acc_bf16", "acc_fp4"):
        if c in value_cols:
            out[f"{c}_std"] = g[c].std(ddof=1) if g.size().max() > 1 else math.nan
    return out.reset_index()


def _order(df: pd.DataFrame, arm_order: list[str]) -> pd.DataFrame:
    rank = {a: i for i, a in enumerate(arm_order)}
    df = df.copy()
    df["_r"] = [rank.get(a, len(rank)) for a in df["arm"]]
    df = df.sort_values(["model", "task", "_r", "arm"], kind="stable").drop(columns="_r")
    return df.reset_index(drop=True)


def main_table(df: pd.DataFrame) -> pd.DataFrame:
    cols = [c for c, _ in MAIN_COLUMNS]
    main = df[~df["ablation"].astype(bool)]
    post = main[main["arm"] == "bf16"].copy()
    post["arm"] = POSTHOC
    post["method"] = POSTHOC
    t = _aggregate(pd.concat([main, post], ignore_index=True), ["model", "task", "arm"], cols)
    return _order(t, ARM_ORDER)


def ablation_table(df: pd.DataFrame) -> pd.DataFrame:
    cols = [c for c, _ in ABLATION_COLUMNS]
    groups = df[df["ablation"].astype(bool)][["model", "task"]].drop_duplicates()
    if groups.empty:
        return pd.DataFrame(columns=["model", "task", "arm", *FACTOR_COLUMNS, *cols, "n_seeds"])
    sel = df.merge(groups, on=["model", "task"])
    sel = sel[sel["method"].str.startswith("trace") | (sel["method"] == "qat-independent")]
    t = _aggregate(sel, ["model", "task", "arm", *FACTOR_COLUMNS], cols)
    order = ["qat-independent", "trace"] + sorted(a for a in t["arm"].unique() if a not in ("qat-independent", "trace"))
    return _order(t, order)


# ---------------------------------------------------------------------------------------------
def _fmt(v, col: str) -> str:
    if isinstance(v, (bool, np.bool_)):
        return "on" if v else "off"
    if isinstance(v, str):
        return v
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "default" if col == "rho" else "n/a"
    if col.startswith("acc"):
        return f"{v:.3f}"
    if col in ("k3_mean", "k3_final", "code_flip_rate", "unrecoverable_rate", "dlp_abs_max"):
        return f"{v:.2e}" if abs(v) < 1e-2 and v != 0 else f"{v:.3f}"
    if col == "rollout_speedup":
        return f"{v:.2f}x"
    if col == "rollout_tokens_per_s":
        return f"{v:.0f}"
    if col == "guidance_bytes_per_token":
        return f"{v:.0f}" if abs(v) >= 10 or v == 0 else f"{v:.2f}"
    if col in ("rho",):
        return f"{v:g}"
    if col == "n_seeds":
        return f"{int(v)}"
    return f"{v:.4g}"


def to_markdown(t: pd.DataFrame, columns: list[tuple[str, str]], lead: list[str], title: str, notes: str) -> str:
    heads = [h.replace("_", " ") for h in lead] + [h for _, h in columns] + ["seeds"]
    lines = [f"### {title}", "", "| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for _, row in t.iterrows():
        cells = [_fmt(row[c], c) for c in lead]
        for c, _ in columns:
            s = _fmt(row[c], c)
            std = row.get(f"{c}_std")
            if isinstance(std, float) and math.isfinite(std):
                s += f" ± {std:.3f}"
            cells.append(s)
        cells.append(_fmt(row["n_seeds"], "n_seeds"))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", notes, ""]
    return "\n".join(lines)


MAIN_NOTES = (
    "Accuracy: final evaluation on the held-out test split (fraction of correct samples, sampled as set in "
    "the run config's eval block), policy deployed in BF16 or quantized to FP4 (W4A4 + FP4 KV). k3 = mean(r - 1 - log r), r = exp(lp_train - lp_rollout) over "
    "sampled tokens; *mean* over all RL steps, *final* over the last 10% of steps. Guidance B/token: "
    "bytes of rollout records per token (0 without guidance). Rollout tok/s: median over steps on the "
    "profile's device; speedup relative to the bf16 arm of the same model/task/seed. posthoc-fp4: the "
    "bf16 arm's policy quantized to FP4 after training (training columns repeat the bf16 run)."
)
ABLATION_NOTES = (
    "TRACE variants: rho = fraction of the deepest layers guided; guidance = compact (mantissa bit + block "
    "scales) or full 4-bit codes; align loss and routing replay on/off. qat-independent = FP4 trainer "
    "with its own rounding, no guidance. Code flip rate: fraction of FP4 codes that differ between "
    "trainer and rollout, mean over layers and steps; unrecoverable: guided elements more than one grid "
    "step away (n/a when the trainer does not log it)."
)


def check(t: pd.DataFrame, required: list[str], what: str) -> list[str]:
    errs = []
    for _, row in t.iterrows():
        bad = [c for c in required if not (isinstance(row[c], (int, float)) and math.isfinite(row[c]))]
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
    df.to_csv(os.path.join(out, "runs.csv"), index=False, float_format="%.6g")
    main.to_csv(os.path.join(out, "main.csv"), index=False, float_format="%.6g")
    abl.to_csv(os.path.join(out, "ablation.csv"), index=False, float_format="%.6g")
    profile = os.path.basename(os.path.normpath(runs_dir))
    with open(os.path.join(out, "main.md"), "w") as f:
        f.write(to_markdown(main, MAIN_COLUMNS, ["model", "task", "arm"],
                            f"Main table ({profile} profile)", MAIN_NOTES))
    with open(os.path.join(out, "ablation.md"), "w") as f:
        f.write(to_markdown(abl, ABLATION_COLUMNS, ["model", "task", "arm", *FACTOR_COLUMNS],
                            f"Ablations ({profile} profile)", ABLATION_NOTES))
    problems += check(main, REQUIRED_MAIN, "main") + check(abl, REQUIRED_ABLATION, "ablation")
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
