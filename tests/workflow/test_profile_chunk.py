"""scripts/gpu/profile_chunk.sh on the CPU: `start` with a fake nvidia-smi and snakemake in dry-run mode
(SNAKEMAKE_EXTRA=-n), then `wait`: the command line it builds must be one snakemake accepts (a chunk once
failed on a lease because its targets came after `--config`, which took them as config entries)."""
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu" / "profile_chunk.sh"


def _dry_chunk(tmp_path, task="coding", **env_extra):
    """`start` then `wait` a dry-run chunk of qwen3_moe-small's coding task (its SFT base is not committed:
    no checkpoint to rebuild, snakemake starts at once) on one fake GPU x 2 slots.
    -> (start's stdout, the chunk's snakemake.log, the packed archive)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-test)'\n")
    smi.chmod(0o755)
    work = tmp_path / "work"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", WORK=str(work), PYTHON=sys.executable,
               SNAKEMAKE_EXTRA="-n", SLOTS="2", **env_extra)
    start = subprocess.run(["bash", str(SCRIPT), "start", "experiments/profiles/small.yaml", "qwen3_moe-small", task],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert start.returncode == 0, start.stderr
    out = tmp_path / "chunk.tgz"
    wait = subprocess.run(["bash", str(SCRIPT), "wait", "240", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert "finished" in wait.stdout, wait.stdout + wait.stderr
    return start.stdout, (work / "snakemake.log").read_text(), out


def test_start_builds_a_snakemake_call_that_parses(tmp_path):
    started, log, out = _dry_chunk(tmp_path)
    assert "started" in started and "1 GPU(s) x 2 slots" in started
    assert "This was a dry-run" in log and "Error" not in log, log[-2000:]
    assert "results/runs/small/qwen3_moe-small/coding/trace/seed0/eval.json" in log  # a target, not a config entry
    with tarfile.open(out) as t:
        assert "snakemake.log" in t.getnames()


def test_arms_narrows_the_chunk_to_those_arms(tmp_path):
    started, log, _ = _dry_chunk(tmp_path, ARMS="trace")
    assert "started 4 targets" in started, started  # trace x 3 seeds + the SFT base's evaluation
    assert "qwen3_moe-small/coding/trace/seed2/eval.json" in log
    assert "qwen3_moe-small/coding/bf16/seed0" not in log and "fp4-naive" not in log


def test_a_task_list_runs_both_tasks(tmp_path):
    started, log, _ = _dry_chunk(tmp_path, task="coding,long_horizon", ARMS="trace")
    assert "started 8 targets" in started, started  # per task: trace x 3 seeds + the SFT base's evaluation
    assert "qwen3_moe-small/coding/trace/seed2/eval.json" in log
    assert "qwen3_moe-small/long_horizon/trace/seed2/eval.json" in log
    assert "/reasoning/" not in log
