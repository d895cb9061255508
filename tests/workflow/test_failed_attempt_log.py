"""A job that fails and is retried (`--retries`) keeps each failed attempt's log in LOG.failed: a GPU chunk
once lost the cause of its failed runs because every retry rewrote the log. Runs the real Snakefile on a
copy of the workflow with a launcher command that prints a marker and exits 3."""
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_failed_attempts_are_appended_to_log_failed(tmp_path):
    for name in ("Snakefile", "workflow", "experiments", "trace"):
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
    (tmp_path / "fail.py").write_text("import sys\nprint('attempt failed on purpose')\nsys.exit(3)\n")
    fail = f"{sys.executable} fail.py"  # the rule quotes the launcher command in single quotes
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text(yaml.safe_dump({"launcher": {"sft": fail, "rl": fail, "eval": fail}}))
    target = "results/runs/smoke/qwen3_moe-tiny/reasoning-short/sft/seed0/done"
    r = subprocess.run([sys.executable, "-m", "snakemake", target, "--cores", "1", "--retries", "1",
                        "--configfile", "experiments/profiles/smoke.yaml", str(overlay)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode != 0, "the launcher exits 3: the job must fail"
    failed = tmp_path / "logs/smoke/sft/seed0/qwen3_moe-tiny/reasoning-short.log.failed"
    assert failed.exists(), r.stderr[-3000:]
    text = failed.read_text()
    assert text.count("attempt failed on purpose") == 2, text  # both attempts, the first not overwritten
    assert "[launch] sft failed with exit status 3" in text
