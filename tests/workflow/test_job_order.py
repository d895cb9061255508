"""The order in which the pipeline starts a chunk's jobs (rule priorities, workflow/scripts/runplan.py): the SFT
base first, a finished run's evaluation before any new run (a run left without its evaluation when the GPU
machine goes away is lost), and the RL runs longest arm first (trace, then the other FP4 arms, then bf16), so a chunk's runs end
close together. Runs the real Snakefile, one job at a time, on a copy of the workflow whose launcher commands
only log their order and leave the outputs the launcher checks."""
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "workflow" / "scripts"))
from runplan import Plan  # noqa: E402

FAKE = """import argparse, json, os
ap = argparse.ArgumentParser()
for k in ("--config", "--out", "--ckpt"):
    ap.add_argument(k)
a, _ = ap.parse_known_args()
with open("order.txt", "a") as f:
    f.write(a.out + "\\n")
if a.ckpt:  # an evaluation: the two deployments' accuracies
    json.dump({"bf16": {"accuracy": 0.5}, "fp4": {"accuracy": 0.5}}, open(a.out, "w"))
else:  # a training run: its checkpoint and the done marker
    os.makedirs(os.path.join(a.out, "ckpt"), exist_ok=True)
    open(os.path.join(a.out, "done"), "w").close()
"""


def test_sft_then_each_evaluation_at_once_then_the_longest_arms_first(tmp_path):
    for name in ("Snakefile", "workflow", "experiments", "trace"):
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
    (tmp_path / "fake.py").write_text(FAKE)
    fake = f"{sys.executable} fake.py"
    overlay = {"launcher": {"sft": fake, "rl": fake, "eval": fake}, "seeds": [0], "ablation": {"seeds": [0]}}
    (tmp_path / "overlay.yaml").write_text(yaml.safe_dump(overlay))
    profile = yaml.safe_load((ROOT / "experiments/profiles/smoke.yaml").read_text())
    profile["seeds"], profile["ablation"]["seeds"] = [0], [0]
    plan = Plan(profile)
    runs = [r for r in plan.runs if r.model == "qwen3_moe-tiny" and r.task == "reasoning-short"]
    targets = [f"{plan.run_dir(r.model, r.task, r.arm, r.seed)}/eval.json" for r in runs]
    targets += plan.base_evals("qwen3_moe-tiny", "reasoning-short")
    r = subprocess.run([sys.executable, "-m", "snakemake", *targets, "--cores", "1", "--scheduler", "greedy",
                        "--configfile", "experiments/profiles/smoke.yaml", str(tmp_path / "overlay.yaml")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    order = (tmp_path / "order.txt").read_text().split()
    sft = plan.sft_dir("qwen3_moe-tiny", "reasoning-short")
    assert order[0] == sft and order[1] == f"{sft}/eval.json", order[:3]
    rl = [o for o in order[2:] if not o.endswith(".json")]
    assert len(rl) == len(runs) >= 9
    for i, o in enumerate(order[2:-1], start=2):  # every run is evaluated before the next run starts
        if not o.endswith(".json"):
            assert order[i + 1] == f"{o}/eval.json", order[i:i + 2]
    arm = {plan.run_dir(x.model, x.task, x.arm, x.seed): x.arm for x in runs}
    prio = [plan.rl_priority(arm[o]) for o in rl]
    assert prio == sorted(prio, reverse=True), list(zip(rl, prio, strict=True))
    assert prio[0] == 3 and prio[-1] == 1 and [arm[o] for o in rl][-1] == "bf16"


def test_priorities_follow_the_arms_costs():
    plan = Plan(yaml.safe_load((ROOT / "experiments/profiles/small.yaml").read_text()))
    p = {a: plan.rl_priority(a) for a in [*plan.arms, *plan.ablation_arms]}
    assert p["bf16"] == 1 and p["fp4-naive"] == 2 and p["qat-independent"] == 2 and p["trace"] == 3
    assert all(v == 3 for a, v in p.items() if a.startswith("trace"))  # the ablation variants are trace runs
