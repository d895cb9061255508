"""Kill -9 in the middle of an RL run, restart the same command: the metrics must equal those of an
uninterrupted run with the same seed (timings excluded), each step logged exactly once."""
from __future__ import annotations

import os
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
    return [{k: v for k, v in r.items() if k not in TIMING} for r in recs]


@pytest.mark.slow
def test_kill9_resume_identical(tmp_path, sft_ckpt):
    cfg = small_cfg(["rl.method=trace", "rl.steps=6", "rl.ckpt_every=2", "rl.lr=1e-3", "rl.eval_every=3",
                     "rl.prompts_per_step=8"], init_ckpt=sft_ckpt)
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    ref = subprocess.run(_cmd(cfg_path, tmp_path / "a"), cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert ref.returncode == 0, ref.stderr[-2000:]

    out = tmp_path / "b"
    p = subprocess.Popen(_cmd(cfg_path, out), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    metrics = out / "metrics.jsonl"
    t0 = time.time()
    # kill once step 3 is logged (lines: the step-0 eval, steps 1..3): the checkpoint is at step 2, so
    # step 3 must be dropped from the log and redone
    while time.time() - t0 < 500:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 4:
            break
        if p.poll() is not None:
            pytest.fail("run ended before it could be killed")
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert not (out / "done").exists()
    killed_steps = [r["step"] for r in rundir.read_metrics(metrics)]
    assert 3 <= max(killed_steps) < 6, killed_steps

    res = subprocess.run(_cmd(cfg_path, out), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    a = rundir.read_metrics(tmp_path / "a" / "metrics.jsonl")
    b = rundir.read_metrics(metrics)
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in b if "eval_accuracy" in r] == [0, 3, 6]
    assert _strip(a) == _strip(b)
    assert (out / "done").exists()
    assert rundir.latest_checkpoint(out).name == "step_000006"
