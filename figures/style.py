"""Shared figure style and saving: PNG at 150 dpi + PDF, byte-identical when redrawn from the same data.

Used by every figures.plot_* module; not a script. Byte stability (tests/analysis/test_figures.py):
no timestamps or software versions in the files, and the layout is snapped to a coarse grid before
saving. The snap matters across machines: text extents and numpy/libm transcendental functions can
differ in their last bits between CPUs, and a coordinate that lands on a tie of the 6-decimal PDF
output then changes the file (seen: one axes edge at 396.0771875 pt).
"""
from __future__ import annotations

import math
import os
import tempfile

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.transforms import Bbox  # noqa: E402

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


AXES_GRID = 1e-4  # axes positions, in figure fractions
BBOX_GRID = 0.01  # saved area, in inches


def snap_layout(fig) -> Bbox:
    """Fix the layout (run the figure's layout engine once, then switch it off), round every axes'
    position to AXES_GRID and return the area to save (tight bbox + pad) rounded outward to BBOX_GRID."""
    engine = fig.get_layout_engine()
    if engine is not None:
        engine.execute(fig)
        fig.set_layout_engine("none")
    for ax in fig.axes:
        ax.set_position([round(v / AXES_GRID) * AXES_GRID for v in ax.get_position().bounds])
    bb = fig.get_tightbbox(fig.canvas.get_renderer()).padded(plt.rcParams["savefig.pad_inches"])
    lo = [math.floor(v / BBOX_GRID) * BBOX_GRID for v in (bb.x0, bb.y0)]
    hi = [math.ceil(v / BBOX_GRID) * BBOX_GRID for v in (bb.x1, bb.y1)]
    return Bbox.from_extents(lo[0], lo[1], hi[0], hi[1])


def _replace(path: str, write) -> None:
    """Write through a temporary file beside `path`, then rename it over `path`: a figure that fails to
    draw never truncates or deletes the file already there (a committed figure stays until a good one
    exists)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=os.path.dirname(path))
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def save(fig, out_dir: str, name: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"{name}.png"), os.path.join(out_dir, f"{name}.pdf")]
    try:
        box = snap_layout(fig)
        _replace(paths[0], lambda p: fig.savefig(p, format="png", dpi=150, bbox_inches=box,
                                                 metadata={"Software": None}))
        _replace(paths[1], lambda p: fig.savefig(p, format="pdf", bbox_inches=box,
                                                 metadata={"CreationDate": None, "Producer": None, "Creator": None}))
    finally:
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
