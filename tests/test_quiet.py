"""Start-up and log noise that would alarm a new user: none of it may come back.

Checks: importing the package and building a model logs nothing about torchao's CUDA extensions or
deprecated pytree enums; wandb runs silent unless asked; Snakemake validates the profile schema with
the JSON Schema version it declares (no "No validator found" warning); training progress bars stay out
of non-terminal stderr (the pipeline's per-rule logs).
"""
from __future__ import annotations

import os
import subprocess
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_command_logs_no_torchao_pytree_or_wandb_noise():
    """`python -m trace.eval` imports transformers (and through it torchao) and DeepSpeed's accelerator probe; none
    of their start-up noise reaches stderr, and the command runs with wandb silenced."""
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SILENT"}
    r = subprocess.run([sys.executable, "-m", "trace.eval", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert "Failed to load" not in r.stderr and "Enum subclass" not in r.stderr, r.stderr
    code = "import os, sys; sys.orig_argv[:] = ['python', '-m', 'trace.x']; import trace; print(os.environ['WANDB_SILENT'])"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "true", r.stderr


def test_importing_the_package_changes_nothing():
    """A library import: `import trace` sets no environment variable, and importing its modules installs no log
    filter (the commands do that)."""
    code = ("import logging, os; e = dict(os.environ); import trace\n"
            "assert dict(os.environ) == e, set(os.environ) ^ set(e)\n"
            "import trace.rollout, trace.rl.trainer\n"
            "assert not any(logging.getLogger(n).filters for n in ('torchao', 'torch.utils._pytree', 'DeepSpeed'))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_started_as_command_reads_the_interpreters_arguments():
    from trace.quiet import started_as_command

    assert started_as_command(["python", "-m", "trace.sft", "--config", "c.yaml"])
    assert started_as_command(["python", "-X", "faulthandler", "-m", "trace.rl"])
    assert not started_as_command(["python", "-m", "pytest", "tests/test_sft.py"])
    assert not started_as_command(["python", "-c", "import trace"])
    assert not started_as_command(["python", "script.py", "-m", "trace.sft"])


def test_profile_schema_declares_the_version_snakemake_validates_with():
    from jsonschema import Draft202012Validator  # what snakemake.utils.validate instantiates

    with open(os.path.join(ROOT, "workflow", "schemas", "config.schema.yaml")) as f:
        schema = yaml.safe_load(f)
    assert schema["$schema"] == Draft202012Validator.META_SCHEMA["$schema"]
    Draft202012Validator.check_schema(schema)
    for profile in ("smoke", "small", "small-v2", "paper"):
        with open(os.path.join(ROOT, "experiments", "profiles", f"{profile}.yaml")) as f:
            Draft202012Validator(schema).validate(yaml.safe_load(f))


def test_no_progress_bar_on_non_terminal_stderr(tmp_path):
    """`python -m trace.sft` (progress on, the CLI default) and transformers' checkpoint writer draw no bar when
    stderr is a pipe (a pipeline log); the run itself still completes."""
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(yaml.safe_dump({"wandb": {"mode": "disabled"}, "task": {"n_train": 32, "n_test": 8},
                                   "sft": {"batch_size": 4, "steps": 3, "ckpt_every": 3, "log_every": 1}}))
    env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    r = subprocess.run([sys.executable, "-m", "trace.sft", "--config", str(cfg), "--out", str(tmp_path / "sft")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "sft" / "done").exists()
    assert "it/s" not in r.stderr and "s/it" not in r.stderr and "\r" not in r.stderr, r.stderr[-500:]


def test_deepspeed_cpu_accelerator_line_is_dropped():
    """On a machine without a GPU, DeepSpeed (pulled in by transformers and the OpenRLHF path) warns that it
    found no accelerator at its first use; after `quiet_startup` (what a command runs first) that line is gone,
    and DeepSpeed still picks its CPU accelerator."""
    code = ("from trace.quiet import quiet_startup; quiet_startup()\n"
            "from deepspeed.accelerator import get_accelerator\n"
            "print(get_accelerator()._name)\n")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    if r.stdout.strip() != "cpu":
        import pytest
        pytest.skip("an accelerator is present")
    assert "Setting accelerator to CPU" not in r.stderr, r.stderr
    bare = subprocess.run([sys.executable, "-c", code.split("\n", 1)[1]], cwd="/", capture_output=True,
                          text=True, timeout=300, env=env)
    assert "Setting accelerator to CPU" in bare.stdout + bare.stderr  # the line the filter exists for
