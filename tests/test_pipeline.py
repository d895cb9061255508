"""The Snakemake pipeline: profiles validate, `snakemake -n` builds the full DAG of the small and paper
profiles without a GPU, generated run configs pass the trainer's schema, a bad profile names its key,
and (slow) a reduced smoke pipeline runs end to end with every arm in the tables and finite numbers,
after which a second invocation has nothing to do.

    .venv/bin/python -m pytest tests/test_pipeline.py            # add -m "not slow" to skip the e2e run
"""
from __future__ import annotations

import copy
import json
import math
import os
import re
import subprocess
import sys
import time

import pandas as pd
import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "workflow", "scripts"))
from runplan import Plan  # noqa: E402

SNAKEMAKE = os.path.join(os.path.dirname(sys.executable), "snakemake")
PROFILES = os.path.join(ROOT, "experiments", "profiles")


def _env():
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""  # the DAG must build with no GPU
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = ROOT
    env["TRACE_ALLOW_DIRTY"] = "1"  # pipeline plumbing, whatever the tree's state (launch.py refuses dirty runs)
    return env


def _snakemake(*args, cwd=ROOT, timeout=600):
    return subprocess.run([SNAKEMAKE, "--snakefile", os.path.join(ROOT, "Snakefile"), *args], cwd=cwd,
                          env=_env(), capture_output=True, text=True, timeout=timeout)


def _load(name):
    with open(os.path.join(PROFILES, f"{name}.yaml")) as f:
        return yaml.safe_load(f)


def _job_counts(out: str) -> dict[str, int]:
    stats = out[out.index("Job stats:"):]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", stats, re.M)}


@pytest.mark.parametrize("profile", ["smoke", "small", "small-v2", "paper", "smoke-per-seed-sft"])
def test_dry_run_builds_full_dag(profile, tmp_path):
    # --directory: a scratch workdir, so existing results do not shorten the DAG
    cfg = _load(profile.removesuffix("-per-seed-sft"))
    if profile.endswith("-per-seed-sft"):  # one SFT base per seed (sft.per_seed)
        cfg["sft"] = {"per_seed": True}
    if "align_calibration" in cfg:  # the calibration files the runs read, in a scratch folder
        cfg["align_calibration"]["dir"] = str(_calibration_files(cfg, tmp_path / "cal"))
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = _snakemake("-n", "all", "--configfile", str(path), "--directory", str(tmp_path), "--quiet", "rules")
    assert r.returncode == 0, r.stdout + r.stderr
    counts = _job_counts(r.stdout + r.stderr)
    plan = Plan(cfg)
    n_runs = len(plan.runs)
    assert counts["rl"] == n_runs and counts["eval"] == n_runs
    n_sft = len(plan.model_tasks()) * (len(cfg["seeds"]) if plan.sft_per_seed else 1) if plan.sft_enabled else 0
    assert counts.get("eval_base", 0) == (n_sft if plan.learning else 0)
    n_gated = sum(plan.gated(t) for _, t in plan.model_tasks()) * (len(cfg["seeds"]) if plan.sft_per_seed else 1)
    assert counts.get("eval_base_validation", 0) == n_gated and (profile != "small-v2" or n_gated == 18)
    assert counts.get("sft", 0) == n_sft
    assert counts["tables"] == 1 and counts["plot"] == 1 and counts["bench"] == 2
    cfg = plan.config
    assert n_runs == (len(plan.model_tasks()) * len(cfg["methods"]) * len(cfg["seeds"])
                      + len(cfg["ablation"]["models"]) * len(cfg["ablation"]["tasks"])
                      * len(cfg["ablation"]["arms"]) * len(cfg["ablation"].get("seeds", cfg["seeds"])))


def _calibration_files(cfg: dict, folder) -> str:
    """Calibration files (coefficient 1 at every guided depth the profile's arms read) in `folder`; returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    cal = dict(cfg["align_calibration"], dir=str(folder))
    for rho in Plan(dict(cfg, align_calibration=cal)).calibration_rhos():
        (folder / f"align_calibration_{cal['model']}_rho{rho:g}.json").write_text(
            json.dumps({"model": cal["model"], "rho": rho, "align_coef": 1.0}))
    return str(folder)


def test_small_v2_without_its_calibration_files_stops_naming_them(tmp_path):
    """No trace arm runs at a coefficient typed into the profile: without the calibration files the dry run stops
    with one line naming each missing file; with them every arm with the term reads its depth's coefficient."""
    cfg = _load("small-v2")
    assert "align_coef" not in cfg["defaults"]["rl"]
    cfg["align_calibration"]["dir"] = str(tmp_path / "none")
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = _snakemake("-n", "all", "--configfile", str(path), "--directory", str(tmp_path), "--quiet", "rules")
    assert r.returncode != 0
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: no alignment calibration"), lines
    model = cfg["align_calibration"]["model"]
    assert f"align_calibration_{model}_rho1.json" in lines[0] and f"align_calibration_{model}_rho0.5.json" in lines[0]
    folder = tmp_path / "cal"
    _calibration_files(cfg, folder)
    (folder / f"align_calibration_{model}_rho0.5.json").write_text(
        json.dumps({"model": model, "rho": 0.5, "align_coef": 3.0}))
    plan = Plan(dict(cfg, align_calibration={"model": model, "dir": str(folder)}))
    coefs = {r.arm: plan.run_config(r.model, r.task, r.arm, r.seed)["rl"].get("align_coef") for r in plan.runs}
    assert coefs["trace"] == 1.0 and coefs["trace-deep"] == 3.0
    assert coefs["trace-noalign"] is None and coefs["bf16"] is None and coefs["exact"] is None
    typed = copy.deepcopy(cfg)
    typed["ablation"]["arms"]["trace-deep"]["set"]["rl.align_coef"] = 0.1
    with pytest.raises(ValueError, match="ablation.arms.trace-deep.set"):
        Plan(typed)


def test_committed_tables_of_a_partly_run_profile_do_not_hide_its_missing_runs(tmp_path):
    # one run of the profile done and its tables and figures committed after it: `all` must still
    # schedule every other run (Snakemake calls an existing output that is newer than its existing inputs
    # up to date, without rebuilding its missing ones)
    plan = Plan(_load("small"))
    prof = plan.config["profile"]
    done = plan.runs[0]
    runs = ([f"{plan.run_dir(done.model, done.task, done.arm, done.seed)}/{f}" for f in ("done", "eval.json")]
            + [plan.run_config_path(done.model, done.task, done.arm, done.seed),
               plan.sft_config_path(done.model, done.task), f"{plan.sft_dir(done.model, done.task)}/done"])
    made = ([f"results/tables/{prof}/{n}.{e}" for n in ("main", "ablation", "learning", "gputime", "compare")
             for e in ("csv", "md")]
            + [f"results/tables/{prof}/runs.csv"]
            + [f"figures/{prof}/{n}.{e}" for n in ("curves_reward", "curves_mismatch", "flip_rates",
                                                   "mismatch_vs_bytes", "final_accuracy", "paired_differences",
                                                   "speedups")
               for e in ("png", "pdf")])
    later = time.time() + 60
    for rel in runs + made:
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
        if rel in made:
            os.utime(path, (later, later))
    r = _snakemake("-n", "all", "--configfile", os.path.join(PROFILES, "small.yaml"),
                   "--directory", str(tmp_path), "--quiet", "rules")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Nothing to be done" not in r.stdout + r.stderr
    counts = _job_counts(r.stdout + r.stderr)
    assert counts["rl"] == len(plan.runs) - 1 and counts["tables"] == 1, counts


def test_paper_training_rules_call_the_openrlhf_launcher(tmp_path):
    r = _snakemake("-n", "-p", "all", "--configfile", os.path.join(PROFILES, "paper.yaml"),
                   "--directory", str(tmp_path))
    assert r.returncode == 0, r.stderr
    cmds = [line for line in (r.stdout + r.stderr).splitlines() if "workflow.scripts.launch" in line]
    assert cmds and all("trace.integrations.openrlhf.launch --stage" in c for c in cmds)
    assert not any("CUDA_VISIBLE_DEVICES" in c for c in cmds)  # no device ids hard-coded


def test_profile_openrlhf_flags_reach_train_ppo_ray(tmp_path):
    """openrlhf-small's `openrlhf_flags` follow `--` in every rl job, after --config/--out, and only there;
    workflow/scripts/launch.py hands them on to the OpenRLHF launch after `--` (tests/workflow/test_launch_passthrough.py)."""
    assert _load("openrlhf-small")["openrlhf_flags"] == ["--ckpt.max_num 1"]
    r = _snakemake("-n", "-p", "all", "--configfile", os.path.join(PROFILES, "openrlhf-small.yaml"),
                   "--directory", str(tmp_path))
    assert r.returncode == 0, r.stderr
    cmds = [line for line in (r.stdout + r.stderr).splitlines() if "workflow.scripts.launch" in line]
    rl = [c for c in cmds if "--stage rl" in c]
    assert len(rl) == 4 and all(re.search(r"--out \S+ +-- --ckpt\.max_num 1 >", c) for c in rl), rl
    assert not any(" -- " in c for c in cmds if c not in rl)


@pytest.mark.parametrize("change,needle", [
    ({"launcher": {"rl": "python -m trace.rl"}}, "needs launcher.rl to be the OpenRLHF launch"),
    ({"openrlhf_flags": ["1 --ckpt.max_num"]}, "must start with a flag"),
    ({"openrlhf_flags": ["--ckpt.max_num", 1]}, "openrlhf_flags"),  # the schema: strings only
])
def test_bad_openrlhf_flags_name_the_key(tmp_path, change, needle):
    bad = _load("openrlhf-small")
    for k, v in change.items():
        bad[k] = {**bad[k], **v} if isinstance(v, dict) else v
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(bad))
    r = _snakemake("-n", "all", "--configfile", str(p), "--directory", str(tmp_path))
    assert r.returncode != 0 and needle in r.stdout + r.stderr, r.stdout + r.stderr


@pytest.mark.parametrize("key", ["methods", "gpu"])
def test_bad_profile_names_the_key(tmp_path, key):
    bad = _load("smoke")
    if key == "methods":
        bad["methods"] = ["bf16", "fp8-magic"]  # checked by the run plan against trace/arms.py
    else:
        bad["resources"]["rl"]["gpu"] = -1  # checked by the schema
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(bad))
    r = _snakemake("-n", "all", "--configfile", str(p), "--directory", str(tmp_path))
    assert r.returncode != 0
    assert ("fp8-magic" if key == "methods" else "['gpu']") in r.stdout + r.stderr


@pytest.mark.parametrize("profile", ["smoke", "small", "small-v2"])
def test_generated_configs_pass_the_trainer_schema(profile, tmp_path):
    C = pytest.importorskip("trace.config")
    cfg = _load(profile)
    if "align_calibration" in cfg:
        cfg["align_calibration"]["dir"] = _calibration_files(cfg, tmp_path)
    plan = Plan(cfg)
    for run in plan.runs:
        C.validate(C.deep_merge(C.DEFAULTS, plan.run_config(run.model, run.task, run.arm, run.seed)))
    for model, task in plan.model_tasks():
        C.validate(C.deep_merge(C.DEFAULTS, plan.sft_config(model, task)))


def test_task_models_restrict_the_main_table():
    cfg = _load("small")
    plan = Plan(cfg)
    pairs = {(r.model, r.task) for r in plan.runs if not r.ablation}
    assert ("mixtral-small", "coding") in pairs and ("olmoe-small", "coding") not in pairs
    assert {m for m, t in pairs if t == "reasoning-short"} == set(cfg["models"])
    assert "models" not in plan.run_config("mixtral-small", "coding", "trace", 0)["task"]
    cfg["tasks"]["coding"]["models"] = ["olmoe-tiny"]
    with pytest.raises(ValueError, match="tasks.coding.models"):
        Plan(cfg)


def test_ablation_arms_set_their_keys():
    plan = Plan(_load("smoke"))
    arms = {r.arm: r for r in plan.runs}
    assert {"bf16", "fp4-naive", "qat-independent", "qat-weight-only", "trace", "trace-noalign"} <= set(arms)
    c = plan.run_config("qwen3_moe-tiny", "reasoning-short", "trace-rho1", 0)
    assert c["rl"]["method"] == "trace" and c["rl"]["rho"] == 1.0
    assert c["rl"]["init_ckpt"].endswith("qwen3_moe-tiny/reasoning-short/sft/seed0/ckpt")
    assert plan.run_config("qwen3_moe-tiny", "reasoning-short", "trace-noalign", 0)["rl"]["method"] == "trace-noalign"


def test_task_set_reaches_its_sft_and_runs_only():
    """A task's `set` (the small profile's coding SFT label smoothing) lands in that task's SFT config and
    run configs, leaves the other tasks' configs as they were, and an arm's own `set` still wins."""
    cfg = _load("small")
    assert cfg["tasks"]["coding"]["set"] == {"sft.label_smoothing": 0.1}
    cfg["tasks"]["coding"]["set"]["rl.rho"] = 0.25
    cfg["ablation"]["tasks"] = ["reasoning-short", "coding"]
    plan = Plan(cfg)
    assert plan.sft_config("mixtral-small", "coding")["sft"]["label_smoothing"] == 0.1
    assert plan.sft_config("mixtral-small", "reasoning-short")["sft"]["label_smoothing"] == 0.3
    assert plan.run_config("mixtral-small", "coding", "trace", 0)["rl"]["rho"] == 0.25
    assert plan.run_config("mixtral-small", "reasoning-short", "trace", 0)["rl"]["rho"] == 0.5
    assert plan.run_config("mixtral-small", "coding", "trace-rho1", 0)["rl"]["rho"] == 1.0
    assert "set" not in plan.run_config("mixtral-small", "coding", "trace", 0)["task"]
    jsonschema = pytest.importorskip("jsonschema")
    with open(os.path.join(ROOT, "workflow", "schemas", "config.schema.yaml")) as f:
        schema = yaml.safe_load(f)
    jsonschema.validate(cfg, schema)
    cfg["tasks"]["coding"]["set"] = {"rho": 0.25}  # not a dotted run-config key
    with pytest.raises(jsonschema.ValidationError, match="rho"):
        jsonschema.validate(cfg, schema)


def test_smoke_profile_checks_that_rl_learns(tmp_path):
    """The smoke pipeline checks (and reports in learning.md) whether the bf16 arm's held-out accuracy rises by > 3 prompt-clustered SEs
    over its SFT base. Before: no check, and an SFT block without label smoothing whose base (0.64
    sampled accuracy) RL did not move (0.62 after 60 steps). The SFT base is evaluated with the bf16 run
    config of the first seed, so it sees exactly the final evaluations' prompts and sampling seed."""
    plan = Plan(_load("smoke"))
    assert plan.config["checks"]["learning"] == {"arm": "bf16", "min_se": 3}
    assert plan.config["defaults"]["sft"]["label_smoothing"] > 0
    assert len(plan.config["seeds"]) >= 3
    r = _snakemake("-n", "-p", "all", "--configfile", os.path.join(PROFILES, "smoke.yaml"), "--directory",
                   str(tmp_path))
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert "rule eval_base" in out and "analysis.learning" in out and re.search(r"--min-se 3 --manifest \S+ --strict", out)
    assert "bf16-seed0.yaml --ckpt results/runs/smoke/qwen3_moe-tiny/reasoning-short/sft/seed0/ckpt" in out


# ------------------------------------------------------------------------------------------------
def _reduced_smoke(tmp_path) -> str:
    cfg = copy.deepcopy(_load("smoke"))
    cfg["profile"] = "ci"
    cfg["models"] = ["qwen3_moe-tiny"]
    cfg["tasks"] = {"reasoning-short": {"difficulty": "easy", "n_train": 64, "n_test": 8}}
    cfg["seeds"] = [0]
    cfg["checks"]["learning"]["enforce"] = False  # the check's plumbing only: 3 RL steps learn nothing
    cfg["ablation"] = {"models": ["qwen3_moe-tiny"], "tasks": ["reasoning-short"],
                       "arms": {"trace-noalign": {"method": "trace-noalign"}}}
    d = cfg["defaults"]
    d["sft"].update(steps=20, ckpt_every=20, log_every=10, warmup=2)
    d["rl"].update(steps=3, prompts_per_step=4, group_size=4, ckpt_every=3, eval_every=3)
    d["eval"] = {"samples_per_prompt": 2, "temperature": 1.0}
    cfg["bench"]["mode"] = "skip"
    p = tmp_path / "ci.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return str(p)


@pytest.mark.slow
def test_reduced_smoke_pipeline_end_to_end(tmp_path):
    if not os.path.exists(os.path.join(ROOT, "trace", "rl", "__main__.py")):
        pytest.skip("RL entry point not there yet")
    prof = _reduced_smoke(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    r = _snakemake("all", "--cores", "2", "--configfile", prof, "--directory", str(work), timeout=900)
    logs = ""
    if r.returncode != 0:
        for root, _, files in os.walk(work / "logs"):
            for f in files:
                logs += f"\n== {f}\n" + open(os.path.join(root, f)).read()[-2000:]
    assert r.returncode == 0, r.stderr[-4000:] + logs

    main = pd.read_csv(work / "results" / "tables" / "ci" / "main.csv")
    assert set(main.arm) == {"bf16", "fp4-naive", "qat-independent", "qat-weight-only", "trace", "posthoc-fp4"}
    num = ["acc_bf16", "acc_fp4", "k3_mean", "k3_final", "guidance_bytes_per_gen_token", "rollout_gen_tokens_per_s",
           "rollout_speedup", "record_overhead", "step_s"]
    trained = main[main.arm != "posthoc-fp4"]
    assert all(math.isfinite(v) for v in trained[num].to_numpy(dtype=float).ravel()), trained[num]
    learning = pd.read_csv(work / "results" / "tables" / "ci" / "learning.csv")
    assert list(learning["seed"].astype(str)) == ["0", "mean"] and (learning["n_prompts"] == 8).all()
    abl = pd.read_csv(work / "results" / "tables" / "ci" / "ablation.csv")
    assert {"trace", "trace-noalign", "qat-independent"} <= set(abl.arm)
    for name in ("curves_reward", "curves_mismatch", "flip_rates", "mismatch_vs_bytes", "final_accuracy",
                 "paired_differences", "speedups"):
        assert (work / "figures" / "ci" / f"{name}.png").exists()
    cmp = pd.read_csv(work / "results" / "tables" / "ci" / "compare.csv")
    assert {"trace (FP4)"} <= set(cmp["a"]) and (cmp["n_seeds"] == 1).all()
    bench = (work / "results" / "bench" / "ci" / "kernels.json").read_text()
    assert '"ran": false' in bench

    again = _snakemake("-n", "all", "--configfile", prof, "--directory", str(work))
    assert again.returncode == 0, again.stderr
    assert "Nothing to be done" in again.stdout + again.stderr, again.stdout + again.stderr

    # the `figures` target rebuilds from results/ without training
    fig = _snakemake("figures", "--cores", "1", "--configfile", prof, "--directory", str(work))
    assert fig.returncode == 0, fig.stderr
    assert "rule rl" not in fig.stdout + fig.stderr and "rule sft" not in fig.stdout + fig.stderr
