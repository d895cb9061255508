"""workflow/scripts/launch.py GPU slots: jobs spread over the visible GPUs, at most K per GPU, each pinned
by CUDA_VISIBLE_DEVICES, slots freed when the holder ends. No GPU is needed: the GPU list comes from
CUDA_VISIBLE_DEVICES and the job is a Python one-liner that writes the variable it was given."""
import os
import subprocess
import sys
import textwrap

import pytest

from workflow.scripts.launch import acquire_gpu_slot, visible_gpus

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_slots_spread_over_gpus_then_fill_them(tmp_path):
    held = [acquire_gpu_slot(["0", "1"], 2, str(tmp_path)) for _ in range(4)]
    assert [g for g, _ in held] == ["0", "1", "0", "1"]  # slot 0 of every GPU before slot 1 of any
    with pytest.raises(TimeoutError):
        acquire_gpu_slot(["0", "1"], 2, str(tmp_path), poll_s=0.01, timeout_s=0.05)
    os.close(held[1][1])  # a job on GPU 1 ends
    assert acquire_gpu_slot(["0", "1"], 2, str(tmp_path), timeout_s=1)[0] == "1"


def test_no_visible_gpu_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no GPU is visible"):
        acquire_gpu_slot([], 1, str(tmp_path))


def test_visible_gpus_reads_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert visible_gpus() == ["2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []


def test_job_runs_pinned_to_its_slot_gpu(tmp_path):
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent("""
        import os, sys
        out = sys.argv[sys.argv.index("--out") + 1]
        os.makedirs(out, exist_ok=True)
        open(os.path.join(out, "gpu"), "w").write(os.environ["CUDA_VISIBLE_DEVICES"])
        open(os.path.join(out, "done"), "w").write("")
    """))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("seed: 0\n")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="4,5", TRACE_GPU_LOCK_DIR=str(tmp_path / "locks"),
               PYTHONPATH=ROOT, TRACE_ALLOW_DIRTY="1")  # the slots, whatever the tree's state
    # one slot per GPU, GPU 4's slot held by this test: the job must land on GPU 5
    _, fd = acquire_gpu_slot(["4"], 1, str(tmp_path / "locks"))
    r = subprocess.run([sys.executable, "-m", "workflow.scripts.launch", "--stage", "rl", "--cmd",
                        f"{sys.executable} {job}", "--config", str(cfg), "--out", str(tmp_path / "run"),
                        "--gpu-slots", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    os.close(fd)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "run" / "gpu").read_text() == "5"
