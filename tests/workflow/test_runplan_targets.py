"""Plan.targets: the files that complete one model's part of a profile (scripts/gpu/profile_chunk.sh runs
them as Snakemake targets in one stretch of GPU time)."""
import os

import pytest
import yaml

from workflow.scripts.runplan import Plan

PROFILES = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "profiles")


def _plan(name):
    with open(os.path.join(PROFILES, f"{name}.yaml")) as f:
        return Plan(yaml.safe_load(f))


def test_one_model_and_task():
    plan = _plan("small")
    t = plan.targets("mixtral-small", "reasoning")
    runs = [r for r in plan.runs if r.model == "mixtral-small" and r.task == "reasoning"]
    assert len(runs) == len(plan.config["methods"]) * len(plan.config["seeds"])
    assert t[:-1] == [f"{plan.run_dir(r.model, r.task, r.arm, r.seed)}/eval.json" for r in runs]
    assert t[-1] == f"{plan.sft_dir('mixtral-small', 'reasoning')}/eval.json"


def test_every_task_of_a_model_and_its_ablations():
    plan = _plan("small")
    t = plan.targets("qwen3_moe-small")
    assert len([p for p in t if p.endswith("sft/eval.json")]) == len(plan.config["tasks"])
    assert any("/trace-rho1/" in p for p in t) and len(t) == len(set(t))


def test_unknown_model_is_an_error():
    with pytest.raises(ValueError, match="no runs"):
        _plan("small").targets("olmoe-small", "coding")
