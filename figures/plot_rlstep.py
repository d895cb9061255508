"""RL-step figure from the long table results/rlstep/rlstep.csv (benchmarks/bench_rlstep.py, GPU runs). No GPU needed.

    python -m figures.plot_rlstep [--csv results/rlstep/rlstep.csv] [--out figures/gpu]

One panel per model shape and batch: one horizontal bar per arm, the median RL step split into its phases (DESIGN.md §6,
"RL step"): rollout (generation, its in-graph recording included, and scoring), record (the record's hand-over), forward+backward
(the trainer's, replay excluded), replay (what replaying the record adds to forward+backward, paired in the
benchmark's process) and other (optimizer, weight sync, batch and metrics). Beside each bar, from the same run's rows:
the rollout's generated tokens/s over the bf16 arm's, a recording arm's rollout time over qat-independent's (the
same FP4 engine without a record: recording inside the decode graphs is part of generation, so `record` draws only
the hand-over after it) and the train phase over qat-independent's. Drawn per shape: the newest run
(version@commit of that shape's last row), GPU rows only, the `auto` kernels setting where a run has several.
Writes `rlstep.png/pdf` into --out, and nothing at all when the table has no GPU row (the figure is then absent,
not a placeholder, so `snakemake figures` leaves a checkout without measurements unchanged).
Compared against: the bf16 arm (no FP4) and qat-independent (the FP4 trainer without guidance), same run.
"""
from __future__ import annotations

import argparse

import numpy as np
import pandas as pd

from figures import style
from figures.plot_kernels import read_table
from figures.style import plt

ARMS = ("bf16", "fp4-naive", "qat-independent", "trace", "trace-deep", "exact")
PHASES = ("rollout", "record", "forward+backward", "replay", "other")
PHASE_COLORS = {"rollout": "#9ecae1", "record": "#d62728", "forward+backward": "#fdae6b", "replay": "#1f77b4",
                "other": "#bdbdbd"}


def phases(row: pd.Series) -> dict[str, float]:
    """Seconds of each drawn phase of one row; each is at least 0 (a replay below its paired probe's noise is 0)."""
    f = lambda k: float(row[k]) if pd.notna(row.get(k)) else 0.0  # noqa: E731
    raw = {"rollout": f("rollout_s") - f("record_s"), "record": f("record_s"),
           "forward+backward": f("fwd_bwd_s") - f("replay_s"), "replay": f("replay_s"),
           "other": f("train_s") - f("fwd_bwd_s")}
    return {k: max(v, 0.0) for k, v in raw.items()}


def select(df: pd.DataFrame) -> pd.DataFrame:
    """Per (model, batch): the rows of its newest run (GPU rows only), one per arm (`auto` kernels first, then the
    last); column panel_ names the panel."""
    if df.empty or "gpu" not in df.columns:
        return pd.DataFrame()
    df = df[(df["gpu"].astype(str) != "cpu") & pd.to_numeric(df["step_s"], errors="coerce").notna()].copy()
    out = []
    for (model, batch), g in df.groupby(["model", "batch"], sort=False):
        last = g.loc[g["row_"].idxmax()]
        run = g[(g["version"].astype(str) == str(last["version"])) & (g["commit"].astype(str) == str(last["commit"]))]
        # a row timed under a setting of its own (its note's TRACE_*=value) is drawn as an arm of its own
        setting = run.get("note", pd.Series("", index=run.index)).fillna("").astype(str).str.findall(r"TRACE_\w+=\w+")
        run = run.assign(arm=[a if not s else f"{a} {' '.join(s)}" for a, s in zip(run["arm"], setting, strict=True)])
        run = run.assign(auto_=run["fp4_kernels"].astype(str) == "auto").sort_values(["auto_", "row_"])
        out.append(run.drop_duplicates("arm", keep="last").drop(columns="auto_").assign(panel_=f"{model}/{batch}"))
    return pd.concat(out) if out else pd.DataFrame()


def _order(arms) -> list[str]:
    """The known arms in ARMS order, each followed by its rows under settings of their own, then any others."""
    rank = lambda a: (ARMS.index(a.split()[0]) if a.split()[0] in ARMS else len(ARMS), a)  # noqa: E731
    return sorted(set(arms), key=rank)


def plot_rlstep(csv: str | None, out: str) -> list[str]:
    rows = select(read_table(csv))
    if rows.empty:
        return []
    style.setup()
    models = list(dict.fromkeys(rows["panel_"]))
    fig, axes = plt.subplots(len(models), 1, figsize=(10, 1.2 + 0.5 * 5 * len(models)), squeeze=False)
    for ax, model in zip(axes[:, 0], models, strict=True):
        g = rows[rows["panel_"] == model].set_index("arm")
        arms = _order(g.index)
        y = np.arange(len(arms))[::-1]
        for yi, arm in zip(y, arms, strict=True):
            left = 0.0
            for ph, v in phases(g.loc[arm]).items():
                ax.barh(yi, v, left=left, color=PHASE_COLORS[ph], edgecolor="white", linewidth=0.5, height=0.7)
                left += v
            r = g.loc[arm]
            tags = []
            ref = lambda a, k: float(g.loc[a, k]) if a in g.index and a != arm else float("nan")  # noqa: E731
            if arm != "bf16" and np.isfinite(ref("bf16", "tok_s")):
                tags.append(f"rollout {float(r['tok_s']) / ref('bf16', 'tok_s'):.2f}x bf16")
            if float(r.get("record_s") or 0) > 0 and np.isfinite(ref("qat-independent", "rollout_s")):
                # recording inside the decode graphs is part of generation: its whole cost is the rollout's excess
                # over the same FP4 engine without a record
                tags.append(f"rollout +{float(r['rollout_s']) / ref('qat-independent', 'rollout_s') - 1:.0%} "
                            "over qat-ind.")
            if arm.split()[0] not in ("bf16", "fp4-naive", "qat-independent") and np.isfinite(ref("qat-independent", "train_s")):
                tags.append(f"train {float(r['train_s']) / ref('qat-independent', 'train_s'):.2f}x qat-ind.")
            if tags:
                ax.text(left, yi, "  " + ", ".join(tags), va="center", fontsize=8)
        ax.set_yticks(y, arms)
        r0 = g.iloc[0]
        ax.set_title(f"{model}: {int(r0['batch'])} sequences x {int(r0['gen'])} generated tokens"
                     f"{' (forced)' if str(r0.get('forced')) == 'True' else ''}, {r0['gpu']}, "
                     f"{r0['version']}@{str(r0['commit'])[:8]}")
        ax.set_xlabel("seconds per RL step (median)")
        ax.set_xlim(0, ax.get_xlim()[1] * 1.35)  # room for the ratios
    handles = [plt.Rectangle((0, 0), 1, 1, color=PHASE_COLORS[p]) for p in PHASES]
    fig.legend(handles, PHASES, loc="upper center", ncol=len(PHASES), frameon=False, bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return style.save(fig, out, "rlstep")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", default="results/rlstep/rlstep.csv")
    ap.add_argument("--out", default="figures/gpu")
    a = ap.parse_args(argv)
    written = plot_rlstep(a.csv, a.out)
    print("\n".join(f"wrote {p}" for p in written) or f"no GPU rows in {a.csv}: no RL-step figure")


if __name__ == "__main__":
    main()
