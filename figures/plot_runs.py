"""Figures from logged RL runs: training curves, mismatch, per-layer flip rates, accuracy under deployment.

    python -m figures.plot_runs --runs results/runs/smoke --tables results/tables/smoke --out figures/smoke

Writes (PNG + PDF each), one panel per model x task, one line per arm (mean over seeds):
* ``curves_reward``: mean rollout reward vs RL step, and held-out test accuracy at each periodic evaluation
  (``eval_accuracy``, the policy deployed as its arm deploys it); the training accuracy is not drawn:
  with 0/1 rewards it equals the mean reward;
* ``curves_mismatch``: token k3 mismatch between trainer and rollout log-probs vs step (log scale);
* ``flip_rates``: per-layer FP4 code-flip rate (trainer vs rollout, mean over steps) at each layer's
  index (an arm that logs only the guided layers shows only those);
* ``mismatch_vs_bytes``: mean k3 vs guidance bytes per generated token, one point per arm (the cost/benefit of
  guidance: full codes, compact, rho); labels of nearby points are stacked so none overlap;
* ``final_accuracy``: final test accuracy under BF16 and FP4 deployment per arm (from main.csv), with
  error bars of one standard error: over seeds (std/sqrt(n_seeds)) where there are several seeds, else
  the binomial sqrt(p(1-p)/n) over the n evaluation samples in eval.json (the samples of one prompt are
  correlated, so this understates the spread across prompts);
* ``paired_differences``: the paired arm comparisons of compare.csv (analysis/compare.py), one row per
  model/task and comparison: A - B with a bar of 2 standard errors each side, and the line at 0.
Compared against: the paper's figures (TRACE tracks the bf16 curves while naive FP4 drifts; k3 drops
with guided layers; compact guidance near full codes at a fraction of the bytes).
"""
from __future__ import annotations

import argparse
import math
import os
from collections import defaultdict

import numpy as np
import pandas as pd
from matplotlib.text import Text
from matplotlib.transforms import Bbox

from analysis.runs import MAIN_METHODS, load_runs
from figures import style
from figures.style import plt

NAMES = ["curves_reward", "curves_mismatch", "ablation_mismatch", "flip_rates", "mismatch_vs_bytes", "final_accuracy", "paired_differences"]


def _groups(runs):
    """{(model, task): {arm: [runs over seeds]}} with a stable arm order (main arms first)."""
    g: dict = defaultdict(lambda: defaultdict(list))
    for r in runs:
        if r.metrics:
            g[(r.model, r.task)][r.arm].append(r)
    order = {a: i for i, a in enumerate(MAIN_METHODS)}
    return {k: dict(sorted(v.items(), key=lambda kv: (order.get(kv[0], 99), kv[0]))) for k, v in sorted(g.items())}


def _mean_curve(runs, name, smooth: int = 1):
    """Mean over seeds on the union of steps (NaN-aware), then a trailing moving average."""
    by_step: dict[float, list[float]] = defaultdict(list)
    for r in runs:
        xs, ys = r.series(name)
        for x, y in zip(xs, ys, strict=False):
            by_step[x].append(y)
    if not by_step:
        return np.array([]), np.array([])
    xs = np.array(sorted(by_step))
    ys = np.array([np.mean(by_step[x]) for x in xs])
    if smooth > 1 and ys.size > smooth:
        ys = pd.Series(ys).rolling(smooth, min_periods=1).mean().to_numpy()
    return xs, ys


def _seed_band(runs, name, smooth: int = 1):
    """Per step the lowest and highest seed, each seed's curve smoothed like the mean's, over the steps every
    seed logged; empty with fewer than two seeds."""
    curves = []
    for r in runs:
        xs, ys = r.series(name)
        if not np.asarray(xs).size:
            continue
        ys = np.asarray(ys, dtype=float)
        if smooth > 1 and ys.size > smooth:
            ys = pd.Series(ys).rolling(smooth, min_periods=1).mean().to_numpy()
        curves.append(dict(zip(np.asarray(xs).tolist(), ys, strict=False)))
    if len(curves) < 2:
        return np.array([]), np.array([]), np.array([])
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    vals = np.array([[c[x] for x in steps] for c in curves])
    return np.array(steps), np.nanmin(vals, axis=0), np.nanmax(vals, axis=0)


def _panel_grid(n_rows: int, n_cols: int, w: float = 4.2, h: float = 3.0):
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(w * n_cols, h * n_rows), squeeze=False)
    return fig, axes


def _wrap_grid(n: int, n_cols: int = 3, w: float = 4.2, h: float = 3.2):
    """n panels, at most n_cols to a row (readable at page width); the unused cells are removed."""
    n_cols = max(1, min(n_cols, n))
    n_rows = math.ceil(n / n_cols)
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(w * n_cols, h * n_rows), squeeze=False)
    for ax in axes.flat[n:]:
        fig.delaxes(ax)
    return fig, list(axes.flat[:n])


def _finish(fig, axes, title: str, extra: tuple[list, list] | None = None, ncol: int = 5) -> None:
    """The figure's title, then its one legend (every labelled line of every panel, once, plus `extra`
    handles/labels) just below it, above the panels."""
    handles, labels = {}, []
    for ax in np.asarray(axes, dtype=object).flat:
        for hd, lb in zip(*ax.get_legend_handles_labels(), strict=False):
            if lb not in handles:
                handles[lb] = hd
                labels.append(lb)
    for hd, lb in zip(*(extra or ([], [])), strict=True):
        if lb not in handles:
            handles[lb] = hd
            labels.append(lb)
    height = fig.get_size_inches()[1]
    rows = math.ceil(len(labels) / ncol) if labels else 0
    title_in, row_in = 0.32, 0.18  # inches: the title's line, one legend row
    fig.suptitle(title, y=1 - 0.08 / height, va="top", fontsize=10)
    if labels:
        fig.legend([handles[lb] for lb in labels], labels, loc="upper center", ncol=min(ncol, len(labels)),
                   bbox_to_anchor=(0.5, 1 - title_in / height), frameon=False, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 1 - (title_in + row_in * rows + 0.02) / height))


def curves_reward_figure(runs, main_only: bool = True):
    """Left: mean rollout reward per step. Right (when any run logged one): held-out eval accuracy."""
    groups = _groups(runs)
    has_eval = any(r.series("eval_accuracy")[0].size for g in groups.values() for rs in g.values() for r in rs)
    panels = [("reward_mean", "mean rollout reward", "mean reward")]
    if has_eval:
        panels.append(("eval_accuracy", "held-out test accuracy", "test accuracy (fraction correct)"))
    fig, axes = _panel_grid(len(groups), len(panels))
    smooth = 1
    for i, ((model, task), arms) in enumerate(groups.items()):
        n_steps = max(len(r.metrics) for rs in arms.values() for r in rs)
        smooth = max(1, n_steps // 20)
        for arm, rs in arms.items():
            if main_only and arm not in MAIN_METHODS:
                continue
            for j, (name, _, _) in enumerate(panels):
                # evaluations are sparse (every eval_every steps): drawn unsmoothed, with markers
                sm = smooth if name == "reward_mean" else 1
                x, y = _mean_curve(rs, name, sm)
                if x.size:
                    extra = {} if name == "reward_mean" else {"marker": "o", "markersize": 3}
                    axes[i, j].plot(x, y, label=arm, **style.arm_style(arm), **extra)
                    bx, lo, hi = _seed_band(rs, name, sm)
                    if bx.size:
                        axes[i, j].fill_between(bx, lo, hi, color=style.arm_color(arm), alpha=0.15, linewidth=0)
        for j, (_, title, ylabel) in enumerate(panels):
            ax = axes[i, j]
            ax.set_title(f"{model} / {task}: {title}")
            ax.set_xlabel("RL step")
            ax.set_ylabel(ylabel)
    _finish(fig, axes, f"Reward and test accuracy per arm (mean over seeds, band: lowest to highest seed"
                       f"{'; reward smoothed' if smooth > 1 else ''})")
    return fig


def plot_curves(runs, out: str, main_only: bool = True) -> list[str]:
    if not _groups(runs):
        return style.placeholder(out, "curves_reward", "Reward and accuracy", "no logged runs with metrics")
    return style.save(curves_reward_figure(runs, main_only), out, "curves_reward")


def _mismatch_axes(ax, model: str, task: str, label: str, unit: str) -> None:
    ax.set_yscale("log")
    ax.set_title(f"{model} / {task}: {label}")
    ax.set_xlabel("RL step")
    ax.set_ylabel(unit)


def plot_mismatch(runs, out: str) -> list[str]:
    """Main arms only: token k3 and max |Δ log-prob| per step, one row per model / task."""
    groups = _groups(runs)
    if not groups:
        return style.placeholder(out, "curves_mismatch", "Mismatch", "no logged runs with metrics")
    fig, axes = _panel_grid(len(groups), 2)
    for i, ((model, task), arms) in enumerate(groups.items()):
        for arm, rs in arms.items():
            if arm not in MAIN_METHODS:
                continue
            for j, name in enumerate(("k3", "dlp_abs_max")):
                x, y = _mean_curve(rs, name)
                pos = y > 0
                if pos.any():
                    axes[i, j].plot(x[pos], y[pos], label=arm, **style.arm_style(arm))
        for j, (label, unit) in enumerate((("token k3 mismatch", "k3 (nats, log scale)"),
                                           ("max |Δ log-prob|", "max |Δlp| (nats, log scale)"))):
            _mismatch_axes(axes[i, j], model, task, label, unit)
    _finish(fig, axes, "Trainer vs rollout mismatch of sampled tokens' log-probs, main arms (lower is better)")
    return style.save(fig, out, "curves_mismatch")


ABLATION_REFERENCE = ("qat-independent", "trace")  # drawn beside the ablations for scale


def plot_ablation_mismatch(runs, out: str) -> list[str]:
    """The ablation arms' token k3 per step (smoothed), one panel per model / task that has ablations,
    with the main table's trace and qat-independent arms for reference."""
    groups = {k: v for k, v in _groups(runs).items() if any(a not in MAIN_METHODS for a in v)}
    if not groups:
        return style.placeholder(out, "ablation_mismatch", "Ablation mismatch", "no ablation arms in these runs")
    fig, axes = _wrap_grid(len(groups), 2, w=5.6, h=3.8)
    for ax, ((model, task), arms) in zip(axes, groups.items(), strict=True):
        n_steps = max(len(r.metrics) for rs in arms.values() for r in rs)
        for arm, rs in arms.items():
            if arm in MAIN_METHODS and arm not in ABLATION_REFERENCE:
                continue
            x, y = _mean_curve(rs, "k3", max(1, n_steps // 20))
            pos = y > 0
            if pos.any():
                st = style.arm_style(arm)
                if arm in ABLATION_REFERENCE:
                    st = {**st, "linestyle": ":", "linewidth": 2.2}
                ax.plot(x[pos], y[pos], label=arm + (" (reference)" if arm in ABLATION_REFERENCE else ""), **st)
        _mismatch_axes(ax, model, task, "token k3 mismatch", "k3 (nats, log scale)")
    _finish(fig, axes, "Ablations: token k3 per step (mean over seeds, smoothed); dotted: main-table arms",
            ncol=4)
    return style.save(fig, out, "ablation_mismatch")


def _layer_index(layer: str) -> int:
    return int("".join(c for c in str(layer) if c.isdigit()))


def flip_rates_figure(runs):
    """Each arm's per-layer rates at the layers' true indices, on one integer axis per panel."""
    groups = _groups(runs)
    fig, axes = _panel_grid(len(groups), 2)
    for i, ((model, task), arms) in enumerate(groups.items()):
        shown: list[set[int]] = [set(), set()]
        for arm, rs in arms.items():
            for j, name in enumerate(("code_flip_rate", "routing_flip_rate")):
                profs = [p for p in (r.layer_profile(name) for r in rs) if p]
                if not profs:
                    continue
                layers = sorted({_layer_index(k) for p in profs for k in p})
                by_index = [{_layer_index(k): v for k, v in p.items()} for p in profs]
                y = [np.nanmean([p.get(layer, np.nan) for p in by_index]) for layer in layers]
                axes[i, j].plot(layers, y, marker="o", markersize=3, label=arm, **style.arm_style(arm))
                shown[j].update(layers)
        for j, label in enumerate(("FP4 code-flip rate", "routing flip rate")):
            ax = axes[i, j]
            if shown[j]:
                ax.set_xticks(sorted(shown[j]))
            else:  # e.g. the main table's runs, which leave the diagnostic flip record off (rl.diag_flips)
                ax.text(0.5, 0.5, "not logged by these runs\n(rl.diag_flips off)", ha="center", va="center",
                        transform=ax.transAxes, color="0.4")
                ax.set_xticks([])
                ax.set_yticks([])
            ax.set_title(f"{model} / {task}: {label}")
            ax.set_xlabel("layer index (deeper to the right)")
            ax.set_ylabel("fraction differing, trainer vs rollout")
    _finish(fig, axes, "Per-layer disagreement between trainer and rollout (mean over steps and seeds)")
    return fig


def plot_flip_rates(runs, out: str) -> list[str]:
    groups = _groups(runs)
    have = any(r.layer_profile("code_flip_rate") for rs in (v for g in groups.values() for v in g.values()) for r in rs)
    if not groups or not have:
        return style.placeholder(out, "flip_rates", "Per-layer flip rates", "no per-layer code_flip_rate logged")
    return style.save(flip_rates_figure(runs), out, "flip_rates")


def _stack_labels(ax, points: list[tuple[float, float, str]], fontsize: float = 7, gap_pt: float = 1.5,
                  marker_pt: float = 6.0) -> None:
    """Annotate each (x, y, text) point to its right; a label that would overlap a label already placed
    or another point's marker is moved up just above it (with a thin leader line), so no label covers
    another. Call after the figure's layout is final."""
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    px_per_pt = fig.dpi / 72.0
    r = marker_pt * px_per_pt / 2
    placed: list = [Bbox.from_extents(px - r, py - r, px + r, py + r)  # display-space boxes to avoid
                    for px, py in (ax.transData.transform((x, y)) for x, y, _ in points)]
    for x, y, text in sorted(points, key=lambda p: (ax.transData.transform((p[0], p[1]))[1], p[2])):
        px, py = ax.transData.transform((x, y))
        dy = -3.0
        while True:
            ann = ax.annotate(text, (x, y), xytext=(4, dy), textcoords="offset points", fontsize=fontsize,
                              va="bottom")
            ann.update_positions(renderer)  # Text's extent alone does not place an annotation's text first
            box = Text.get_window_extent(ann, renderer)  # the text alone, without a leader line
            hit = next((b for b in placed if b.overlaps(box)), None)
            if hit is None:
                break
            ann.remove()
            dy = (hit.y1 - py) / px_per_pt + gap_pt
        if dy > 4:
            ann.remove()
            ann = ax.annotate(text, (x, y), xytext=(4, dy), textcoords="offset points", fontsize=fontsize,
                              va="bottom", arrowprops={"arrowstyle": "-", "linewidth": 0.4, "color": "0.5",
                                                       "shrinkA": 0, "shrinkB": 2})
            ann.update_positions(renderer)
            box = Text.get_window_extent(ann, renderer)
        placed.append(box)


def mismatch_vs_bytes_figure(runs_df: pd.DataFrame):
    d = runs_df.groupby(["model", "task", "arm"], as_index=False)[["k3_mean", "guidance_bytes_per_gen_token"]].mean()
    groups = list(d.groupby(["model", "task"], sort=True))
    fig, axes = _wrap_grid(len(groups), 3, w=4.6, h=3.8)
    labels = []
    for ax, ((model, task), g) in zip(axes, groups, strict=True):
        pts = []
        for _, row in g.iterrows():
            if not (np.isfinite(row.k3_mean) and row.k3_mean > 0 and np.isfinite(row.guidance_bytes_per_gen_token)):
                continue
            ax.scatter(row.guidance_bytes_per_gen_token, row.k3_mean, color=style.arm_color(row.arm), s=36,
                       label=row.arm, zorder=3)
            pts.append((row.guidance_bytes_per_gen_token, row.k3_mean, row.arm))
        labels.append(pts)
        ax.set_yscale("log")
        ax.set_xlabel("guidance record (bytes per generated token)")
        ax.set_ylabel("mean token k3 (nats, log scale)")
        ax.set_title(f"{model} / {task}")
        xmax = max([1.0] + [p[0] for p in pts])
        ax.set_xlim(-0.05 * xmax, 1.45 * xmax)  # room for the labels right of the points
        if pts:  # decades of room above the highest point for labels stacked upwards, below the title
            lo, hi = min(p[1] for p in pts), max(p[1] for p in pts)
            span = max(math.log10(hi / lo), 1.0)
            ax.set_ylim(lo / 10 ** (0.15 * span), hi * 10 ** (0.6 * span))
    _finish(fig, axes, "Mismatch vs guidance cost (each point: one arm, mean over steps and seeds)", ncol=5)
    for ax, pts in zip(axes, labels, strict=True):
        _stack_labels(ax, pts)
    return fig


def plot_mismatch_vs_bytes(runs_df: pd.DataFrame, out: str) -> list[str]:
    if runs_df is None or runs_df.empty:
        return style.placeholder(out, "mismatch_vs_bytes", "Mismatch vs guidance bytes", "no runs")
    return style.save(mismatch_vs_bytes_figure(runs_df), out, "mismatch_vs_bytes")


def eval_sample_counts(runs) -> dict[tuple[str, str], int]:
    """{(model, task): n} evaluation samples per deployment (the smallest n in eval.json over the runs)."""
    out: dict[tuple[str, str], int] = {}
    for r in runs:
        for dep in ("bf16", "fp4"):
            n = ((r.eval or {}).get(dep) or {}).get("n")
            if isinstance(n, int) and n > 0:
                out[(r.model, r.task)] = min(n, out.get((r.model, r.task), n))
    return out


def accuracy_stderr(g: pd.DataFrame, col: str, n_eval: int | None) -> np.ndarray:
    """One standard error per row of a main-table slice: the table's own `<col>_se` (prompt-clustered,
    analysis/tables.py) where it has one; else std/sqrt(n_seeds) over seeds where n_seeds > 1, else the
    binomial sqrt(p(1-p)/n_eval) (NaN when neither is known)."""
    if f"{col}_se" in g and np.isfinite(g[f"{col}_se"].to_numpy(dtype=float)).any():
        return g[f"{col}_se"].to_numpy(dtype=float)
    p = g[col].to_numpy(dtype=float)
    seeds = g["n_seeds"].to_numpy(dtype=float) if "n_seeds" in g else np.ones_like(p)
    std = g[f"{col}_std"].to_numpy(dtype=float) if f"{col}_std" in g else np.full_like(p, np.nan)
    binom = np.sqrt(p * (1 - p) / n_eval) if n_eval else np.full_like(p, np.nan)
    return np.where((seeds > 1) & np.isfinite(std), std / np.sqrt(np.maximum(seeds, 1)), binom)


def final_accuracy_figure(main_df: pd.DataFrame, n_eval: dict | None = None):
    """One panel per model / task (3 to a row): each arm's accuracy under BF16 (circle) and FP4 (square)
    deployment with 1 SE bars; the y axis is zoomed to the points and their bars, so differences of a
    few hundredths are visible (the axis does not start at 0)."""
    groups = list(main_df.groupby(["model", "task"], sort=True))
    n_arms = main_df["arm"].nunique()
    fig, axes = _wrap_grid(len(groups), 3, w=max(4.2, 0.55 * n_arms + 1.6), h=3.6)
    deps = (("acc_bf16", "BF16 deployment", "o", -0.15), ("acc_fp4", "FP4 deployment", "s", 0.15))
    for ax, ((model, task), g) in zip(axes, groups, strict=True):
        x = np.arange(len(g))
        lo, hi = np.inf, -np.inf
        for col, _, marker, dx in deps:
            vals = g[col].to_numpy(dtype=float)
            err = accuracy_stderr(g, col, (n_eval or {}).get((model, task)))
            for xi, v, e, arm in zip(x, vals, err, g["arm"], strict=True):
                # a NaN point (posthoc-fp4 has no BF16 deployment) draws nothing but keeps the arms' order
                ax.errorbar(xi + dx, v, yerr=e if np.isfinite(e) else None, fmt=marker, ms=5,
                            color=style.arm_color(arm), mfc=style.arm_color(arm) if marker == "o" else "white",
                            capsize=2, elinewidth=0.9)
                if np.isfinite(v):
                    lo, hi = min(lo, v - (e if np.isfinite(e) else 0)), max(hi, v + (e if np.isfinite(e) else 0))
        if np.isfinite(lo):
            pad = max(0.15 * (hi - lo), 0.005)
            ax.set_ylim(max(0.0, lo - pad), min(1.0, hi + pad))
        ax.set_xticks(x)
        ax.set_xticklabels(g["arm"], rotation=35, ha="right", fontsize=8)
        ax.set_xlim(-0.6, len(g) - 0.4)
        ax.set_ylabel("test accuracy (fraction correct)")
        ax.set_title(f"{model} / {task}")
    multi = "n_seeds" in main_df and (main_df["n_seeds"] > 1).any()
    has_se = "acc_fp4_se" in main_df and np.isfinite(main_df["acc_fp4_se"].to_numpy(dtype=float)).any()
    bar = ("as in the main table" if has_se else "over seeds" if multi else "binomial, over evaluation samples")
    keys = ([plt.Line2D([], [], color="0.3", marker="o", linestyle="none"),
             plt.Line2D([], [], color="0.3", marker="s", mfc="white", linestyle="none")],
            ["BF16 deployment (filled circle)", "FP4 deployment (open square)"])
    _finish(fig, axes, f"Final test accuracy per arm (colour: arm; bars: 1 standard error, {bar}; "
            "axes zoomed to the data)", extra=keys, ncol=2)
    return fig


def plot_final_accuracy(main_df: pd.DataFrame, out: str, n_eval: dict | None = None) -> list[str]:
    if main_df is None or main_df.empty:
        return style.placeholder(out, "final_accuracy", "Final accuracy", "no main table")
    return style.save(final_accuracy_figure(main_df, n_eval), out, "final_accuracy")


def paired_figure(cmp: pd.DataFrame):
    """cmp: compare.csv rows (model, task, a, b, diff, se, n_seeds). One row per comparison, grouped by
    model/task (top to bottom in the table's order), A - B with its simultaneous 95% interval (2 SE either side
    for a table without one)."""
    keys = list(dict.fromkeys(zip(cmp["model"], cmp["task"], strict=True)))
    fig, ax = plt.subplots(figsize=(8.4, 0.26 * (len(cmp) + 1.2 * len(keys)) + 1.4))
    seeds = sorted({int(n) for n in cmp["n_seeds"]})
    sim_bars = "lo_sim" in cmp and np.isfinite(cmp["lo_sim"].to_numpy(dtype=float)).all()
    one_n = len(seeds) == 1
    y, ticks, labels = 0.0, [], []
    for model, task in keys:
        g = cmp[(cmp["model"] == model) & (cmp["task"] == task)]
        ax.text(0.0, y, f"{model} / {task}", transform=ax.get_yaxis_transform(), ha="left", va="center",
                fontsize=8, fontweight="bold")
        y -= 1.0
        for _, r in g.iterrows():
            arm = r["a"].split(" (")[0]
            d = float(r["diff"])
            if sim_bars:  # compare.csv's simultaneous interval (Bonferroni, family-wise 0.05 over the table)
                err = [[d - float(r["lo_sim"])], [float(r["hi_sim"]) - d]]
            else:
                err = 2 * float(r["se"])
            ax.errorbar(d, y, xerr=err, fmt="o", ms=4, color=style.arm_color(arm), capsize=2, elinewidth=1.0)
            ticks.append(y)
            labels.append(f"{r['a']} - {r['b']}" + ("" if one_n else f"  ({int(r['n_seeds'])} seeds)"))
            y -= 1.0
        y -= 0.2
    ax.axvline(0.0, color="black", lw=0.8)
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_ylim(y + 0.4, 0.8)
    ax.set_xlabel("held-out accuracy, A - B; bars: " + ("simultaneous 95% intervals (Bonferroni over every "
                  "comparison shown)" if sim_bars else "2 standard errors"))
    over = f"{seeds[0]} seed{'s' if seeds[0] > 1 else ''}" if one_n else "the seeds both arms have"
    arms_a = list(dict.fromkeys(a.split(" (")[0] for a in cmp["a"]))
    keys = ([plt.Line2D([], [], color=style.arm_color(a), marker="o", ms=4) for a in arms_a],
            [f"A = {a}" for a in arms_a])
    _finish(fig, [ax], f"Paired arm comparisons (compare.md): paired by seed and prompt, over {over}; "
            "colour: arm A", extra=keys, ncol=4)
    return fig


def plot_paired(runs_dir: str, tables_dir: str | None, out: str, manifest: str | None = None) -> list[str]:
    path = os.path.join(tables_dir, "compare.csv") if tables_dir else ""
    if path and os.path.exists(path):
        cmp = pd.read_csv(path)
    else:
        from analysis.compare import compare_table, main_evals

        cmp = compare_table(main_evals(runs_dir, manifest)[0])
    if cmp.empty:
        return style.placeholder(out, "paired_differences", "Paired arm comparisons", "no pair of arms with evaluations")
    return style.save(paired_figure(cmp), out, "paired_differences")


def plot_all_runs(runs_dir: str, tables_dir: str | None, out: str, manifest: str | None = None) -> list[str]:
    style.setup()
    runs = load_runs(runs_dir, manifest)
    written = []
    written += plot_curves(runs, out)
    written += plot_mismatch(runs, out)
    written += plot_ablation_mismatch(runs, out)
    written += plot_flip_rates(runs, out)
    runs_df = main_df = None
    if tables_dir and os.path.exists(os.path.join(tables_dir, "runs.csv")):
        runs_df = pd.read_csv(os.path.join(tables_dir, "runs.csv"))
        main_df = pd.read_csv(os.path.join(tables_dir, "main.csv"))
    else:
        from analysis.tables import main_table, runs_frame

        runs_df = runs_frame([r for r in runs if r.metrics])
        main_df = main_table(runs_df) if not runs_df.empty else None
    written += plot_mismatch_vs_bytes(runs_df, out)
    written += plot_final_accuracy(main_df, out, eval_sample_counts(runs))
    written += plot_paired(runs_dir, tables_dir, out, manifest)
    return written


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", required=True)
    ap.add_argument("--tables", help="tables dir (runs.csv, main.csv); recomputed from runs if absent")
    ap.add_argument("--manifest")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    for p in plot_all_runs(a.runs, a.tables, a.out, a.manifest):
        print("wrote", p)


if __name__ == "__main__":
    main()
