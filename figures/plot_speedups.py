"""Speedup figures: FP4 kernels vs PyTorch BF16 and the FP4 rollout engine vs its BF16 mode (GPU benchmarks),
and, apart, the rollout throughput measured inside the RL runs of a profile.

    python -m figures.plot_speedups --kernels results/kernels --rollout results/rollout \
        --tables results/tables/smoke --out figures/smoke

Inputs: the long tables `<kernels>/kernels.csv` and `<rollout>/rollout.csv` (benchmarks/results_table.py;
appended by benchmarks/bench_kernels.py and bench_rollout.py on a GPU), so this runs without a GPU. Only
rows of the GPU of the newest run are drawn (never a CPU run), each (op, shape, provider) from its newest
run, each ratio against BF16 measured in that same run. Writes ``speedups.png/pdf`` (left: kernels, one
column per operation and provider, one dot per shape and batch size; right: engine tokens/s) and, when
the profile's main table exists, ``rollout_in_runs.png/pdf`` (the RL runs' own rollout speed, on the
machine that ran the profile). A panel whose table is absent says so.
Compared against: 1x (BF16).
"""
from __future__ import annotations

import argparse
import os

import numpy as np
import pandas as pd

from figures import style
from figures.plot_kernels import newest, read_table
from figures.plot_rollout import current_providers
from figures.style import plt

LABEL = {  # tick labels: what is compared, in words
    "fp4-w4a16": "FP4 weights,\nBF16 activations", "fp4-w4a4": "FP4 weights\n+ FP4 activations",
    "fp4kv-triton": "FP4 KV cache", "triton_kernels-mxfp4": "triton_kernels\nMXFP4 weights",
}
OP = {"moe": "MoE layer", "dense": "dense GEMM", "attention": "decode attention"}


def kernel_speedups(df: pd.DataFrame) -> pd.DataFrame:
    """Newest same-run speedup over BF16 of each (op, shape, provider) on the newest run's GPU, from the
    runs of the newest date that measured the operation (older shape sets are not mixed in)."""
    if df.empty:
        return pd.DataFrame()
    df = df[df["op"].isin(list(OP)) & pd.to_numeric(df["ratio_vs_bf16"], errors="coerce").notna()]
    df = df[df["provider"].isin(list(LABEL))]
    if df.empty:
        return df
    df = df[df["gpu"] == df.loc[df["row_"].idxmax(), "gpu"]]
    df = df[df["date"] == df.groupby("op")["date"].transform("max")]  # each operation: its newest day's runs
    return newest(df, ["op", "shape", "provider"])


def rollout_speedups(df: pd.DataFrame) -> pd.DataFrame:
    """Newest tokens/s of each (shape, batch, gen, provider) on the newest run's GPU, engine providers only,
    and of those only the providers the newest run measured (modes since removed are not drawn)."""
    if df.empty:
        return pd.DataFrame()
    df = df[(df["op"] == "rollout_generate") & (df["gpu"].astype(str) != "cpu")]
    df = df[df["provider"].astype(str).str.startswith("engine-") & (df["provider"] != "engine-bf16-eager")]
    df = df[pd.to_numeric(df["tokens_per_s"], errors="coerce") > 0]
    if df.empty:
        return df
    df = df[df["gpu"] == df.loc[df["row_"].idxmax(), "gpu"]]
    return newest(current_providers(df), ["shape", "batch", "gen", "provider"])


def plot_speedups(kernels_dir: str | None, rollout_dir: str | None, tables_dir: str | None, out: str) -> list[str]:
    style.setup()
    k = kernel_speedups(read_table(os.path.join(kernels_dir, "kernels.csv") if kernels_dir else None))
    r = rollout_speedups(read_table(os.path.join(rollout_dir, "rollout.csv") if rollout_dir else None))
    fig, axes = plt.subplots(1, 2, figsize=(14, 5), squeeze=False, gridspec_kw={"width_ratios": [1.5, 1]})
    ax = axes[0, 0]
    if k.empty:
        ax.axis("off")
        ax.text(0.5, 0.5, f"no kernel benchmark rows in {kernels_dir}/kernels.csv\n"
                "(run benchmarks/bench_kernels.py on a GPU)", ha="center", va="center", transform=ax.transAxes)
    else:
        cats = [(o, p) for o in OP for p in LABEL if ((k["op"] == o) & (k["provider"] == p)).any()]
        rng = np.random.default_rng(0)
        for i, (op, prov) in enumerate(cats):
            v = k[(k["op"] == op) & (k["provider"] == prov)]["ratio_vs_bf16"].astype(float).to_numpy()
            ax.bar(i, np.median(v), 0.7, color="tab:orange" if "triton_kernels" in prov else "tab:blue", alpha=0.35)
            ax.scatter(i + rng.uniform(-0.25, 0.25, v.size), v, s=10, color="black", zorder=3)
            ax.text(i, float(np.max(v)) + 0.05, f"{np.median(v):.2f}x", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(cats)))
        ax.set_xticklabels([f"{OP[o]}:\n{LABEL[p]}" for o, p in cats], fontsize=7)
        ax.axhline(1.0, color="black", linewidth=1, label="PyTorch BF16 (1x)")
        ax.legend(fontsize=7, loc="upper right")
        runs = ", ".join(sorted(set(map(str, k["version"]))))
        ax.set_ylabel("speedup over PyTorch BF16 in the same run (x)")
        ax.set_title(f"Kernels on {k['gpu'].iloc[0]} (versions {runs}); dots: layer shapes and batch sizes, "
                     "bar: median", fontsize=9)
    ax = axes[0, 1]
    if r.empty:
        ax.axis("off")
        ax.text(0.5, 0.5, f"no GPU rollout rows in {rollout_dir}/rollout.csv\n(run benchmarks/bench_rollout.py on a GPU)",
                ha="center", va="center", transform=ax.transAxes)
    else:
        configs = list(dict.fromkeys(zip(r["shape"], r["batch"], r["gen"], strict=True)))
        provs = sorted(dict.fromkeys(r["provider"]), key=lambda p: (p != "engine-bf16", p))
        w = 0.8 / max(1, len(provs))
        for i, p in enumerate(provs):
            sub = r[r["provider"] == p].set_index(["shape", "batch", "gen"])["tokens_per_s"].astype(float)
            ax.bar(np.arange(len(configs)) + (i - (len(provs) - 1) / 2) * w, [sub.get(c, np.nan) for c in configs], w,
                   label=p)
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels([f"{s}\nbatch {b}, {n} new" for s, b, n in configs], rotation=35, ha="right", fontsize=6)
        ax.set_yscale("log")
        ax.set_ylabel("generated tokens / s (log scale)")
        ax.set_title(f"Rollout engine on {r['gpu'].iloc[0]}: FP4 modes vs its BF16 mode", fontsize=9)
        ax.legend(fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.06), ncol=2, frameon=False)
    fig.tight_layout()
    paths = style.save(fig, out, "speedups")
    return paths + plot_run_throughput(tables_dir, out)


def plot_run_throughput(tables_dir: str | None, out: str) -> list[str]:
    """Rollout tokens/s inside this profile's RL runs relative to its bf16 arm (the machine that ran the
    profile: CPU emulation in the smoke profile), kept apart from the GPU benchmarks above."""
    path = os.path.join(tables_dir, "main.csv") if tables_dir else ""
    main = pd.read_csv(path) if path and os.path.exists(path) else pd.DataFrame()
    if main.empty or "rollout_speedup" not in main.columns:
        return []
    style.setup()
    m = main[main["arm"] != "posthoc-fp4"]
    groups = list(m.groupby(["model", "task"], sort=True))
    arms = list(dict.fromkeys(m["arm"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    w = 0.8 / max(1, len(groups))
    for i, ((model, task), g) in enumerate(groups):
        g = g.set_index("arm")
        ax.bar(np.arange(len(arms)) + (i - (len(groups) - 1) / 2) * w, [float(g["rollout_speedup"].get(a, np.nan)) for a in arms],
               w, label=f"{model}/{task}")
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_xticks(range(len(arms)))
    ax.set_xticklabels(arms, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("rollout tokens/s relative to the bf16 arm (x)")
    ax.set_title("Rollout throughput inside this profile's RL runs\n(on the machine that ran them; not the GPU benchmark)",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return style.save(fig, out, "rollout_in_runs")


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
