"""Kill -9 or Ctrl-C in the middle of an RL run, restart the same command: the metrics must equal those
of an uninterrupted run with the same seed (timings excluded), each step logged exactly once. Ctrl-C
ends the run with one line (the step it stopped in, the step a rerun resumes from) and exit status 130."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.rl.conftest import small_cfg
from trace import rundir

ROOT = Path(__file__).resolve().parents[2]
TIMING = {"rollout_gen_tokens_per_s", "record_overhead", "time_generate_s", "time_record_s", "time_rollout_s", "time_score_s",
          "time_train_s", "time_step_s"}


def _cmd(cfg_path, out):
    return [sys.executable, "-m", "trace.rl", "--config", str(cfg_path), "--out", str(out), "--no-progress"]


def _strip(recs):
    return [{k: v for k, v in r.items() if k not in TIMING and not k.startswith("time_")} for r in recs]


CFG = ["rl.method=trace", "rl.steps=6", "rl.ckpt_every=2", "rl.lr=1e-3", "rl.eval_every=3", "rl.prompts_per_step=8"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, sft_ckpt):
    """(config path, metrics) of the uninterrupted run."""
    d = tmp_path_factory.mktemp("resume")
    cfg_path = d / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(small_cfg(CFG, init_ckpt=sft_ckpt)))
    ref = subprocess.run(_cmd(cfg_path, d / "a"), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stderr[-2000:]
    return cfg_path, rundir.read_metrics(d / "a" / "metrics.jsonl")


def _interrupt_after_step_3(cfg_path, out, sig):
    """Start the run, send `sig` once step 3 is logged (lines: the step-0 eval, steps 1..3; the checkpoint
    is at step 2, so step 3 must be dropped from the log and redone); (return code, stderr)."""
    p = subprocess.Popen(_cmd(cfg_path, out), cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    t0 = time.time()
    while time.time() - t0 < 500:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 4:
            break
        if p.poll() is not None:
            pytest.fail("run ended before it could be interrupted")
        time.sleep(0.05)
    os.kill(p.pid, sig)
    _, err = p.communicate(timeout=120)
    assert not (out / "done").exists()
    killed_steps = [r["step"] for r in rundir.read_metrics(metrics)]
    assert 3 <= max(killed_steps) < 6, killed_steps
    return p.returncode, err


def _resume_and_compare(cfg_path, out, ref):
    res = subprocess.run(_cmd(cfg_path, out), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    b = rundir.read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in b if "eval_accuracy" in r] == [0, 3, 6]
    assert _strip(ref) == _strip(b)
    assert (out / "done").exists()
    assert rundir.latest_checkpoint(out).name == "step_000006"


@pytest.mark.slow
def test_kill9_resume_identical(tmp_path, reference):
    cfg_path, ref = reference
    rc, _ = _interrupt_after_step_3(cfg_path, tmp_path / "b", signal.SIGKILL)
    assert rc == -signal.SIGKILL
    _resume_and_compare(cfg_path, tmp_path / "b", ref)


@pytest.mark.slow
def test_ctrl_c_one_line_exit_130_and_exact_resume(tmp_path, reference):
    cfg_path, ref = reference
    rc, err = _interrupt_after_step_3(cfg_path, tmp_path / "b", signal.SIGINT)
    assert rc == 130, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    m = re.fullmatch(r"interrupted at step (\d+); rerun the same command to resume from step (\d+)", lines[0])
    assert m, lines[0]
    assert int(m.group(1)) >= 3 and int(m.group(2)) in (3, 5)  # the step after the latest checkpoint (2 or 4)
    _resume_and_compare(cfg_path, tmp_path / "b", ref)
