"""Rollout-engine throughput figure from the committed benchmark CSVs (no GPU needed).

    python -m figures.plot_rollout --rollout results/rollout --out figures/smoke

Input: the long table `<rollout>/rollout.csv` that benchmarks/bench_rollout.py appends to (rows
`rollout_generate`: tokens_per_s per shape, batch, generated tokens and provider; rows
`rollout_breakdown`: ms per decoded token by component). Only GPU rows are drawn; for a repeated
measurement the newest row wins.

Left panel: generated tokens/s (prefill included, log scale) of every provider for each configuration;
above each group, the two ratios DESIGN.md §6 sets targets for: engine BF16 over
transformers `generate` (target >= 5x) and the best FP4 W4A4 + FP4 KV engine mode over the engine's
BF16 (target >= 1.5x). Right panel: GPU kernel time of one decode step (ms = ms per token x batch) in
attention / MoE / sampling / other per engine provider, from the profiler's eager breakdown rows; the wall-clock
decode step of the CUDA-graph run is drawn as a solid tick and, where measured, the device-busy time of that
CUDA-graph decode (`graph-busy`) as a dashed one, so the gap between the two ticks is the GPU waiting for the host.
Writes ``rollout.png/pdf``.
"""
from __future__ import annotations

import argparse
import os

import numpy as np
import pandas as pd

from figures import style
from figures.plot_kernels import newest, read_table
from figures.style import plt

COMPONENTS = ("attention", "moe", "sampling", "other")


def read_rollout(d: str | None) -> pd.DataFrame:
    df = read_table(os.path.join(d, "rollout.csv") if d else None)
    if df.empty:
        return df
    df = df[df["gpu"].astype(str) != "cpu"].copy()
    df["note"] = df["note"].fillna("").astype(str)
    df["source"] = df["version"].astype(str) + "@" + df["commit"].astype(str)  # the run a row came from
    return newest(df, ["op", "shape", "provider", "batch", "prompt", "gen", "note"])


def current_providers(df: pd.DataFrame, keep: tuple[str, ...] = ()) -> pd.DataFrame:
    """The rows of the providers the newest run (version@commit of the last appended row) measured, plus
    `keep`: modes an older run measured and the benchmark no longer has are not drawn."""
    if df.empty:
        return df
    last = df.loc[df["row_"].idxmax()]
    run = (df["version"].astype(str) == str(last["version"])) & (df["commit"].astype(str) == str(last["commit"]))
    provs = set(df.loc[run, "provider"]) | set(keep)
    return df[df["provider"].isin(provs)]


def ratios(gen: pd.DataFrame) -> pd.DataFrame:
    """Per configuration: engine BF16 / HF generate and best FP4 (W4A4 + KV4) / engine BF16."""
    out = []
    for (shape, batch, n), g in gen.groupby(["shape", "batch", "gen"], sort=False):
        tps = g.set_index("provider")["tokens_per_s"].astype(float)
        bf16, hf = tps.get("engine-bf16", np.nan), tps.get("hf-bf16", np.nan)
        kv4 = tps[[p for p in tps.index if "w4a4-kv4" in p]]
        out.append(dict(shape=shape, batch=batch, gen=n, engine_vs_hf=bf16 / hf,
                        fp4kv4_vs_bf16=(kv4.max() / bf16) if len(kv4) else np.nan))
    return pd.DataFrame(out)


def plot_rollout(rollout_dir: str | None, out: str) -> list[str]:
    style.setup()
    df = read_rollout(rollout_dir)
    fig, axes = plt.subplots(2, 1, figsize=(11, 10.5), squeeze=False)
    axes = axes.reshape(1, 2)  # [0, 0]: throughput (top), [0, 1]: decode-step breakdown (below)
    if df.empty:
        for ax in axes[0]:
            ax.axis("off")
        axes[0, 0].text(0.5, 0.5, f"no rollout benchmark CSV in {rollout_dir}/\n(run benchmarks/bench_rollout.py on a GPU)",
                        ha="center", va="center", transform=axes[0, 0].transAxes)
    else:
        gen = df[df["op"] == "rollout_generate"].copy()
        gen = gen[pd.to_numeric(gen["tokens_per_s"], errors="coerce") > 0]
        # one bar per provider and configuration: the newest, whatever its note (an A/B row's note names its variant)
        gen = newest(current_providers(gen, keep=("hf-bf16",)), ["shape", "batch", "gen", "provider"])
        configs = list(dict.fromkeys(zip(gen["shape"], gen["batch"], gen["gen"], strict=True)))
        provs = list(dict.fromkeys(gen["provider"]))
        ax, w = axes[0, 0], 0.8 / max(1, len(provs))
        for i, p in enumerate(provs):
            sub = gen[gen["provider"] == p].set_index(["shape", "batch", "gen"])["tokens_per_s"].astype(float)
            vals = [sub.get(c, np.nan) for c in configs]
            ax.bar(np.arange(len(configs)) + (i - (len(provs) - 1) / 2) * w, vals, w, label=p,
                   color=plt.cm.tab10(i % 10))
        r = ratios(gen).set_index(["shape", "batch", "gen"])
        top = gen.groupby(["shape", "batch", "gen"])["tokens_per_s"].max()
        for j, c in enumerate(configs):
            lines = []
            if np.isfinite(r.loc[c, "engine_vs_hf"]):
                lines.append(f"BF16 eng/HF {r.loc[c, 'engine_vs_hf']:.1f}x")
            if np.isfinite(r.loc[c, "fp4kv4_vs_bf16"]):
                lines.append(f"FP4+KV4/BF16 {r.loc[c, 'fp4kv4_vs_bf16']:.2f}x")
            ax.text(j, float(top[c]) * 1.15, "\n".join(lines), ha="center", va="bottom", fontsize=7)
        ax.set_yscale("log")
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels([f"{s}\nbatch {b}, {n} gen" for s, b, n in configs], fontsize=7, rotation=20, ha="right")
        ax.set_ylabel("generated tokens / s (prefill included)")
        gpu = ", ".join(sorted(set(map(str, gen["gpu"])))) if "gpu" in gen.columns else "GPU"
        layers = sorted(set(map(str, gen["layers"]))) if "layers" in gen.columns else []
        ax.set_title(f"Rollout throughput ({gpu}; {', '.join(layers)} layers; targets: BF16 engine >= 5x HF, "
                     "FP4+KV4 >= 1.5x BF16 engine at batch 256)", fontsize=9)
        tps = gen["tokens_per_s"].astype(float)
        ax.set_ylim(float(tps.min()) * 0.5, float(tps.max()) * 40)  # room for the ratios and the legend on top
        ax.legend(fontsize=7, ncol=4, loc="upper right")

        ax = axes[0, 1]
        br = current_providers(df[df["op"] == "rollout_breakdown"].copy())
        if br.empty:
            ax.axis("off")
            ax.text(0.5, 0.5, "no breakdown rows (bench_rollout.py --breakdown)", ha="center", va="center",
                    transform=ax.transAxes)
        else:
            br["component"] = br["note"].str.replace("component=", "", regex=False)
            br["ms_step"] = br["ms_per_step"].astype(float) * br["batch"].astype(float)
            # a breakdown is keyed by everything that identifies it, its profiled context (`prompt`) included;
            # the generate row it was measured with has the same source and a mean context prompt + gen/2
            key_cols = ["shape", "batch", "provider", "prompt"]
            br["bar"] = list(br[key_cols].itertuples(index=False, name=None))
            bars = list(dict.fromkeys(br["bar"]))
            src = dict(zip(br["bar"], br["source"], strict=True))
            rows = {bar: br[[b == bar for b in br["bar"]]] for bar in bars}  # each bar's rows, selected once
            bottom = np.zeros(len(bars))
            for k, comp in enumerate(COMPONENTS):
                v = np.array([rows[bar][rows[bar]["component"] == comp]["ms_step"].sum()
                              for bar in bars])
                ax.bar(range(len(bars)), v, 0.7, bottom=bottom, label=comp, color=plt.cm.Set2(k))
                bottom += v
            wall = {}
            if "decode_ms_per_step" in gen.columns:
                for row in gen.itertuples(index=False):
                    ctx = int(row.prompt) + int(row.gen) // 2
                    wall[(row.source, row.shape, row.batch, row.provider, ctx)] = float(row.decode_ms_per_step)
            wall_labelled = busy_labelled = False
            for j, bar in enumerate(bars):
                s, b, p, ctx = bar
                w = wall.get((src[bar], s, b, p, int(ctx)), np.nan)
                if np.isfinite(w):
                    ax.plot([j - 0.35, j + 0.35], [w] * 2, color="black", linewidth=2,
                            label="decode step, wall (graphs)" if not wall_labelled else None)
                    wall_labelled = True
                gb = rows[bar][rows[bar]["component"] == "graph-busy"]["ms_step"]
                if len(gb):
                    ax.plot([j - 0.35, j + 0.35], [float(gb.iloc[-1])] * 2, color="black", linewidth=1.5,
                            linestyle="--", label="device busy (graphs)" if not busy_labelled else None)
                    busy_labelled = True
            ax.set_xticks(range(len(bars)))
            ax.set_xticklabels([f"{p}\n{s} b{b} ctx {c}" for s, b, p, c in bars], fontsize=6, rotation=30, ha="right")
            ax.set_ylabel("ms per decode step")
            ax.set_title("Decode step: kernel time by component (eager profile) vs wall", fontsize=9)
            ax.legend(fontsize=7)
    fig.tight_layout()
    return style.save(fig, out, "rollout")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollout", default="results/rollout")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    for p in plot_rollout(a.rollout, a.out):
        print("wrote", p)


if __name__ == "__main__":
    main()
