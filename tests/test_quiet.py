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


def test_import_and_model_build_log_no_torchao_or_pytree_noise():
    code = ("import os, trace.rollout, trace.rl.trainer\n"
            "from trace.models import build_model\n"
            "build_model('qwen3_moe-tiny', 0)\n"
            "print(os.environ.get('WANDB_SILENT'))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={k: v for k, v in os.environ.items() if k != "WANDB_SILENT"})
    assert r.returncode == 0, r.stderr
    assert "Failed to load" not in r.stderr and "Enum subclass" not in r.stderr, r.stderr
    assert r.stdout.strip() == "true"


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
    """progress=True (the CLI default) and transformers' checkpoint writer draw no bar when stderr is a
    pipe (a pipeline log); the run itself still completes."""
    code = ("import sys\n"
            "from trace import config as C\n"
            "from trace.sft import run_sft\n"
            "cfg = C.load_config(None, ['wandb.mode=disabled', 'task.n_train=32', 'task.n_test=8',\n"
            "    'sft.batch_size=4', 'sft.steps=3', 'sft.ckpt_every=3', 'sft.log_every=1'])\n"
            "run_sft(cfg, sys.argv[1], progress=True)\n")
    env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "sft")], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "sft" / "done").exists()
    assert "it/s" not in r.stderr and "s/it" not in r.stderr and "\r" not in r.stderr, r.stderr[-500:]


def test_deepspeed_cpu_accelerator_line_is_dropped():
    """On a machine without a GPU, DeepSpeed (pulled in by transformers and the OpenRLHF path) warns that it
    found no accelerator at its first use; after importing the package that line is gone, and DeepSpeed
    still picks its CPU accelerator."""
    code = ("import trace\n"
            "from deepspeed.accelerator import get_accelerator\n"
            "print(get_accelerator()._name)\n")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    if r.stdout.strip() != "cpu":
        import pytest
        pytest.skip("an accelerator is present")
    assert "Setting accelerator to CPU" not in r.stderr, r.stderr
    bare = subprocess.run([sys.executable, "-c", code.replace("import trace\n", "")], cwd="/", capture_output=True,
                          text=True, timeout=300, env=env)
    assert "Setting accelerator to CPU" in bare.stdout + bare.stderr  # the line the filter exists for
