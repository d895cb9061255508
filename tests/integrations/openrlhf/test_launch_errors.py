"""Every refusal of `launch` is one line (`error: ...` on stderr, exit status 2, no traceback), and `--dry-run`
writes nothing. OpenRLHF itself is not run: where a path gets that far, run_openrlhf is replaced by a stub that
writes the metrics log a run would leave."""
import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trace.integrations.openrlhf import launch

ROOT = Path(__file__).resolve().parents[3]
CFG = ("model: qwen3_moe-tiny\ntask: {name: reasoning, n_train: 32}\n"
       "rl: {method: trace, steps: 2, prompts_per_step: 2, group_size: 2, init_ckpt: null}\n")


@pytest.fixture
def cfg(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(CFG)
    return path


@pytest.fixture
def ran(monkeypatch):
    """Replaces run_openrlhf: records the argv and writes the metrics.jsonl a finished run leaves."""
    calls = []

    def fake(cfg, argv, out, *a, **k):
        calls.append(argv)
        (out / "metrics.jsonl").write_text('{"step": 1}\n')

    monkeypatch.setattr(launch, "run_openrlhf", fake)
    return calls


def _refused(capsys, argv, *needles):
    with contextlib.redirect_stdout(io.StringIO()):
        rc = launch.main([str(x) for x in argv])
    stderr = capsys.readouterr().err
    # the error is stderr's one line of its own; before it only progress (a resumed run, saving the initial model)
    err = [line for line in stderr.strip().splitlines() if not line.startswith(("[trace] resuming", "Writing model"))]
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in stderr, stderr
    for n in needles:
        assert n in err[0], err[0]
    return err[0]


def test_config_file_errors(tmp_path, capsys):
    out = tmp_path / "o"
    _refused(capsys, ["--config", tmp_path / "missing.yaml", "--out", out, "--gpus", 0], "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [\n")
    _refused(capsys, ["--config", bad, "--out", out, "--gpus", 0], "bad.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    _refused(capsys, ["--config", tmp_path / "list.yaml", "--out", out, "--gpus", 0], "top level must be a mapping")
    assert not out.exists()


def test_schema_and_unsupported_config(cfg, tmp_path, capsys):
    out = tmp_path / "o"
    _refused(capsys, ["--config", cfg, "--out", out, "--gpus", 0, "--set", "rl.lr=fast"], "rl.lr")
    _refused(capsys, ["--config", cfg, "--out", out, "--gpus", 0, "--set", "rl.ppo_ratio=rollout"], "rl.ppo_ratio")
    _refused(capsys, ["--config", cfg, "--out", out, "--gpus", 0, "--set", "model=no_such_model"], "model")
    assert not out.exists()


def test_missing_init_ckpt_names_the_sft_run(cfg, tmp_path, capsys):
    out = tmp_path / "o"
    for extra in ([], ["--dry-run"]):
        _refused(capsys, ["--config", cfg, "--out", out, "--gpus", 0, "--set", "rl.init_ckpt=runs/none/sft", *extra],
                 "rl.init_ckpt: no checkpoint at 'runs/none/sft'", "python -m trace.sft", "--out runs/none/sft")
    assert not out.exists()


def test_launch_option_errors(cfg, tmp_path, capsys):
    out = tmp_path / "o"
    _refused(capsys, ["--config", cfg, "--out", out, "--stage", "eval"], "--ckpt is required")
    _refused(capsys, ["--config", cfg, "--out", out, "--stage", "sft", "--", "--ckpt.max_num", 1], "--stage rl only")
    _refused(capsys, ["--config", cfg, "--out", out, "--gpus", 2, "--ranks", 1], "on GPUs the actor ranks are the GPUs")
    assert not out.exists()


def test_run_dir_conflicts(cfg, tmp_path, capsys, ran):
    """prepare_run_dir (another config in --out) and note_meta (other flags after `--` on a resume)."""
    out = tmp_path / "o"
    assert launch.main(["--config", str(cfg), "--out", str(out), "--gpus", "0", "--", "--ckpt.max_num", "1"]) == 0
    assert len(ran) == 1 and (out / "done").exists()
    (out / "done").unlink()  # a run killed before its end, rerun
    _refused(capsys, ["--config", cfg, "--out", out, "--gpus", 0, "--set", "rl.lr=0.5"], "different config", "rl.lr")
    _refused(capsys, ["--config", cfg, "--out", out, "--gpus", 0, "--", "--ckpt.max_num", 2],
             "openrlhf_user_flags", "resume it as it started")
    assert len(ran) == 1


def test_no_metrics_after_openrlhf(cfg, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(launch, "run_openrlhf", lambda *a, **k: None)
    _refused(capsys, ["--config", cfg, "--out", tmp_path / "o", "--gpus", 0], "no metrics.jsonl")


def test_dry_run_writes_nothing_and_leaves_the_real_launch_free(cfg, tmp_path, capsys, ran):
    out = tmp_path / "o"
    with contextlib.redirect_stdout(io.StringIO()) as stdout:
        assert launch.main(["--config", str(cfg), "--out", str(out), "--gpus", "0", "--dry-run",
                            "--", "--ckpt.max_num", "1"]) == 0
    printed = json.loads(stdout.getvalue())
    assert not out.exists()
    assert printed["args"]["ckpt.max_num"] == 1 and printed["command"][0] == "openrlhf.cli.train_ppo_ray"
    assert printed["args"]["actor.model_name_or_path"] == str((out / "init_model").resolve())
    # the real launch, with other flags after `--`, is not refused because of the dry run
    assert launch.main(["--config", str(cfg), "--out", str(out), "--gpus", "0",
                        "--", "--ckpt.max_num", "2", "--actor.gradient_checkpointing_enable"]) == 0
    assert "--actor.gradient_checkpointing_enable" in ran[0] and ran[0][ran[0].index("--ckpt.max_num") + 1] == "2"
    assert (out / "init_model" / "config.json").exists() and (out / "data" / "train.jsonl").exists()


def test_module_entry_point_one_line_no_warning(tmp_path):
    """`python -m` as the README runs it: a missing SFT base stops with one line and no runpy warning."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-m", "trace.integrations.openrlhf.launch", "--config",
                        "experiments/configs/smoke_rl_reasoning.yaml", "--out", str(tmp_path / "o"),
                        "--set", "rl.init_ckpt=" + str(tmp_path / "sft"), "--gpus", "0", "--", "--ckpt.max_num", "1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: rl.init_ckpt: no checkpoint at"), r.stderr
    assert "python -m trace.sft" in err[0] and not (tmp_path / "o").exists()
