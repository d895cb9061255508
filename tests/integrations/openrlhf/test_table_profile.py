"""The OpenRLHF table's profile (experiments/profiles/openrlhf-small.yaml) and its embedded twin as
scripts/gpu/openrlhf_table.sh writes it: 4 arms x >= 150 RL steps through the OpenRLHF launcher, every run's
train_ppo_ray command (with the profile's openrlhf_flags) accepted by OpenRLHF's parser on one GPU (colocated),
the twin differing only in the RL launcher, its openrlhf_flags and where its runs go, and `snakemake -n` building both DAGs without a GPU."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trace.integrations.openrlhf.flags import merge_user_flags
from trace.integrations.openrlhf.launch import (build_argv, load_run_config, openrlhf_dest_of, parse_with_openrlhf,
                                                prepare_model)

ROOT = Path(__file__).resolve().parents[3]
PROFILE = ROOT / "experiments/profiles/openrlhf-small.yaml"
sys.path.insert(0, str(ROOT / "workflow" / "scripts"))
from runplan import Plan  # noqa: E402


def _twin(tmp_path):
    """Run the script's own profile writer (its first heredoc)."""
    text = (ROOT / "scripts/gpu/openrlhf_table.sh").read_text()
    code = re.search(r"<<'EOF'\n(.*?)\nEOF", text, re.S).group(1)
    subprocess.run([sys.executable, "-", str(PROFILE), str(tmp_path), ""], input=code, text=True, check=True)
    return yaml.safe_load((tmp_path / "openrlhf.yaml").read_text()), yaml.safe_load((tmp_path / "embedded.yaml").read_text())


def test_profile_runs_parse_on_one_gpu(tmp_path):
    prof = yaml.safe_load(PROFILE.read_text())
    assert prof["launcher"]["rl"].startswith("python -m trace.integrations.openrlhf.launch --stage rl")
    plan = Plan(prof)
    dest_of = openrlhf_dest_of()
    assert sorted(r.arm for r in plan.runs) == ["bf16", "fp4-naive", "qat-independent", "trace"]
    for i, r in enumerate(plan.runs):
        path = tmp_path / f"run{i}.yaml"
        path.write_text(yaml.safe_dump(plan.run_config(r.model, r.task, r.arm, r.seed)))
        cfg, data = load_run_config(str(path), [])
        assert cfg["task"]["name"] == "reasoning" and cfg["rl"]["steps"] >= 150 and cfg["rl"]["eval_every"] > 0
        cfg["rl"]["init_ckpt"] = None  # the SFT base does not exist here: the registry model stands in
        argv = build_argv(cfg, tmp_path / f"o{i}", prepare_model(cfg, tmp_path / f"o{i}"), data, gpus=1)
        args = parse_with_openrlhf(merge_user_flags(argv, plan.openrlhf_flags, dest_of))  # + the profile's flags
        assert args.train.colocate_all and args.actor.num_gpus_per_node == 1 and args.ckpt.load_enable
        assert args.ckpt.max_num == 1
        assert args.rollout.max_new_tokens == 96 and args.train.batch_size == 128


@pytest.mark.slow
def test_twin_and_dry_runs(tmp_path):
    orl, emb = _twin(tmp_path)
    assert emb["launcher"] == {"sft": "python -m trace.sft", "rl": "python -m trace.rl", "eval": "python -m trace.eval"}
    assert emb["runs_dir"].endswith("/embedded") and orl["runs_dir"].endswith("/openrlhf")
    assert orl["openrlhf_flags"] and "openrlhf_flags" not in emb  # train_ppo_ray flags: the OpenRLHF side only
    same = {k: v for k, v in emb.items() if k not in ("launcher", "runs_dir", "tables_dir", "figures_dir")}
    assert same == {k: v for k, v in orl.items() if k in same}
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    for name in ("openrlhf", "embedded"):
        d = tmp_path / name
        d.mkdir()
        r = subprocess.run([sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile"), "-n", "all",
                            "--configfile", str(tmp_path / f"{name}.yaml"), "--directory", str(d), "--quiet", "rules"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert re.search(r"^rl\s+4$", r.stdout + r.stderr, re.M)
