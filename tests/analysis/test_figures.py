"""figures.plot_all on synthetic run dirs: every figure is written as PNG and PDF, with and without the
tables and the benchmark CSVs; reruns are byte-identical (so committed figures do not churn); a figure
that fails to draw leaves the file already there untouched; the layout reads at page width (at most 3
panels to a row, one legend above the panels, accuracy axes zoomed to the data)."""
import hashlib

import pytest

from analysis.tables import build
from figures.plot_all import main as plot_all_main
from tests.analysis.synthetic import write_profile

NAMES = ["curves_reward", "curves_mismatch", "ablation_mismatch", "flip_rates", "mismatch_vs_bytes",
         "final_accuracy", "paired_differences", "speedups", "rollout"]

# the long tables benchmarks/bench_kernels.py and bench_rollout.py append to (benchmarks/results_table.py)
KERNEL_CSV = """version,commit,gpu,date,op,shape,provider,median_us,ratio_vs_bf16,pct_copy_bw
v1,abc,H200,2026-01-01,moe,qwen3 T16,bf16-grouped_mm,400,,20
v1,abc,H200,2026-01-01,moe,qwen3 T16,fp4-w4a16,120,3.3,30
"""
ROLLOUT_CSV = """version,commit,op,shape,provider,batch,prompt,gen,tokens_per_s,decode_ms_per_step,ms_per_step,layers,note,gpu
r1,abc,rollout_generate,qwen3_30b_a3b,engine-bf16,256,512,1024,40000,5.5,5.9,4,,H200
r1,abc,rollout_generate,qwen3_30b_a3b,hf-bf16,256,512,1024,2000,100,101,4,experts=grouped_mm,H200
r1,abc,rollout_generate,qwen3_30b_a3b,engine-w4a4-kv4,256,512,1024,20000,9.4,10,4,,H200
r1,abc,rollout_generate,qwen3_30b_a3b,engine-w4a4-kv4-triton,256,512,1024,30000,8,9,4,,H200
r1,abc,rollout_breakdown,qwen3_30b_a3b,engine-bf16,256,512,64,,,0.006,4,component=attention,H200
r1,abc,rollout_breakdown,qwen3_30b_a3b,engine-bf16,256,512,64,,,0.007,4,component=moe,H200
"""


@pytest.fixture()
def setup_dirs(tmp_path):
    runs = tmp_path / "runs" / "smoke"
    write_profile(runs, models=["qwen3_moe-tiny"], seeds=[0])
    tables = tmp_path / "tables"
    build(str(runs), str(tables), strict=True)
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "kernels.csv").write_text(KERNEL_CSV)
    (tmp_path / "rollout").mkdir()
    (tmp_path / "rollout" / "rollout.csv").write_text(ROLLOUT_CSV)
    return tmp_path, runs, tables


def _digest(d):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_all_figures_written_and_stable(setup_dirs):
    tmp, runs, tables = setup_dirs
    out = tmp / "figs"
    args = ["--runs", str(runs), "--tables", str(tables), "--kernels", str(tmp / "kernels"),
            "--rollout", str(tmp / "rollout"), "--out", str(out)]
    plot_all_main(args)
    for n in NAMES:
        png, pdf = (out / f"{n}.png").read_bytes(), (out / f"{n}.pdf").read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and pdf.startswith(b"%PDF-"), n
        width = int.from_bytes(png[16:20], "big")  # the IHDR chunk: width, then height, big-endian
        assert 300 < width <= 2600, (n, width)  # readable at page width: no 6000-px row of panels
    assert not list(out.glob(".*.tmp"))  # no temporary file left beside the figures
    from analysis.report import FIGURES
    assert sorted(FIGURES) == sorted(p.stem for p in out.glob("*.png"))  # the report links every figure drawn
    first = _digest(out)
    plot_all_main(args)
    assert _digest(out) == first


def test_figures_without_tables_or_csvs(setup_dirs):
    tmp, runs, _ = setup_dirs
    out = tmp / "figs2"
    plot_all_main(["--runs", str(runs), "--kernels", str(tmp / "none"), "--rollout", str(tmp / "none"),
                   "--out", str(out)])
    for n in NAMES:
        assert (out / f"{n}.png").exists() and (out / f"{n}.pdf").exists()


def test_rollout_ratios_from_bench_rows(tmp_path):
    import io

    import pandas as pd

    from figures.plot_rollout import ratios

    r = ratios(pd.read_csv(io.StringIO(ROLLOUT_CSV)).query("op == 'rollout_generate'")).iloc[0]
    assert r["engine_vs_hf"] == pytest.approx(20.0)  # engine BF16 / HF generate
    assert r["fp4kv4_vs_bf16"] == pytest.approx(0.75)  # best FP4 + KV4 provider / engine BF16


def test_rerun_in_another_process_is_byte_identical(setup_dirs):
    """Another interpreter (another hash seed, so another set/dict iteration order of strings) writes
    the same bytes: the committed figures do not change when the pipeline redraws them."""
    import os
    import subprocess
    import sys

    tmp, runs, tables = setup_dirs
    args = ["--runs", str(runs), "--tables", str(tables), "--kernels", str(tmp / "kernels"),
            "--rollout", str(tmp / "rollout")]
    plot_all_main(args + ["--out", str(tmp / "a")])
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run([sys.executable, "-m", "figures.plot_all", *args, "--out", str(tmp / "b")], check=True,
                   env=env, capture_output=True)
    assert _digest(tmp / "a") == _digest(tmp / "b")


def test_last_bit_layout_differences_do_not_change_the_files(tmp_path):
    """What differs between CPUs is the last bits of layout arithmetic (text extents, libm); the saved
    layout is snapped to a grid, so moving one axes' edges by 1e-7 of the figure (far more than such
    differences) writes identical PNG and PDF bytes. Unsnapped, the PDF's coordinates change."""
    from figures import style
    from figures.style import plt

    def draw(shift):
        style.setup()
        fig, axes = plt.subplots(1, 2, figsize=(6.1, 2.3))
        for k, ax in enumerate(axes):
            ax.plot([0.1, 1.7, 2.3], [3e-4, 1.1e-2, 7e-3], marker="o")
            ax.set_yscale("log")
            ax.set_title(f"panel {k}")
        fig.tight_layout()
        x0, y0, w, h = axes[1].get_position().bounds
        axes[1].set_position([x0 + shift, y0, w + shift, h - shift])
        out = tmp_path / f"s{shift}"
        style.save(fig, str(out), "f")
        return _digest(out)

    assert draw(0.0) == draw(1e-7) == draw(-1e-7)


def _runs(tmp_path, **kw):
    from analysis.runs import load_runs

    runs_dir = tmp_path / "runs" / "smoke"
    write_profile(runs_dir, models=["qwen3_moe-tiny"], **kw)
    return load_runs(str(runs_dir))


def test_flip_rates_at_true_layer_indices(tmp_path):
    """An arm that logs only layers 2-3 is drawn at x = 2, 3, not at 0, 1 over another arm's labels."""
    from figures.plot_runs import flip_rates_figure
    from figures.style import plt

    runs = _runs(tmp_path, ablations=())
    for r in runs:
        if r.arm == "trace":
            for m in r.metrics:
                for name in ("code_flip_rate", "routing_flip_rate"):
                    m[name] = {k: v for k, v in m[name].items() if int(k) >= 2}
    fig = flip_rates_figure(runs)
    ax = fig.axes[0]
    xs = {ln.get_label(): list(ln.get_xdata()) for ln in ax.get_lines()}
    plt.close(fig)
    assert xs["trace"] == [2, 3] and xs["qat-independent"] == [0, 1, 2, 3]
    assert sorted(ax.get_xticks().tolist()) == [0, 1, 2, 3]


def test_flip_rates_panel_without_data_says_so(tmp_path):
    """Runs that log routing flips but no code flips (rl.diag_flips off) get a labelled empty panel, not
    a blank unit axis that reads like a plotting error."""
    from figures.plot_runs import flip_rates_figure
    from figures.style import plt

    runs = _runs(tmp_path, ablations=())
    for r in runs:
        for m in r.metrics:
            m.pop("code_flip_rate", None)
    fig = flip_rates_figure(runs)
    code_ax, routing_ax = fig.axes[0], fig.axes[1]
    texts = [t.get_text() for t in code_ax.texts]
    plt.close(fig)
    assert not code_ax.get_lines() and any("not logged" in t for t in texts)
    assert routing_ax.get_lines() and not routing_ax.texts


def test_curves_reward_panels_show_different_quantities(tmp_path):
    """Reward and training accuracy coincide for 0/1 rewards: the second panel is the held-out
    eval accuracy (its own steps), not a copy of the first."""
    import numpy as np

    from figures.plot_runs import curves_reward_figure
    from figures.style import plt

    runs = _runs(tmp_path, ablations=())
    fig = curves_reward_figure(runs)
    left, right = fig.axes[0], fig.axes[1]
    trace_l = next(ln for ln in left.get_lines() if ln.get_label() == "trace")
    trace_r = next(ln for ln in right.get_lines() if ln.get_label() == "trace")
    plt.close(fig)
    run = next(r for r in runs if r.arm == "trace")
    ex, ey = run.series("eval_accuracy")
    assert np.array_equal(trace_r.get_xdata(), ex) and np.allclose(trace_r.get_ydata(), ey)
    assert len(trace_l.get_xdata()) == len(run.series("reward_mean")[0]) != len(ex)


def test_curves_reward_seed_band_spans_the_seeds(tmp_path):
    """With several seeds each arm's curve has a band from its lowest to its highest seed (one seed: none)."""
    import numpy as np
    from matplotlib.collections import PolyCollection

    from figures.plot_runs import curves_reward_figure
    from figures.style import plt

    runs = _runs(tmp_path, ablations=(), seeds=(0, 1, 2))
    fig = curves_reward_figure(runs)
    bands = [c for c in fig.axes[0].collections if isinstance(c, PolyCollection)]
    plt.close(fig)
    trace = [r for r in runs if r.arm == "trace"]
    ys = np.array([r.series("reward_mean")[1] for r in trace])
    assert len(bands) == len({r.arm for r in runs})
    assert not np.allclose(ys.min(0), ys.max(0))  # the seeds differ, so the band has a width
    one = curves_reward_figure(_runs(tmp_path / "one", ablations=()))
    assert not [c for c in one.axes[0].collections if isinstance(c, PolyCollection)]
    plt.close(one)


def test_mismatch_vs_bytes_labels_do_not_overlap():
    import pandas as pd

    from figures.plot_runs import mismatch_vs_bytes_figure
    from figures.style import plt

    arms = {"bf16": (2e-5, 0), "fp4-naive": (5.8e-2, 0), "qat-weight-only": (5.9e-2, 0),
            "qat-independent": (8e-3, 0), "trace": (6.9e-4, 65), "trace-noalign": (6.8e-4, 65),
            "trace-rho0.25": (6.9e-4, 32), "trace-rho1": (5e-6, 130)}
    df = pd.DataFrame([{"model": "m-tiny", "task": "reasoning", "arm": a, "k3_mean": k, "guidance_bytes_per_gen_token": b}
                       for a, (k, b) in arms.items()])
    fig = mismatch_vs_bytes_figure(df)
    from matplotlib.text import Text

    fig.canvas.draw()  # places every annotation's text where it is drawn
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    boxes = {t.get_text(): Text.get_window_extent(t, renderer) for t in ax.texts}  # text, no leader
    points = {t.get_text(): ax.transData.transform(t.xy) for t in ax.texts}
    top = ax.get_window_extent(renderer).y1
    plt.close(fig)
    assert set(boxes) == set(arms)
    names = sorted(boxes)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not boxes[a].overlaps(boxes[b]), (a, b)
    for a, box in boxes.items():  # beside its point or stacked just above it, never below or far away
        px, py = points[a]
        assert px < box.x0 < px + 20 and py - 10 < box.y0 < max(py, top) + 60, (a, box, (px, py))


def _error_bars(ax, n_arms: int | None = None):
    """Half-lengths of the error bars in data units, as [BF16 per arm, FP4 per arm] (NaN: no bar)."""
    import numpy as np
    from matplotlib.container import ErrorbarContainer

    half = []
    for c in (c for c in ax.containers if isinstance(c, ErrorbarContainer)):
        cols = c.lines[2]
        segs = cols[0].get_segments() if cols else []
        half.append(abs(segs[0][1][1] - segs[0][0][1]) / 2 if segs else np.nan)
    n = n_arms or len(half) // 2
    return [np.array(half[:n]), np.array(half[n:])]


def test_final_accuracy_error_bars(tmp_path):
    """One seed: binomial standard error over the n evaluation samples; several: std / sqrt(seeds)."""
    import numpy as np

    from figures.plot_runs import eval_sample_counts, final_accuracy_figure
    from figures.style import plt

    runs = _runs(tmp_path, ablations=())
    import pandas as pd

    from analysis.tables import main_table, runs_frame

    main = main_table(runs_frame(runs))
    n = eval_sample_counts(runs)
    fig = final_accuracy_figure(main, n)
    bf16_err, fp4_err = _error_bars(fig.axes[0])
    plt.close(fig)
    assert np.allclose(bf16_err, main["acc_bf16_se"].to_numpy(dtype=float), equal_nan=True)  # the table's SE
    p = main["acc_bf16"].to_numpy(dtype=float)
    one = main.drop(columns=["acc_bf16_se", "acc_fp4_se"])
    fig = final_accuracy_figure(one, {("qwen3_moe-tiny", "reasoning"): 16})
    bf16_err, _ = _error_bars(fig.axes[0])
    plt.close(fig)
    assert np.allclose(bf16_err, np.sqrt(p * (1 - p) / 16), equal_nan=True)  # no SE column, one seed: binomial

    multi = pd.DataFrame({"model": "m", "task": "t", "arm": ["bf16", "trace"], "acc_bf16": [0.5, 0.6],
                          "acc_fp4": [0.4, 0.5], "n_seeds": [3, 3], "acc_bf16_std": [0.03, 0.06],
                          "acc_fp4_std": [0.09, 0.0]})
    fig = final_accuracy_figure(multi, {("m", "t"): 512})
    bf16_err, fp4_err = _error_bars(fig.axes[0])
    plt.close(fig)
    assert np.allclose(bf16_err, np.array([0.03, 0.06]) / np.sqrt(3))
    assert np.allclose(fp4_err, np.array([0.09, 0.0]) / np.sqrt(3))


def test_kernel_figures_draw_the_defaults_and_the_anchor_only(tmp_path, monkeypatch):
    """figures.plot_kernels: of a table with study rows (tile variants, sweeps) and several versions, a MoE panel
    draws our defaults' newest version as lines, an older run's other sizes as rings, the first version dashed and
    the anchor; no study provider."""
    import matplotlib.pyplot as mplt

    import figures.plot_kernels as pk
    from figures import style

    rows = ["version,commit,gpu,date,op,shape,provider,median_us,ratio_vs_bf16,pct_copy_bw"]
    for ver, ts in (("v0", (1, 16, 256)), ("v5", (1, 16)), ("v6", (16, 256))):
        for t in ts:
            rows += [f"{ver},c,H200,d,moe,qwen3 T{t},fp4-w4a16,100,{2 + int(ver[1])/10},30",
                     f"{ver},c,H200,d,moe,qwen3 T{t},fp4-w4a16-pair,120,1.5,25",
                     f"{ver},c,H200,d,moe,qwen3 T{t},triton_kernels-mxfp4,110,2.2,28"]
    rows += ["v6-sweep,c,H200,d,moe-sweep,qwen3 T16,fp4-w4a16,90,3.0,33"]
    (tmp_path / "k.csv").write_text("\n".join(rows) + "\n")
    seen = {}

    def keep(fig, out_dir, name):
        seen[name] = [(t.get_text(), ln.get_linestyle()) for ax in fig.axes
                      for t, ln in zip(ax.get_legend().get_texts(), ax.get_legend_handles_labels()[0], strict=True)]
        mplt.close(fig)
        return [name]

    monkeypatch.setattr(style, "save", keep)
    pk.plot_kernels(str(tmp_path / "k.csv"), str(tmp_path / "out"))
    labels = dict(seen["kernels_moe"])
    assert set(labels) == {"fp4-w4a16 (v6)", "fp4-w4a16 (other sizes: v5)", "fp4-w4a16 (v0, first)",
                           "triton_kernels-mxfp4 (v6)", "triton_kernels-mxfp4 (other sizes: v5)"}, labels
    assert labels["fp4-w4a16 (v6)"] == "-" and labels["fp4-w4a16 (v0, first)"] == "--"
    assert labels["fp4-w4a16 (other sizes: v5)"] == "None"


def test_final_accuracy_axes_are_zoomed_to_the_points_and_bars():
    """Accuracies of 0.37-0.42 are drawn on an axis that starts near them, not at 0, and every point with
    its bar lies inside the axis."""
    import pandas as pd

    from figures.plot_runs import final_accuracy_figure
    from figures.style import plt

    main = pd.DataFrame({"model": "m", "task": "t", "arm": ["bf16", "fp4-naive", "trace"],
                         "acc_bf16": [0.42, 0.41, 0.38], "acc_fp4": [0.40, 0.37, 0.39], "n_seeds": 3,
                         "acc_bf16_se": [0.01, 0.01, 0.01], "acc_fp4_se": [0.01, 0.01, 0.02]})
    fig = final_accuracy_figure(main)
    lo, hi = fig.axes[0].get_ylim()
    plt.close(fig)
    assert 0.3 < lo <= 0.36 and 0.43 <= hi < 0.5, (lo, hi)


def test_panels_wrap_at_three_to_a_row_with_one_legend_above(tmp_path):
    """Eight model/task panels: three to a row (three rows), and the figure's only legend sits above
    every panel."""
    import pandas as pd

    from figures.plot_runs import final_accuracy_figure
    from figures.style import plt

    rows = [{"model": f"m{i}", "task": "t", "arm": a, "acc_bf16": 0.5, "acc_fp4": 0.45, "n_seeds": 1}
            for i in range(8) for a in ("bf16", "trace")]
    fig = final_accuracy_figure(pd.DataFrame(rows), {})
    fig.canvas.draw()
    xs = sorted({round(ax.get_position().x0, 3) for ax in fig.axes})
    ys = sorted({round(ax.get_position().y0, 3) for ax in fig.axes})
    legends = fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    top = max(ax.get_position().y1 for ax in fig.axes)
    box = legends[0].get_window_extent().transformed(fig.transFigure.inverted())
    plt.close(fig)
    assert len(fig.axes) == 8 and len(xs) == 3 and len(ys) == 3
    assert len(legends) == 1 and box.y0 > top


def test_mismatch_curves_hold_the_main_arms_and_the_ablations_their_own_figure(tmp_path, monkeypatch):
    """curves_mismatch draws only the main table's arms; ablation_mismatch draws the ablations with the
    trace and qat-independent references."""
    from figures import plot_runs, style
    from figures.style import plt
    from trace.arms import MAIN_METHODS

    runs = _runs(tmp_path)
    assert any(r.arm not in MAIN_METHODS for r in runs)
    labels = {}

    def keep(fig, out_dir, name):
        labels[name] = {ln.get_label() for ax in fig.axes for ln in ax.get_lines()}
        plt.close(fig)
        return [name]

    monkeypatch.setattr(style, "save", keep)
    plot_runs.plot_mismatch(runs, str(tmp_path))
    plot_runs.plot_ablation_mismatch(runs, str(tmp_path))
    assert labels["curves_mismatch"] and labels["curves_mismatch"] <= set(MAIN_METHODS)
    ablations = {r.arm for r in runs if r.arm not in MAIN_METHODS}
    assert ablations <= labels["ablation_mismatch"]
    assert {"trace (reference)", "qat-independent (reference)"} <= labels["ablation_mismatch"]


def test_a_figure_that_fails_to_save_keeps_the_file_already_there(tmp_path, monkeypatch):
    """The figure is written to a temporary file and renamed over the old one: a crash while saving
    leaves the committed figure byte for byte, and no temporary file."""
    from matplotlib.figure import Figure

    from figures import style
    from figures.style import plt

    style.setup()
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])
    old = style.save(fig, str(tmp_path), "f")
    before = _digest(tmp_path)

    def broken(self, fname, *a, **k):
        with open(fname, "wb") as f:
            f.write(b"partial")
        raise RuntimeError("injected failure while saving")

    monkeypatch.setattr(Figure, "savefig", broken)
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    with pytest.raises(RuntimeError, match="injected"):
        style.save(fig, str(tmp_path), "f")
    assert _digest(tmp_path) == before and len(old) == 2


def test_rollout_breakdown_finds_its_generate_row_among_several_lengths(tmp_path):
    """One run times 1k and 8k generations of the same shape, batch and provider; the breakdown (profiled
    at the 1k run's mean context, prompt + gen / 2) gets the 1k row's wall-clock decode step, not both."""
    import numpy as np

    from figures import plot_rollout, style
    from figures.style import plt

    csv = (ROLLOUT_CSV.splitlines()[0] + "\n"
           "r1,abc,rollout_generate,s,engine-bf16,256,512,1024,40000,5.5,5.9,4,,H200\n"
           "r1,abc,rollout_generate,s,engine-bf16,256,512,8192,30000,7.5,7.9,4,,H200\n"
           "r1,abc,rollout_breakdown,s,engine-bf16,256,1024,64,,,0.006,4,component=attention,H200\n"
           "r1,abc,rollout_breakdown,s,engine-bf16,256,1024,64,,,0.007,4,component=moe,H200\n")
    (tmp_path / "rollout.csv").write_text(csv)
    seen = {}

    def keep(fig, out_dir, name):
        ax = fig.axes[1]
        seen["ticks"] = [ln.get_ydata()[0] for ln in ax.get_lines()]
        plt.close(fig)
        return [name]

    orig = style.save
    style.save = keep
    try:
        plot_rollout.plot_rollout(str(tmp_path), str(tmp_path / "out"))
    finally:
        style.save = orig
    assert np.allclose(seen["ticks"], [5.5])
