"""scripts/gpu/remote_call.sh on the CPU, as one GPU machine sees it across several calls: a fake nvidia-smi,
snakemake in dry-run mode (SNAKEMAKE_EXTRA=-n), the wheel install already stamped. The first call runs the GPU
test suite (narrowed to one name by GPU_TESTS_K) before it starts the chunk and records its line in the runs'
environment; a second call for the same chunk packs it; a call for another chunk packs the finished one
aside, keeps its SFT checkpoints for the new chunk, and with SKIP_GPU_TESTS=1 says that the suite was skipped."""
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu" / "remote_call.sh"
FAKE_SFT = Path("results/runs/_remote_call_test/m/t/sft/ckpt")  # a checkpoint the finished chunk left behind


def _call(tmp_path, arms, out, **extra):
    out.mkdir()
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", WORK=str(tmp_path / "work"),
               PYTHON=sys.executable, SNAKEMAKE_EXTRA="-n", SLOTS="2", SITE=str(tmp_path / "site"), OUT=str(out),
               GPU_TESTS_K="every_gpu_tile", GPU_TESTS_PASSED=str(tmp_path / "passed"), TRACE_GIT_COMMIT="abc123",
               ARMS=arms, LIMIT="200", **extra)
    r = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "wheels"), "experiments/profiles/small.yaml",
                        "qwen3_moe-small", "coding"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_calls_test_first_pack_hand_over_and_record_a_skipped_suite(tmp_path):
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
        line = (tmp_path / "o1" / "gpu_tests.txt").read_text().strip()
        assert line.startswith("GPU tests (full, -k every_gpu_tile) passed at commit abc123"), line
        assert first.index(line) < first.index("started"), first
        assert (tmp_path / "o1" / "gpu_tests.log").exists() and not (tmp_path / "passed").exists()  # narrowed
        assert f"GPU tests: {line}" in (tmp_path / "work" / "snakemake.log").read_text()  # the runs' environment
        again = _call(tmp_path, "trace", tmp_path / "o2")
        assert "ended; packing it" in again and (tmp_path / "o2" / "chunk.tgz").exists(), again
        (tmp_path / "work" / FAKE_SFT).mkdir(parents=True)
        (tmp_path / "work" / FAKE_SFT / "model.safetensors").write_text("x")
        other = _call(tmp_path, "bf16", tmp_path / "o3", SKIP_GPU_TESTS="1")
        assert "was another one" in other and (tmp_path / "o3" / "prev_chunk.tgz").exists(), other
        assert f"kept {FAKE_SFT}" in other and (ROOT / FAKE_SFT / "model.safetensors").exists()
        assert "started" in other and "GPU tests skipped (SKIP_GPU_TESTS=1) at commit abc123" in other
        assert not (tmp_path / "o3" / "gpu_tests.log").exists()
        assert "SKIP_GPU_TESTS=1" in (tmp_path / "o3" / "gpu_tests.txt").read_text()
    finally:
        shutil.rmtree(ROOT / "results" / "runs" / "_remote_call_test", ignore_errors=True)
