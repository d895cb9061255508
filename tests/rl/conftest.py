"""Shared fixtures for the RL tests: small configs and one tiny SFT checkpoint built once per pytest run."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from trace import config as C

ROOT = Path(__file__).resolve().parents[2]
ROOT_OVERRIDES = ["wandb.mode=disabled", "threads=2"]
# The SFT base shared by the RL tests = experiments/configs/smoke_sft_reasoning.yaml (qwen3_moe-tiny,
# easy arithmetic, 300 steps, label smoothing 0.3): ~30-60 s on 2 cores.
SFT_CONFIG = "experiments/configs/smoke_sft_reasoning.yaml"
RL_CONFIG = "experiments/configs/smoke_rl_reasoning.yaml"


def small_cfg(extra=(), init_ckpt=None):
    """A very small RL config (fast, for plumbing tests); random-init policy unless init_ckpt is given."""
    ov = ROOT_OVERRIDES + [
        "task.name=reasoning-short", "task.difficulty=easy", "task.n_train=64", "task.n_test=16",
        "rl.steps=4", "rl.prompts_per_step=4", "rl.group_size=4", "rl.max_new_tokens=4", "rl.ckpt_every=2",
        "rl.lr=1e-4", "eval.samples_per_prompt=2",
    ]
    if init_ckpt is not None:
        ov.append(f"rl.init_ckpt={init_ckpt}")
    return C.load_config(None, ov + list(extra))


def smoke_sft(out: Path, extra=()) -> Path:
    """Run SFT_CONFIG (with `extra` overrides, e.g. another model) into `out`; returns `out`."""
    from trace.sft import run_sft
    torch.set_num_threads(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_sft(C.load_config(ROOT / SFT_CONFIG, ROOT_OVERRIDES + list(extra)), out, progress=False)
    return out


@pytest.fixture(scope="session")
def sft_ckpt(tmp_path_factory):
    """Run dir of a short SFT of qwen3_moe-tiny on easy arithmetic (the RL tests' base policy)."""
    return smoke_sft(tmp_path_factory.mktemp("sft") / "run")


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)
