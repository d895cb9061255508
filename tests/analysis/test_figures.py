"""figures.plot_all on synthetic run dirs: every figure is written as PNG and PDF, with and without the
tables and the benchmark CSVs, and reruns are byte-identical (so committed figures do not churn)."""
import hashlib

import pytest

from analysis.tables import build
from figures.plot_all import main as plot_all_main
from tests.analysis.synthetic import write_profile

NAMES = ["curves_reward", "curves_mismatch", "flip_rates", "mismatch_vs_bytes", "final_accuracy", "speedups",
         "rollout"]

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
        for ext in ("png", "pdf"):
            p = out / f"{n}.{ext}"
            assert p.exists() and p.stat().st_size > 1000, p
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
