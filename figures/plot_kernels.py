"""Kernel benchmark figures from the long table results/kernels/kernels.csv (benchmarks/bench_kernels.py,
GPU runs appended over versions). No GPU needed.

    python -m figures.plot_kernels [--csv results/kernels/kernels.csv] [--out figures/gpu]

Writes into --out only (PNG + PDF each): `kernels_moe` and `kernels_dense` (same-run speedup over PyTorch BF16 vs
tokens / rows, one panel per layer shape), `kernels_attention` (same, vs context length) and `kernels_bandwidth`
(% of the run's copy bandwidth). Drawn: the library's defaults (HEADLINE) and the anchor `triton_kernels`, each as
the newest version that measured a shape (a line) and older runs' other sizes (rings), and the first version of ours
dashed; the study rows (tile variants, sweeps, deleted kernels) stay in the table only. A measurement repeated in one
version keeps its last row. Also home of `read_table` and `newest`, which figures.plot_speedups and
figures.plot_rollout use.
Compared against: 1x (BF16) and the issue targets drawn as dotted lines.
"""
from __future__ import annotations

import argparse
import os
import re

import numpy as np
import pandas as pd

from figures import style
from figures.style import plt

HEADLINE = ("fp4-w4a16", "fp4-w4a4", "fp4kv-mma", "fp4kv-triton")  # what the library runs by default (attention: both)
ANCHOR = "triton_kernels-mxfp4"
TARGET = {"moe": 3.0, "dense": 2.0, "attention": 1.5}  # same-run x over BF16 (MoE T>=16, dense M<=16, 64x8k)


def read_table(path: str | None) -> pd.DataFrame:
    """A long results table (empty frame when absent); row order = append order."""
    if not path or not os.path.exists(path):
        return pd.DataFrame()
    df = pd.read_csv(path, keep_default_na=False, na_values=[""], dtype={"version": str, "commit": str})
    df["row_"] = np.arange(len(df))
    return df


def newest(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """The last appended row of each key (a later run replaces an earlier one's measurement)."""
    return df.sort_values("row_").drop_duplicates(subset=[k for k in keys if k in df.columns], keep="last")


def _num(shape: str, key: str):
    m = re.search(rf"\b{key}(\d+)", str(shape))
    return int(m.group(1)) if m else None


def _versions(vs) -> str:
    u = sorted(set(map(str, vs)), key=lambda v: (len(v), v))
    return u[0] if len(u) == 1 else f"{u[0]}..{u[-1]}"


def plot_ratio(df: pd.DataFrame, op: str, group_of, x_of, xlabel: str, title: str, out: str) -> list[str]:
    d = df[(df["op"] == op) & pd.to_numeric(df["ratio_vs_bf16"], errors="coerce").notna()].copy()
    d = d[d["provider"].isin(HEADLINE + (ANCHOR,))]
    if d.empty:
        return []
    d["group"], d["x"] = d["shape"].map(group_of), d["shape"].map(x_of)
    now = newest(d, ["group", "x", "provider"])  # each point's newest same-run ratio
    first = d[d["provider"].isin(HEADLINE)]
    first = first[first["version"] == first.groupby("provider")["version"].transform("first")]
    first = newest(first, ["group", "x", "provider"])
    groups = sorted(d["group"].unique())
    fig, axes = plt.subplots(1, len(groups), figsize=(4.4 * len(groups), 3.9), squeeze=False)
    for ax, g in zip(axes[0], groups, strict=True):
        for i, prov in enumerate(HEADLINE + (ANCHOR,)):
            color = "tab:orange" if prov == ANCHOR else f"C{[0, 2, 4, 5][i % 4]}"
            pts = now[(now["group"] == g) & (now["provider"] == prov)].sort_values("x")
            if len(pts):  # the newest version that measured this shape as a line, older runs' other sizes as rings
                last = pts["version"].loc[pts["row_"].idxmax()]
                cur, rest = pts[pts["version"] == last], pts[pts["version"] != last]
                ax.plot(cur["x"], cur["ratio_vs_bf16"].astype(float), marker="o", ms=3, color=color,
                        label=f"{prov} ({last})")
                if len(rest):
                    ax.plot(rest["x"], rest["ratio_vs_bf16"].astype(float), ls="none", marker="o", ms=4, mfc="none",
                            color=color, label=f"{prov} (other sizes: {_versions(rest['version'])})")
            old = first[(first["group"] == g) & (first["provider"] == prov)].sort_values("x")
            if len(old) and prov != ANCHOR and set(old["version"]) != set(pts["version"]):
                ax.plot(old["x"], old["ratio_vs_bf16"].astype(float), marker=".", ms=2, color=color, ls="--",
                        alpha=0.5, label=f"{prov} ({old['version'].iloc[0]}, first)")
        ax.axhline(1.0, color="black", lw=1)
        if op in TARGET:
            ax.axhline(TARGET[op], color="gray", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("speedup over BF16, same run (x)")
        ax.set_title(g, fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=6)
    gpus = ", ".join(sorted(set(map(str, d["gpu"]))))
    fig.suptitle(f"{title} ({gpus}; dotted: target; dashed: first version; rings: sizes the newest run left out)",
                 fontsize=10)
    fig.tight_layout()
    return style.save(fig, *os.path.split(out))


def plot_bandwidth(df: pd.DataFrame, out: str) -> list[str]:
    keep = HEADLINE + (ANCHOR, "triton-nvfp4", "triton-mxfp4", "bf16-grouped_mm", "bf16-cublas", "bf16-sdpa")
    d = df[df["op"].isin(["quantize", "dense", "moe", "attention"]) & pd.to_numeric(df["pct_copy_bw"], errors="coerce").notna()]
    d = d[d["provider"].isin(keep)]
    if d.empty:
        return []
    d = newest(d, ["op", "shape", "provider"])
    fig, ax = plt.subplots(figsize=(8, max(4, 0.14 * len(d))))
    colors = ["tab:orange" if p == ANCHOR else ("tab:gray" if str(p).startswith("bf16") else "tab:blue")
              for p in d["provider"]]
    ax.barh(range(len(d)), d["pct_copy_bw"].astype(float), color=colors)
    ax.set_yticks(range(len(d)))
    ax.set_yticklabels([f"{o} {s} {p} ({v})" for o, s, p, v in zip(d["op"], d["shape"], d["provider"], d["version"],
                                                                        strict=True)], fontsize=5)
    ax.invert_yaxis()
    ax.axvline(100, color="k", ls="--", lw=1)
    ax.axvline(75, color="r", ls=":", lw=1, label="75% (quantize target)")
    ax.set_xlabel("% of the run's copy bandwidth over the minimal bytes (blue: ours, orange: triton_kernels, grey: BF16)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return style.save(fig, *os.path.split(out))


def plot_kernels(csv: str, out: str) -> list[str]:
    style.setup()
    df = read_table(csv)
    if df.empty:
        print(f"no kernel table at {csv}")
        return []
    os.makedirs(out, exist_ok=True)
    made = [
        plot_ratio(df, "moe", lambda s: s.split()[0], lambda s: _num(s, "T"), "tokens T",
                   "Grouped MoE expert MLP vs torch._grouped_mm BF16", os.path.join(out, "kernels_moe")),
        plot_ratio(df, "dense", lambda s: f"N{_num(s, 'N')} K{_num(s, 'K')}", lambda s: _num(s, "M"), "rows M (decode batch)",
                   "Dense FP4 GEMM vs cuBLAS BF16", os.path.join(out, "kernels_dense")),
        plot_ratio(df, "attention", lambda s: f"batch {_num(s, 'B')}, GQA {_num(s, 'Hq')}/{_num(s, 'Hkv')}, d{_num(s, 'D')}",
                   lambda s: _num(s, "L"), "context length",
                   "Decode attention: FP4 KV vs BF16 SDPA", os.path.join(out, "kernels_attention")),
        plot_bandwidth(df, os.path.join(out, "kernels_bandwidth")),
    ]
    return [p for m in made for p in m]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", default="results/kernels/kernels.csv")
    ap.add_argument("--out", default="figures/gpu")
    a = ap.parse_args(argv)
    for p in plot_kernels(a.csv, a.out):
        print("wrote", p)


if __name__ == "__main__":
    main()
