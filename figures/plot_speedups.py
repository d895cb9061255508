"""Speedup figure: FP4 kernels vs PyTorch BF16, FP4 rollout engine vs its BF16 mode, and the rollout
throughput measured inside the RL runs of a profile.

    python -m figures.plot_speedups --kernels results/kernels --rollout results/rollout \
        --tables results/tables/smoke --out figures/smoke

Inputs are the committed long-format benchmark CSVs (kernels: op, shape, provider, median_ms, p20_ms,
p80_ms, tb_per_s, speedup_vs_bf16, gpu, commit; rollout: ..., provider, tokens_per_s, ...), written on
a GPU by benchmarks/bench_kernels.py and benchmarks/bench_rollout.py, so this runs without a GPU.
Every CSV of a folder is read (quick runs and SASS counts excepted); for the same (op, shape, provider,
config) the file that sorts last wins, so a newer benchmark run replaces an older one.
A panel whose CSVs are absent says so instead of showing anything. Writes ``speedups.png/pdf``.
Compared against: DESIGN.md section 6 targets (>= 4x grouped MoE GEMM, >= 3x dense GEMM and FP4-KV
attention, >= 3x rollout tokens/s) drawn as reference lines, and 1x (BF16).
"""
from __future__ import annotations

import argparse
import glob
import os

import numpy as np
import pandas as pd

from figures import style
from figures.style import plt

TARGETS = {"moe": 4.0, "grouped": 4.0, "dense": 3.0, "gemm": 3.0, "attention": 3.0, "attn": 3.0}


def read_csvs(d: str | None) -> pd.DataFrame:
    if not d or not os.path.isdir(d):
        return pd.DataFrame()
    frames = []
    # every full benchmark run in the folder; quick runs and offline SASS counts are not comparisons
    paths = [p for p in sorted(glob.glob(os.path.join(d, "*.csv")))
             if not any(t in os.path.basename(p) for t in ("quick", "sass"))]
    for p in paths:
        try:
            f = pd.read_csv(p)
        except Exception as e:  # a malformed CSV should not kill every figure
            print(f"warning: cannot read {p}: {e}")
            continue
        f["source"] = os.path.basename(p)
        frames.append(f)
    if not frames:
        return pd.DataFrame()
    df = pd.concat(frames, ignore_index=True)
    # a later run (file names sort by version: kernels.csv < kernels_v1.csv < kernels_v1b.csv)
    # replaces an earlier one's row for the same measurement; each row keeps its same-run speedup
    key = [c for c in ("op", "shape", "provider", "config", "batch", "gen", "note") if c in df.columns]
    return df.drop_duplicates(subset=key, keep="last") if key else df


def _is_bf16(provider) -> bool:
    p = str(provider).lower()
    return "bf16" in p or "torch" in p or "cublas" in p or "sdpa" in p


def kernel_speedups(df: pd.DataFrame) -> pd.DataFrame:
    """Rows (op, shape, provider, speedup) for the non-BF16 providers."""
    if df.empty or not {"op", "shape", "provider"} <= set(df.columns):
        return pd.DataFrame()
    df = df.copy()
    if "speedup_vs_bf16" not in df.columns and "median_ms" in df.columns:
        base = df[df["provider"].map(_is_bf16)].groupby(["op", "shape"])["median_ms"].min()
        df["speedup_vs_bf16"] = [base.get((o, s), np.nan) / m for o, s, m in zip(df["op"], df["shape"], df["median_ms"], strict=False)]
    df = df[~df["provider"].map(_is_bf16)]
    df = df[np.isfinite(pd.to_numeric(df["speedup_vs_bf16"], errors="coerce"))]
    return df[["op", "shape", "provider", "speedup_vs_bf16"] + (["gpu"] if "gpu" in df.columns else [])]


def rollout_speedups(df: pd.DataFrame) -> pd.DataFrame:
    """Rows (config, provider, tokens_per_s, speedup vs the BF16 provider of the same config)."""
    if df.empty or "tokens_per_s" not in df.columns:
        return pd.DataFrame()
    if "op" in df.columns:  # throughput rows only (not the breakdown rows of the same CSV)
        df = df[df["op"] == "rollout_generate"]
    if "provider" in df.columns:  # HF generate and the eager engine are reference points, not the baseline
        df = df[~df["provider"].astype(str).isin(["hf-bf16", "engine-bf16-eager"])]
    prov = next((c for c in ("provider", "mode", "fmt", "kv") if c in df.columns), None)
    cfg_cols = [c for c in ("shape", "model", "batch", "batch_size", "gen", "context") if c in df.columns]
    df = df.copy()
    df["provider_"] = df[prov].astype(str) if prov else "fp4"
    df["config_"] = df[cfg_cols].astype(str).agg(" ".join, axis=1) if cfg_cols else "engine"
    if "speedup_vs_bf16" not in df.columns:
        base = df[df["provider_"].map(_is_bf16)].groupby("config_")["tokens_per_s"].max()
        df["speedup_vs_bf16"] = [t / base.get(c, np.nan) for c, t in zip(df["config_"], df["tokens_per_s"], strict=False)]
    return df


def plot_speedups(kernels_dir: str | None, rollout_dir: str | None, tables_dir: str | None, out: str) -> list[str]:
    style.setup()
    k = kernel_speedups(read_csvs(kernels_dir))
    r = rollout_speedups(read_csvs(rollout_dir))
    main = pd.DataFrame()
    if tables_dir and os.path.exists(os.path.join(tables_dir, "main.csv")):
        main = pd.read_csv(os.path.join(tables_dir, "main.csv"))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), squeeze=False,
                             gridspec_kw={"width_ratios": [1.5, 1, 1]})
    ax = axes[0, 0]
    if k.empty:
        ax.axis("off")
        ax.text(0.5, 0.5, f"no kernel benchmark CSV in {kernels_dir}/\n(run benchmarks/bench_kernels.py on a GPU)",
                ha="center", va="center", transform=ax.transAxes)
    else:
        # one column per (op, provider); one point per layer shape; bar = median over shapes
        k = k[~k["op"].astype(str).str.endswith("-sweep")]  # tile-config sweeps: not a comparison
        cats = sorted(set(zip(k["op"], k["provider"], strict=False)))
        rng = np.random.default_rng(0)
        for i, (op, prov) in enumerate(cats):
            v = k[(k["op"] == op) & (k["provider"] == prov)]["speedup_vs_bf16"].astype(float).to_numpy()
            ax.bar(i, np.median(v), 0.7, color=plt.cm.tab10(sum(map(ord, str(op))) % 10), alpha=0.35)
            ax.scatter(i + rng.uniform(-0.25, 0.25, v.size), v, s=10, color="black", zorder=3)
            ax.text(i, float(np.max(v)) + 0.05, f"median {np.median(v):.2f}x", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(cats)))
        ax.set_xticklabels([f"{o}\n{p}" for o, p in cats], fontsize=7, rotation=20, ha="right")
        ax.axhline(1.0, color="black", linewidth=1, label="BF16 (1x)")
        ax.axhline(3.0, color="gray", linestyle=":", linewidth=1, label="3x target (dense, attention)")
        ax.axhline(4.0, color="gray", linestyle="--", linewidth=1, label="4x target (grouped MoE)")
        ax.legend(fontsize=7, loc="upper right")
        gpu = ", ".join(sorted(set(map(str, k["gpu"])))) if "gpu" in k.columns else "GPU"
        ax.set_ylabel("speedup over PyTorch BF16 (x, median time)")
        ax.set_title(f"FP4 Triton kernels vs BF16 ({gpu}); dots: layer shapes, bar: median")
    ax = axes[0, 1]
    if r.empty:
        ax.axis("off")
        ax.text(0.5, 0.5, f"no rollout benchmark CSV in {rollout_dir}/\n(run benchmarks/bench_rollout.py on a GPU)",
                ha="center", va="center", transform=ax.transAxes)
    else:
        configs = list(dict.fromkeys(r["config_"]))
        provs = list(dict.fromkeys(r["provider_"]))
        w = 0.8 / max(1, len(provs))
        for i, p in enumerate(provs):
            sub = r[r["provider_"] == p].set_index("config_")
            vals = [float(sub["tokens_per_s"].get(c, np.nan)) if c in sub.index else np.nan for c in configs]
            ax.bar(np.arange(len(configs)) + (i - (len(provs) - 1) / 2) * w, vals, w, label=p)
        for j, c in enumerate(configs):
            best = r[(r["config_"] == c) & ~r["provider_"].map(_is_bf16)]["speedup_vs_bf16"]
            if best.notna().any():
                ax.text(j, float(r[r["config_"] == c]["tokens_per_s"].max()), f"{best.max():.2f}x",
                        ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels(configs, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("decode throughput (tokens/s)")
        ax.set_title("Rollout engine: FP4 vs BF16 (label: speedup)")
        ax.legend(fontsize=7)
    ax = axes[0, 2]
    if main.empty or "rollout_speedup" not in main.columns:
        ax.axis("off")
        ax.text(0.5, 0.5, "no main table", ha="center", va="center", transform=ax.transAxes)
    else:
        m = main[main["arm"] != "posthoc-fp4"]
        groups = list(m.groupby(["model", "task"], sort=True))
        arms = list(dict.fromkeys(m["arm"]))
        w = 0.8 / max(1, len(groups))
        for i, ((model, task), g) in enumerate(groups):
            g = g.set_index("arm")
            vals = [float(g["rollout_speedup"].get(a, np.nan)) for a in arms]
            ax.bar(np.arange(len(arms)) + (i - (len(groups) - 1) / 2) * w, vals, w, label=f"{model}/{task}")
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_xticks(range(len(arms)))
        ax.set_xticklabels(arms, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel("rollout tokens/s relative to the bf16 arm (x)")
        ax.set_title("Rollout throughput inside the RL runs\n(this profile's device; CPU emulation in smoke)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return style.save(fig, out, "speedups")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default="results/kernels")
    ap.add_argument("--rollout", default="results/rollout")
    ap.add_argument("--tables")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    for p in plot_speedups(a.kernels, a.rollout, a.tables, a.out):
        print("wrote", p)


if __name__ == "__main__":
    main()
