"""scripts/gpu/gpu_tests.sh, the GPU test suite the GPU scripts run first: its file list holds every test file
with a path that only a CUDA device takes, its fast subset selects tests of every one of those files, and on
the CPU (a fake nvidia-smi, a fake python that stands for pytest) a passing suite is recorded and stamped for
this source tree, a failing one stops with exit 1 and no stamp, no GPU is a failure, and SKIP_GPU_TESTS=1 is
said in the record."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu" / "gpu_tests.sh"
GPU_ONLY = re.compile(r"torch\.cuda\.is_available\(\)|\bON_GPU\b|mark\.gpu\b")


def _list(*args) -> list[str]:
    r = subprocess.run(["bash", str(SCRIPT), "list", *args], cwd=ROOT, capture_output=True, text=True, check=True)
    return r.stdout.splitlines()


def _files() -> list[Path]:
    out = []
    for entry in _list():
        p = ROOT / entry
        out += sorted(p.rglob("test_*.py")) if p.is_dir() else [p]
    return out


def test_the_suite_holds_every_test_file_with_a_cuda_only_path():
    suite = set(_files())
    assert all(p.exists() for p in suite)
    gpu_only = {p for p in (ROOT / "tests").rglob("test_*.py") if GPU_ONLY.search(p.read_text())}
    assert gpu_only, "the pattern finds no GPU-only test file"
    assert not gpu_only - suite, f"GPU-only test files missing from gpu_tests.sh: {sorted(gpu_only - suite)}"


def test_each_directory_of_the_suite_is_listed_in_one_stretch():
    """A directory whose files come back after another directory's lost its conftest.py on the GPU image's pytest."""
    dirs = [str(Path(e).parent) if e.endswith(".py") else e for e in _list()]
    stretches = [d for i, d in enumerate(dirs) if i == 0 or d != dirs[i - 1]]
    assert len(stretches) == len(set(stretches)), dirs


def test_the_fast_subset_selects_tests_of_every_file():
    listed = _list("fast")
    files, k = listed[:-1], listed[-1]
    assert k.startswith("-k ")
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "-k", k[3:], *files], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    selected = {line.split("::")[0] for line in r.stdout.splitlines() if "::" in line}
    missing = [str(p.relative_to(ROOT)) for p in _files() if str(p.relative_to(ROOT)) not in selected]
    assert not missing, f"the fast subset selects no test of {missing}"


def _run(tmp_path, *args, gpu=True, **extra):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + ("echo 'GPU 0: NVIDIA H200 (UUID: GPU-test)'\n" if gpu else "exit 9\n"))
    smi.chmod(0o755)
    fake = bin_dir / "fake-python"  # stands for `python -m pytest`: logs its arguments, prints a summary
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$*" >> "$FAKE_LOG"\n'
                    'echo "========== 5 passed in 1.00s =========="\nexit ${FAKE_RC:-0}\n')
    fake.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("SKIP_GPU_TESTS", "GPU_TESTS_K", "GPU_SUITE")}
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON=str(fake), OUT=str(out),
               FAKE_LOG=str(tmp_path / "calls"), GPU_TESTS_PASSED=str(tmp_path / "passed"),
               TRACE_GIT_COMMIT="abc123", **extra)
    r = subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    record = (out / "gpu_tests.txt").read_text().strip() if (out / "gpu_tests.txt").exists() else ""
    calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
    return r, record, calls


def test_a_passing_suite_is_recorded_stamped_and_not_run_again(tmp_path):
    r, record, calls = _run(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert record.startswith("GPU tests (full) passed at commit abc123") and record.endswith("5 passed in 1.00s")
    assert record in r.stdout
    assert len(calls) == 1 and all(f in calls[0].split() for f in _list()) and " -k " not in calls[0]
    assert (tmp_path / "passed").read_text().split()[1] == "full"
    r, record, calls = _run(tmp_path, "fast")  # the full suite covers the fast one
    assert r.returncode == 0 and "passed on this machine already" in record and len(calls) == 1


def test_a_failing_suite_stops_and_is_not_stamped(tmp_path):
    r, record, calls = _run(tmp_path, "fast", FAKE_RC="1", GPU_TESTS_K="moe")
    assert r.returncode == 1
    assert record.startswith("GPU tests (fast, -k moe) FAILED at commit abc123"), record
    fast_k = _list("fast")[-1][3:]
    assert calls[0].endswith(f"-k ({fast_k}) and (moe)"), calls
    assert not (tmp_path / "passed").exists()


def test_no_gpu_fails_and_a_skip_is_recorded(tmp_path):
    r, record, calls = _run(tmp_path, gpu=False)
    assert r.returncode == 1 and "no GPU visible" in record and not calls
    r, record, calls = _run(tmp_path, gpu=False, SKIP_GPU_TESTS="1")
    assert r.returncode == 0 and record == "GPU tests skipped (SKIP_GPU_TESTS=1) at commit abc123" and not calls
