"""scripts/gpu/lease_call.sh on the CPU, the way a warm lease sees it across calls: a fake nvidia-smi,
snakemake in dry-run mode (SNAKEMAKE_EXTRA=-n), the wheel install already stamped. A second call for the
same chunk packs it; a call for another chunk packs the finished one aside, keeps its SFT checkpoints for
the new chunk and skips the GPU tests that already passed at this commit on this machine."""
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu" / "lease_call.sh"
FAKE_SFT = Path("results/runs/_lease_test/m/t/sft/ckpt")  # a checkpoint the finished chunk left behind


def _call(tmp_path, arms, out):
    out.mkdir()
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", WORK=str(tmp_path / "work"),
               PYTHON=sys.executable, SNAKEMAKE_EXTRA="-n", SLOTS="2", SITE=str(tmp_path / "site"), OUT=str(out),
               GPU_TESTS="every_gpu_tile", GPU_TESTS_PASSED=str(tmp_path / "passed"), TRACE_GIT_COMMIT="abc123",
               ARMS=arms, LIMIT="200")
    r = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "wheels"), "experiments/profiles/small.yaml",
                        "qwen3_moe-small", "coding"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_calls_pack_hand_over_and_skip_passed_tests(tmp_path):
    (tmp_path / "bin").mkdir()
    for name, body in (("nvidia-smi", "echo 'GPU 0: NVIDIA H200 (UUID: GPU-test)'"), ("python3", f'exec {sys.executable} "$@"')):
        (tmp_path / "bin" / name).write_text(f"#!/bin/sh\n{body}\n")
        (tmp_path / "bin" / name).chmod(0o755)
    (tmp_path / "wheels").mkdir()
    stamp = hashlib.sha256(b"").hexdigest()[:16]  # offline_wheels.sh: hash of the folder's (empty) listing
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / f".installed-{stamp}").touch()
    assert not (ROOT / FAKE_SFT).exists()
    try:
        first = _call(tmp_path, "trace", tmp_path / "o1")
        assert "started" in first and "finished" in first, first
        assert (tmp_path / "o1" / "gpu_tests.log").exists() and (tmp_path / "passed").read_text().strip() == "abc123"
        again = _call(tmp_path, "trace", tmp_path / "o2")
        assert "ended; packing it" in again and (tmp_path / "o2" / "chunk.tgz").exists(), again
        (tmp_path / "work" / FAKE_SFT).mkdir(parents=True)
        (tmp_path / "work" / FAKE_SFT / "model.safetensors").write_text("x")
        other = _call(tmp_path, "bf16", tmp_path / "o3")
        assert "was another one" in other and (tmp_path / "o3" / "prev_chunk.tgz").exists(), other
        assert f"kept {FAKE_SFT}" in other and (ROOT / FAKE_SFT / "model.safetensors").exists()
        assert "started" in other and "passed on this machine at this commit already" in other
        assert not (tmp_path / "o3" / "gpu_tests.log").exists()
    finally:
        shutil.rmtree(ROOT / "results" / "runs" / "_lease_test", ignore_errors=True)
