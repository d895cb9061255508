"""A `launch` killed mid-run (SIGKILL of the driver and every process under it: Ray, the actors) and
started again with the same command resumes from OpenRLHF's DeepSpeed checkpoint: metrics.jsonl then
holds each step once, in order (the line of the step after the checkpoint, logged before the kill, is
dropped and redone), and the periodic held-out evaluation lines are where the embedded trainer puts
them (step 0 of the fresh start, every eval_every-th step, the last), with every parameter partitioned
(`--zero-persistence-threshold 0`, so the evaluation's ZeRO-3 gather is real) and gradient checkpointing
passed through after `--` (the guided forward recomputed in backward under replay). Two Ray starts on a CPU:
about 80-105 s on 2 cores, hence slow."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trace import rundir

ROOT = Path(__file__).resolve().parents[3]
STEPS, CKPT_EVERY, EVAL_EVERY = 6, 3, 3


def _cmd(cfg, out):
    return [sys.executable, "-m", "trace.integrations.openrlhf.launch", "--config", str(cfg), "--out", str(out),
            "--gpus", "0", "--zero-persistence-threshold", "0", "--set", "rl.method=trace",
            "--", "--actor.gradient_checkpointing_enable"]  # a user flag, kept by the resumed run


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def _steps(out):
    path = out / "metrics.jsonl"
    return [r["step"] for r in rundir.read_metrics(path)] if path.exists() else []


def _kill_tree(pid):
    import psutil
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)


@pytest.mark.slow
def test_killed_run_resumes_without_duplicate_steps(tmp_path, tiny_rl_config):
    cfg = tiny_rl_config(STEPS, n_test=4, ckpt_every=CKPT_EVERY, eval_every=EVAL_EVERY)
    out = tmp_path / "run"
    log = open(tmp_path / "first.log", "w")
    p = subprocess.Popen(_cmd(cfg, out), cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    try:
        # kill once the step after the first checkpoint is logged: its line must go on resume
        while CKPT_EVERY + 1 not in _steps(out):
            assert p.poll() is None, (tmp_path / "first.log").read_text()[-4000:]
            assert time.time() < deadline, "the first attempt did not reach its third step"
            time.sleep(0.1)
    finally:
        _kill_tree(p.pid)
        log.close()
    before = (out / "metrics.jsonl").read_text().splitlines()
    assert (out / "ckpt" / "deepspeed" / "_actor" / "latest").read_text().strip() == f"global_step{CKPT_EVERY}"
    assert not (out / "done").exists()

    r = subprocess.run(_cmd(cfg, out), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    recs = rundir.read_metrics(out / "metrics.jsonl")
    assert [x["step"] for x in recs] == list(range(0, STEPS + 1))  # once each, in order, none missing
    # resumed, not restarted: the lines up to the checkpoint are the first attempt's, byte for byte
    assert (out / "metrics.jsonl").read_text().splitlines()[:CKPT_EVERY + 1] == before[:CKPT_EVERY + 1]
    evals = [x["step"] for x in recs if x.get("eval_accuracy") is not None]
    assert evals == [0, 3, 6]
    assert all(0.0 <= x["eval_accuracy"] <= 1.0 for x in recs if x["step"] in evals)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["kind"] == "rl-openrlhf" and len(meta["resumes"]) == 1
    assert meta["openrlhf_user_flags"] == ["--actor.gradient_checkpointing_enable"]
    assert "--actor.gradient_checkpointing_enable" in json.loads((out / "openrlhf_argv.json").read_text())
    assert (out / "done").exists() and (out / "ckpt" / "latest").read_text().strip() == f"step_{STEPS:06d}"
