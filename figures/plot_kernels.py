"""Draw results/kernels/kernels.csv (written by benchmarks/bench_kernels.py on a GPU) into
figures/kernels_*.png: time vs batch for dense GEMM and grouped MoE, time vs context for FP4-KV
attention (FP4 kernels vs PyTorch BF16), and achieved bandwidth. No GPU needed.
Run: `python figures/plot_kernels.py [--csv results/kernels/kernels.csv] [--outdir figures]`."""
from __future__ import annotations

import argparse
import csv
import os
import re
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    with open(path) as f:
        return [r for r in csv.DictReader(f)]


def _num(shape, key):
    m = re.search(rf"{key}(\d+)", shape)
    return int(m.group(1)) if m else None


def plot_series(rows, op, group_of, x_of, xlabel, title, out):
    groups = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r["op"] != op:
            continue
        groups[group_of(r["shape"])][r["provider"]].append((x_of(r["shape"]), float(r["median_ms"]) * 1e3,
                                                            float(r["p20_ms"]) * 1e3, float(r["p80_ms"]) * 1e3))
    if not groups:
        return None
    n = len(groups)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.6), squeeze=False)
    for ax, (g, provs) in zip(axes[0], sorted(groups.items()), strict=False):
        for p, pts in sorted(provs.items()):
            pts.sort()
            xs, med, lo, hi = zip(*pts, strict=False)
            ax.errorbar(xs, med, yerr=[[m - a for m, a in zip(med, lo, strict=False)], [b - m for m, b in zip(med, hi, strict=False)]],
                        marker="o", capsize=2, label=p)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("time per call [us] (median, p20-p80)")
        ax.set_title(g, fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    gpu = rows[0]["gpu"] if rows else ""
    fig.suptitle(f"{title} ({gpu}, commit {rows[0]['commit'] if rows else ''})", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_bandwidth(rows, out):
    rows = [r for r in rows if r["tb_per_s"] and not r["op"].endswith("sweep") and r["op"] != "memcpy"]
    copy = [float(r["tb_per_s"]) for r in load_all if r["op"] == "memcpy"]
    labels = [f"{r['op']} {r['shape']} {r['provider']}" for r in rows]
    vals = [float(r["tb_per_s"]) for r in rows]
    fig, ax = plt.subplots(figsize=(8, max(4, 0.16 * len(rows))))
    colors = ["tab:gray" if ("bf16" in r["provider"] or "torch" in r["provider"]) else "tab:blue" for r in rows]
    ax.barh(range(len(vals)), vals, color=colors)
    ax.set_yticks(range(len(vals)))
    ax.set_yticklabels(labels, fontsize=5)
    ax.invert_yaxis()
    if copy:
        ax.axvline(copy[0], color="k", ls="--", lw=1, label=f"copy bandwidth {copy[0]:.2f} TB/s")
        ax.axvline(0.75 * copy[0], color="r", ls=":", lw=1, label="75% target")
    ax.set_xlabel("achieved bandwidth over minimal bytes [TB/s] (blue: FP4 Triton, grey: BF16/torch)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default="results/kernels/kernels.csv")
    ap.add_argument("--outdir", default="figures")
    ap.add_argument("--v1csv", default="results/kernels/kernels_v1.csv")
    a = ap.parse_args()
    os.makedirs(a.outdir, exist_ok=True)
    load_all = load(a.csv)
    made = [
        plot_series(load_all, "dense", lambda s: f"N{_num(s, 'N')} K{_num(s, 'K')}", lambda s: _num(s, "M"),
                    "rows M (decode batch)", "Dense FP4 GEMM vs cuBLAS BF16", os.path.join(a.outdir, "kernels_dense.png")),
        plot_series(load_all, "moe", lambda s: s.split()[0], lambda s: _num(s, "T"), "tokens T",
                    "Grouped MoE expert MLP: FP4 Triton vs torch._grouped_mm BF16", os.path.join(a.outdir, "kernels_moe.png")),
        plot_series(load_all, "attention", lambda s: "B64 GQA 32/4 d128", lambda s: _num(s, "L"), "context length",
                    "Decode attention: FP4 KV (Triton) vs BF16 SDPA", os.path.join(a.outdir, "kernels_attention.png")),
        plot_bandwidth(load_all, os.path.join(a.outdir, "kernels_bandwidth.png")),
    ]
    if os.path.exists(a.v1csv):  # v1 decode kernels (same-run BF16 baselines) + the v0 FP4 rows of the earlier run
        v1 = load(a.v1csv)
        v0 = [dict(r, provider=r["provider"] + " (v0, earlier run)") for r in load_all
              if r["op"] in ("dense", "moe") and r["provider"] == "fp4-w4a16"
              and any(r["shape"] == q["shape"] for q in v1)]
        made += [
            plot_series(v1 + v0, "dense", lambda s: f"N{_num(s, 'N')} K{_num(s, 'K')}", lambda s: _num(s, "M"),
                        "rows M (decode batch)", "Dense FP4 decode v1 (GEMV layout) vs cuBLAS BF16",
                        os.path.join(a.outdir, "kernels_v1_dense.png")),
            plot_series(v1 + v0, "moe", lambda s: s.split()[0], lambda s: _num(s, "T"), "tokens T",
                        "Grouped MoE decode v1 vs torch._grouped_mm BF16", os.path.join(a.outdir, "kernels_v1_moe.png")),
        ]
    print("\n".join(m for m in made if m))
