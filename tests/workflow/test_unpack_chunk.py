"""scripts/gpu/unpack_chunk.sh: what comes back from a GPU chunk is put in place only where it is complete
and new (an RL run without its evaluation can never be evaluated: its checkpoint stayed on the GPU machine)."""
import subprocess
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "unpack_chunk.sh"
RUNS = "results/runs/small/m-small/reasoning"


def _write(root: Path, rel: str, text: str = "x") -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def test_unpacks_complete_new_runs_only(tmp_path):
    src, repo = tmp_path / "src", tmp_path / "repo"
    _write(src, f"{RUNS}/sft/done")                          # SFT base: complete with `done`
    _write(src, f"{RUNS}/bf16/seed0/done")                   # RL run with its evaluation
    _write(src, f"{RUNS}/bf16/seed0/eval.json", "{}")
    _write(src, f"{RUNS}/trace/seed0/done")                  # RL run whose evaluation was cut off
    _write(src, f"{RUNS}/trace/seed1/metrics.jsonl")         # a run still going
    _write(src, f"{RUNS}/qat/seed0/done", "new")             # already committed: never overwritten
    _write(src, f"{RUNS}/qat/seed0/eval.json", "new")
    _write(src, "results/runs/small/configs/m-small/reasoning/bf16-seed0.yaml", "new config")
    _write(src, "results/runs/small/configs/m-small/reasoning/qat-seed0.yaml", "new")
    _write(repo, f"{RUNS}/qat/seed0/done", "old")
    _write(repo, "results/runs/small/configs/m-small/reasoning/qat-seed0.yaml", "old")
    with tarfile.open(tmp_path / "chunk.tgz", "w:gz") as t:
        t.add(src / "results", arcname="results")
    out = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "chunk.tgz")], cwd=repo, capture_output=True,
                         text=True, check=True).stdout
    assert (repo / RUNS / "sft/done").exists() and (repo / RUNS / "bf16/seed0/eval.json").exists()
    assert not (repo / RUNS / "trace").exists()
    assert (repo / RUNS / "qat/seed0/done").read_text() == "old"
    assert not (repo / RUNS / "qat/seed0/eval.json").exists()
    configs = repo / "results/runs/small/configs/m-small/reasoning"
    assert (configs / "bf16-seed0.yaml").read_text() == "new config" and (configs / "qat-seed0.yaml").read_text() == "old"
    assert "unpacked 2 run dirs and 1 configs; 1 already here; 1 left out" in out


def test_base_gains_its_later_evaluation_only(tmp_path):
    """A base committed before its evaluation ran gets that evaluation; a different base's never."""
    src, repo = tmp_path / "src", tmp_path / "repo"
    for task, losses in (("reasoning", "same"), ("coding", "other")):
        base = f"results/runs/small/m-small/{task}/sft"
        _write(src, f"{base}/done")
        _write(src, f"{base}/metrics.jsonl", "same")
        _write(src, f"{base}/eval.json", "{}")
        _write(repo, f"{base}/done")
        _write(repo, f"{base}/metrics.jsonl", losses)
    with tarfile.open(tmp_path / "chunk.tgz", "w:gz") as t:
        t.add(src / "results", arcname="results")
    out = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "chunk.tgz")], cwd=repo, capture_output=True,
                         text=True, check=True).stdout
    assert (repo / "results/runs/small/m-small/reasoning/sft/eval.json").exists()
    assert not (repo / "results/runs/small/m-small/coding/sft/eval.json").exists()
    assert "added the base evaluation" in out and "0 run dirs" in out and "2 already here" in out
