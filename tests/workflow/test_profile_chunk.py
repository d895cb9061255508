"""scripts/gpu/profile_chunk.sh on the CPU: `start` with a fake nvidia-smi and snakemake in dry-run mode
(SNAKEMAKE_EXTRA=-n), then `wait`: the command line it builds must be one snakemake accepts (a chunk once
failed on a GPU machine because its targets came after `--config`, which took them as config entries).
The GPU test suite that `start` runs first is skipped (SKIP_GPU_TESTS=1), which the chunk's log says.
Each chunk runs in a copy of the repository's files with qwen3_moe-small's long-horizon and coding run dirs left
out, so that family stands for one whose SFT base is not committed, whatever has been committed since."""
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HIDDEN = ("results/runs/small/qwen3_moe-small/long_horizon", "results/runs/small/qwen3_moe-small/coding")


def _repo_copy(tmp_path) -> Path:
    """The repository's files (no .git, environments or caches) without the HIDDEN run dirs."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(".git", ".venv", ".anchors", ".whl*", "_scr_*",
                                                               ".snakemake", "__pycache__", ".pytest_cache"))
    for d in HIDDEN:
        shutil.rmtree(repo / d, ignore_errors=True)
    return repo


def _run_chunk(tmp_path, models: str, task: str, python: str = sys.executable, **env_extra):
    """`start` then `wait` a dry-run chunk (SNAKEMAKE_EXTRA=-n) on one fake GPU x 2 slots, run by `python`.
    -> (start's stdout, the chunk's work dir, the packed archive)."""
    repo = _repo_copy(tmp_path)
    script = repo / "scripts" / "gpu" / "profile_chunk.sh"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-test)'\n")
    smi.chmod(0o755)
    work = tmp_path / "work"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", WORK=str(work), PYTHON=python,
               SNAKEMAKE_EXTRA="-n", SLOTS="2", SKIP_GPU_TESTS="1", OUT=str(tmp_path), **env_extra)
    start = subprocess.run(["bash", str(script), "start", "experiments/profiles/small.yaml", models, task],
                           cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert start.returncode == 0, start.stderr
    out = tmp_path / "chunk.tgz"
    wait = subprocess.run(["bash", str(script), "wait", "240", str(out)], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=300)
    assert "finished" in wait.stdout, wait.stdout + wait.stderr
    (tmp_path / "wait.txt").write_text(wait.stdout)  # what remote_call.sh prints at its end
    return start.stdout, work, out


def _dry_chunk(tmp_path, task="coding", **env_extra):
    """A dry chunk of qwen3_moe-small's `task` (its SFT base is left out of the copy: no checkpoint to rebuild,
    snakemake starts at once). -> (start's stdout, the chunk's snakemake.log, the packed archive)."""
    started, work, out = _run_chunk(tmp_path, "qwen3_moe-small", task, **env_extra)
    return started, (work / "snakemake.log").read_text(), out


def test_start_builds_a_snakemake_call_that_parses(tmp_path):
    started, log, out = _dry_chunk(tmp_path)
    assert "started" in started and "1 GPU(s) x 2 slots" in started
    assert "GPU tests skipped (SKIP_GPU_TESTS=1)" in started
    assert "GPU tests: GPU tests skipped (SKIP_GPU_TESTS=1)" in log  # the runs' environment (meta.json env)
    assert "This was a dry-run" in log and "Error" not in log, log[-2000:]
    assert "results/runs/small/qwen3_moe-small/coding/trace/seed0/eval.json" in log  # a target, not a config entry
    with tarfile.open(out) as t:
        assert "snakemake.log" in t.getnames()


def test_arms_narrows_the_chunk_to_those_arms(tmp_path):
    started, log, _ = _dry_chunk(tmp_path, ARMS="trace")
    assert "started 4 targets" in started, started  # trace x 3 seeds + the SFT base's evaluation
    assert "qwen3_moe-small/coding/trace/seed2/eval.json" in log
    assert "qwen3_moe-small/coding/bf16/seed0" not in log and "fp4-naive" not in log


def test_seeds_narrow_the_chunk_to_those_seeds(tmp_path):
    started, log, _ = _dry_chunk(tmp_path, ARMS="trace bf16", SEEDS="1")
    assert "started 3 targets" in started, started  # trace and bf16 of seed 1 + the (one) SFT base's evaluation
    assert "qwen3_moe-small/coding/trace/seed1/eval.json" in log and "qwen3_moe-small/coding/bf16/seed1/eval.json" in log
    assert "/seed0/" not in log and "/seed2/" not in log


def test_a_task_list_runs_both_tasks(tmp_path):
    started, log, _ = _dry_chunk(tmp_path, task="coding,long_horizon", ARMS="trace")
    assert "started 8 targets" in started, started  # per task: trace x 3 seeds + the SFT base's evaluation
    assert "qwen3_moe-small/coding/trace/seed2/eval.json" in log
    assert "qwen3_moe-small/long_horizon/trace/seed2/eval.json" in log
    assert "/reasoning/" not in log


_FAKE_PY = """#!/bin/bash
# trace.sft stands in for a rebuild: the committed base's metrics again (line 3's loss changed where the
# config's path contains FAKE_SFT_DIFF) and a checkpoint; everything else is the real interpreter
if [ "$1" = -m ] && [ "$2" = trace.sft ]; then
  cfg=$4; out=$6
  mkdir -p "$out/ckpt" && cp "$(dirname "$cfg")/metrics.jsonl" "$out/"
  case "$cfg" in *"${FAKE_SFT_DIFF:-no such base}"*) sed -i '3s/"loss": [^,]*/"loss": 9.5/' "$out/metrics.jsonl";; esac
  echo fake > "$out/ckpt/model"; echo "${TRACE_SFT_DETERMINISM:-unset}" > "$out/determinism"
  sleep 2; exit 0
fi
exec REAL "$@"
"""


def _rebuild_chunk(tmp_path, models="mixtral-small,qwen3_moe-small", task="long_horizon", rebuilds=1, **env):
    """A dry chunk whose committed SFT bases without their checkpoints are rebuilt by a fake trace.sft; by
    default mixtral-small long-horizon (rebuilt) and qwen3_moe-small long-horizon (its base left out of the copy:
    runs at once)."""
    fake = tmp_path / "fakepy"
    fake.write_text(_FAKE_PY.replace("REAL", sys.executable))
    fake.chmod(0o755)
    started, work, out = _run_chunk(tmp_path, models, task, python=str(fake), **env)
    assert f"{rebuilds} SFT checkpoints to rebuild first" in started, started
    return (work / "snakemake.log").read_text(), work, out


def test_a_rebuilt_base_goes_in_place_before_any_job_starts(tmp_path):
    log, work, out = _rebuild_chunk(tmp_path)
    base = "results/runs/small/mixtral-small/long_horizon/sft"
    assert f"rebuilt {base}" in log and f"SFT rebuild of {base}: identical (20 logged losses)" in log, log[-3000:]
    # no snakemake (the other model's runs included) shares the GPU with the rebuild
    assert log.index(f"rebuilt {base}") < log.index("Building DAG"), log[:3000]
    assert (work / base / "ckpt" / "model").read_text() == "fake\n"
    assert "mixtral-small/long_horizon/trace/seed0/eval.json" in log and "qwen3_moe-small/long_horizon/trace/seed0" in log
    with tarfile.open(out) as t:
        assert f"rebuild/{base}/metrics.jsonl" in t.getnames()
        assert t.extractfile(f"rebuild/{base}/determinism").read() == b"strict\n"  # as its meta.json says


def test_a_base_from_before_the_modes_is_rebuilt_with_pytorchs_choices(tmp_path):
    log, _, out = _rebuild_chunk(tmp_path, "olmoe-small", "reasoning-short")
    base = "results/runs/small/olmoe-small/reasoning-short/sft"
    assert f"SFT rebuild of {base}: identical (20 logged losses)" in log, log[-3000:]
    with tarfile.open(out) as t:  # its meta.json predates the modes: trained with PyTorch's own choices
        assert t.extractfile(f"rebuild/{base}/determinism").read() == b"none\n"


def test_a_rebuild_that_differs_says_where_and_starts_only_the_others(tmp_path):
    log, work, _ = _rebuild_chunk(tmp_path, FAKE_SFT_DIFF="long_horizon")
    base = "results/runs/small/mixtral-small/long_horizon/sft"
    assert f"SFT rebuild of {base}: 1 of 20 logged losses differ, first at line 3" in log, log[-3000:]
    assert "not starting its runs" in log
    said = (tmp_path / "wait.txt").read_text()  # the call's own output says why, not only the packed log
    assert f"SFT rebuild of {base}: 1 of 20 logged losses differ" in said and "an SFT rebuild failed" in said, said
    assert not (work / f"{base}/ckpt").exists()
    assert "qwen3_moe-small/long_horizon/trace/seed0" in log  # the model without a rebuild still runs


def test_a_tolerance_lets_a_close_rebuild_start_its_runs_and_says_so(tmp_path):
    log, work, out = _rebuild_chunk(tmp_path, FAKE_SFT_DIFF="long_horizon", SFT_REBUILD_TOL="20")
    base = "results/runs/small/mixtral-small/long_horizon/sft"
    assert f"SFT rebuild of {base}: within 20: 1 of 20 logged losses differ" in log, log[-3000:]
    assert f"rebuilt {base}" in log and (work / base / "ckpt").exists()
    assert (work / "rebuild" / "notes").read_text().startswith(f"SFT rebuild of {base}: within 20")


def test_a_failed_rebuild_holds_back_only_the_runs_on_that_base(tmp_path):
    log, work, _ = _rebuild_chunk(tmp_path, "mixtral-small", "reasoning-short,long_horizon", rebuilds=2,
                                  FAKE_SFT_DIFF="long_horizon", ARMS="trace")
    base = "results/runs/small/mixtral-small"
    assert f"rebuilt {base}/reasoning-short/sft" in log and f"rebuilt {base}/long_horizon/sft" not in log, log[-3000:]
    assert f"an SFT rebuild failed: not starting {base}/long_horizon/" in log
    assert (work / f"{base}/reasoning-short/sft/ckpt").exists()  # (its runs are all committed: nothing else to do)
    assert f"{base}/long_horizon/trace/seed0" not in log[log.index("Building DAG"):]
