"""benchmarks/bench_trainer_step.py on the CPU with a tiny model: every (arm, kernels) row is written with
its medians, the ratios against qat-independent and bf16 of the same kernels setting, and a k3 that the
kernel path leaves unchanged."""
import csv

import pytest

from benchmarks.bench_trainer_step import main


@pytest.mark.slow
def test_rows_and_ratios(tmp_path):
    out = tmp_path / "t.csv"
    rows = main(["--profile", "experiments/profiles/smoke.yaml", "--model", "mixtral-tiny", "--task", "reasoning-short",
                 "--arms", "bf16", "qat-independent", "--kernels", "off", "on", "--steps", "2",
                 "--prompts", "2", "--device", "cpu", "--out", str(out)])
    got = [(r["arm"], r["fp4_kernels"]) for r in rows]
    assert got == [("bf16", "auto"), ("qat-independent", "off"), ("qat-independent", "on")]
    for r in rows:
        assert r["train_s"] > 0 and r["rollout_s"] > 0 and r["step_s"] >= r["train_s"]
        assert r["peak_gb"] is None  # no GPU
    assert rows[1]["train_vs_qat_independent"] == 1.0 and rows[2]["train_vs_qat_independent"] == 1.0
    # the kernel path is the reference bit for bit: the same rollout and trainer, the same mismatch
    assert rows[1]["k3_first"] is not None and rows[1]["k3_first"] == rows[2]["k3_first"] and rows[1]["k3"] == rows[2]["k3"]
    assert rows[2]["train_vs_bf16"] == round(rows[2]["train_s"] / rows[0]["train_s"], 3)  # bf16 ran once (auto)
    with open(out, newline="") as f:
        assert [r["fp4_kernels"] for r in csv.DictReader(f)] == ["auto", "off", "on"]


@pytest.mark.slow
def test_processes_at_once(tmp_path):
    """--procs 2: the arm runs in two processes at once; the row has their median times, the throughput of both,
    and the k3 of one process alone (same config and seed: the same first step)."""
    args = ["--profile", "experiments/profiles/smoke.yaml", "--model", "mixtral-tiny", "--task", "reasoning-short",
            "--arms", "qat-independent", "--kernels", "off", "--steps", "2", "--prompts", "2", "--device", "cpu"]
    one = main(args + ["--out", str(tmp_path / "one.csv")])[0]
    two = main(args + ["--procs", "2", "--recompute-experts", "--out", str(tmp_path / "two.csv")])[0]
    assert one["procs"] == 1 and two["procs"] == 2
    # the children got the flag (recomputing changes nothing the step computes: the same first k3)
    assert two["recompute_experts"] is True and one["recompute_experts"] is False
    assert two["steps_per_s"] == round(2 / two["step_s"], 4) and one["steps_per_s"] == round(1 / one["step_s"], 4)
    assert two["k3_first"] == one["k3_first"] and two["train_s"] > 0
