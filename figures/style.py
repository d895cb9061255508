"""Shared figure style and saving (PNG at 150 dpi + PDF with no timestamp, so reruns are byte-stable).

Used by figures.plot_runs and figures.plot_speedups; not a script.
"""
from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# one fixed color per arm, so every figure reads the same way
ARM_COLORS = {
    "bf16": "#000000",
    "fp4-naive": "#d62728",
    "qat-independent": "#ff7f0e",
    "qat-weight-only": "#9467bd",
    "trace": "#1f77b4",
    "posthoc-fp4": "#7f7f7f",
    "trace-fullcodes": "#17becf",
    "trace-noalign": "#2ca02c",
    "trace-noroutingreplay": "#bcbd22",
    "trace-rho0": "#c49c94",
    "trace-rho0.25": "#e377c2",
    "trace-rho0.5": "#8c564b",
    "trace-rho1": "#393b79",
}
_EXTRA = ["#8c564b", "#e377c2", "#aec7e8", "#98df8a", "#ffbb78", "#c5b0d5", "#c49c94"]


def arm_color(arm: str) -> str:
    if arm in ARM_COLORS:
        return ARM_COLORS[arm]
    return _EXTRA[sum(map(ord, arm)) % len(_EXTRA)]


def arm_style(arm: str) -> dict:
    main = arm in ("bf16", "fp4-naive", "qat-independent", "qat-weight-only", "trace", "posthoc-fp4")
    return {"color": arm_color(arm), "linestyle": "-" if main else "--", "linewidth": 2.0 if arm == "trace" else 1.4}


def setup() -> None:
    plt.rcParams.update({
        "font.size": 10, "axes.titlesize": 10, "axes.labelsize": 10, "legend.fontsize": 8,
        "axes.grid": True, "grid.alpha": 0.3, "figure.dpi": 100, "savefig.bbox": "tight",
        "svg.hashsalt": "trace", "pdf.compression": 6,
    })


def save(fig, out_dir: str, name: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"{name}.png"), os.path.join(out_dir, f"{name}.pdf")]
    fig.savefig(paths[0], dpi=150, metadata={"Software": None})
    fig.savefig(paths[1], metadata={"CreationDate": None, "Producer": None, "Creator": None})
    plt.close(fig)
    return paths


def placeholder(out_dir: str, name: str, title: str, message: str) -> list[str]:
    """A figure that says plainly what is missing (keeps the pipeline's outputs complete)."""
    setup()
    fig, ax = plt.subplots(figsize=(6, 2.5))
    ax.axis("off")
    ax.set_title(title)
    ax.text(0.5, 0.5, message, ha="center", va="center", wrap=True, fontsize=9, transform=ax.transAxes)
    return save(fig, out_dir, name)
