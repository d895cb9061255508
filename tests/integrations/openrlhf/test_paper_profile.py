"""Every run of the paper profile's DAG becomes a train_ppo_ray command that OpenRLHF's parser accepts."""
from pathlib import Path

import yaml

from trace.integrations.openrlhf.launch import build_argv, load_run_config, parse_with_openrlhf, prepare_model
from workflow.scripts.runplan import Plan

ROOT = Path(__file__).resolve().parents[3]


def test_paper_runs_parse(tmp_path):
    prof = yaml.safe_load((ROOT / "experiments/profiles/paper.yaml").read_text())
    assert all(c.startswith("python -m trace.integrations.openrlhf.launch") for c in prof["launcher"].values())
    plan = Plan(prof)
    assert len(plan.runs) >= 60
    for i, r in enumerate(plan.runs):
        path = tmp_path / f"run{i}.yaml"
        path.write_text(yaml.safe_dump(plan.run_config(r.model, r.task, r.arm, r.seed)))
        cfg, data = load_run_config(str(path), [])
        model = prepare_model(cfg, tmp_path / f"out{i}")  # the hub id: nothing is downloaded
        args = parse_with_openrlhf(build_argv(cfg, tmp_path / f"out{i}", model, data, gpus=8))
        assert args.actor.model_name_or_path == model and "/" in model
        assert args.data.prompt_dataset == data["train_jsonl"] and args.data.input_key == data["prompt_key"]
        assert args.train.colocate_all and args.actor.num_gpus_per_node == 8
        assert (args.train.agent_func_path is not None) == (r.task == "long_horizon")
