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
    model = next(m for m in plan.config["models"] if m not in plan.config["ablation"]["models"])
    t = plan.targets(model, "reasoning-short")
    runs = [r for r in plan.runs if r.model == model and r.task == "reasoning-short"]
    assert len(runs) == len(plan.config["methods"]) * len(plan.config["seeds"])
    assert t[:-1] == [f"{plan.run_dir(r.model, r.task, r.arm, r.seed)}/eval.json" for r in runs]
    assert t[-1] == f"{plan.sft_dir(model, 'reasoning-short')}/eval.json"


def test_every_task_of_a_model_and_its_ablations():
    plan = _plan("small")
    model = plan.config["ablation"]["models"][0]
    t = plan.targets(model)
    tasks = [k for k, v in plan.config["tasks"].items() if model in v.get("models", plan.config["models"])]
    assert len([p for p in t if p.endswith("sft/eval.json")]) == len(tasks)
    n_abl = len(plan.config["ablation"]["arms"]) * len(plan.config["seeds"])
    assert len([p for p in t if "/trace-rho1/" in p]) == len(plan.config["seeds"]) and len(t) == len(set(t))
    assert len([p for p in t if p.endswith("/eval.json") and "/sft/" not in p]) == (
        len(tasks) * len(plan.config["methods"]) * len(plan.config["seeds"]) + n_abl)


def test_unknown_model_is_an_error():
    with pytest.raises(ValueError, match="no runs"):
        _plan("small").targets("olmoe-small", "coding")


def test_per_seed_sft_bases():
    """sft.per_seed: seed k's runs start from their own base in sft/seed<k>/ (init seed k, data order k), each base
    is evaluated for the learning check, and nothing is shared between two seeds."""
    cfg = yaml.safe_load(open(os.path.join(PROFILES, "smoke.yaml")))
    cfg["sft"] = {"per_seed": True}
    plan = Plan(cfg)
    model, task = plan.model_tasks()[0]
    seeds = plan.config["seeds"]
    assert [plan.sft_dir(model, task, k) for k in seeds] == [f"{plan.runs_dir}/{model}/{task}/sft/seed{k}" for k in seeds]
    confs = [plan.sft_config(model, task, k) for k in seeds]
    assert [c["sft"]["init_seed"] for c in confs] == seeds and [c["seed"] for c in confs] == seeds
    for k in seeds:
        assert plan.run_config(model, task, "trace", k)["rl"]["init_ckpt"] == f"{plan.sft_dir(model, task, k)}/ckpt"
        assert plan.sft_seed(plan.sft_name(k)) == k
    bases = plan.base_evals(model, task)
    assert bases == [f"{plan.sft_dir(model, task, k)}/eval.json" for k in seeds]
    off = yaml.safe_load(open(os.path.join(PROFILES, "smoke.yaml")))
    off["sft"] = {"per_seed": False}
    shared = Plan(off)  # without it: one base, the first seed's, in sft/
    assert shared.sft_dir(model, task, seeds[-1]) == f"{shared.runs_dir}/{model}/{task}/sft"
    assert "init_seed" not in shared.sft_config(model, task, seeds[-1]).get("sft", {}) or \
        shared.sft_config(model, task, seeds[-1]) == shared.sft_config(model, task)
