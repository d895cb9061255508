"""Config schema (errors name the key), overrides, run-dir files and the resume truncation of metrics.jsonl."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trace import config as C

ROOT = Path(__file__).resolve().parent.parent


def _write(tmp_path, d) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def test_defaults_validate_and_yaml_floats(tmp_path):
    cfg = C.load_config(_write(tmp_path, {"model": "qwen3_moe-tiny", "rl": {"lr": "3e-4"}}))
    assert cfg["rl"]["lr"] == pytest.approx(3e-4) and isinstance(cfg["rl"]["lr"], float)
    assert cfg["rl"]["method"] == "bf16" and cfg["task"]["name"] == "reasoning-short"
    # YAML 1.1 reads a bare 1e-4 as a string; the loader must still give a number
    p = tmp_path / "d.yaml"
    p.write_text("model: qwen3_moe-tiny\nrl:\n  lr: 1e-4\n")
    assert C.load_config(p)["rl"]["lr"] == pytest.approx(1e-4)


@pytest.mark.parametrize("bad,msg", [
    ({"rl": {"lr": "fast"}}, "config key 'rl.lr': expected number"),
    ({"rl": {"method": "fp8"}}, "config key 'rl.method': expected one of"),
    ({"rl": {"lrr": 1.0}}, "config key 'rl.lrr': unknown key"),
    ({"rl": {"steps": -1}}, "config key 'rl.steps'"),
    ({"rl": {"icepop": [2.0, 0.5]}}, "config key 'rl.icepop'"),
    ({"rl": {"icepop": [0.5]}}, "config key 'rl.icepop'"),
    ({"rl": {"tis_cap": -1}}, "config key 'rl.tis_cap'"),
    ({"rl": {"icepop": [0.5, 2.0]}}, "config key 'rl.icepop': ICEPOP replaces TIS"),
    ({"rl": {"rho": 1.5}}, "config key 'rl.rho'"),
    ({"rl": {"experts": "fast"}}, "config key 'rl.experts'"),
    ({"task": {"name": "poetry"}}, "config key 'task.name'"),
    ({"task": {"n_train": 2.5}}, "config key 'task.n_train': expected integer"),
    ({"wandb": {"mode": "loud"}}, "config key 'wandb.mode'"),
    ({"sft": "yes"}, "config key 'sft': expected object"),
    ({"bogus": 1}, "config key 'bogus': unknown key"),
])
def test_bad_config_names_the_key(tmp_path, bad, msg):
    with pytest.raises(C.ConfigError) as ei:
        C.load_config(_write(tmp_path, {"model": "qwen3_moe-tiny", **bad}))
    assert msg in str(ei.value), str(ei.value)


def test_overrides(tmp_path):
    p = _write(tmp_path, {"model": "qwen3_moe-tiny"})
    cfg = C.load_config(p, ["rl.method=trace", "rl.icepop=[0.5, 2.0]", "rl.tis_cap=null", "rl.lr=5e-5",
                            "task.knobs={max_value: 5}"])
    assert cfg["rl"]["method"] == "trace" and cfg["rl"]["icepop"] == [0.5, 2.0]
    assert cfg["rl"]["tis_cap"] is None and cfg["rl"]["lr"] == pytest.approx(5e-5)
    assert cfg["task"]["knobs"] == {"max_value": 5}
    assert C.load_config(p, ["rl.experts=loop"])["rl"]["experts"] == "loop" and cfg["rl"]["experts"] == "auto"
    with pytest.raises(C.ConfigError, match="config key 'rl.lr'"):
        C.load_config(p, ["rl.lr=abc"])
    with pytest.raises(C.ConfigError, match="key=value"):
        C.load_config(p, ["rl.lr"])


def test_cli_bad_config_exit_code(tmp_path):
    p = _write(tmp_path, {"model": "qwen3_moe-tiny", "rl": {"clip_eps": "wide"}})
    r = subprocess.run([sys.executable, "-m", "trace.rl", "--config", str(p), "--out", str(tmp_path / "run")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "config key 'rl.clip_eps': expected number" in r.stderr


def test_paper_profile_run_configs_validate_with_their_jsonl_keys():
    sys.path.insert(0, str(ROOT / "workflow" / "scripts"))
    from runplan import Plan
    plan = Plan(yaml.safe_load((ROOT / "experiments" / "profiles" / "paper.yaml").read_text()))
    r = plan.runs[0]
    cfg = C.load_config(None, [], base=plan.run_config(r.model, r.task, r.arm, r.seed))
    t = plan.config["tasks"][r.task]
    assert {k: cfg["task"][k] for k in ("train_jsonl", "test_jsonl", "prompt_key", "label_key")} == \
        {k: t[k] for k in ("train_jsonl", "test_jsonl", "prompt_key", "label_key")}


def test_jsonl_keys_from_the_command_line(tmp_path):
    cfg = C.load_config(_write(tmp_path, {"model": "qwen3_moe-tiny"}),
                        ["task.train_jsonl=data/x.jsonl", "task.prompt_key=question"])
    assert cfg["task"]["train_jsonl"] == "data/x.jsonl" and cfg["task"]["prompt_key"] == "question"
    assert cfg["task"]["test_jsonl"] is None  # the default: the generated split
    with pytest.raises(C.ConfigError, match=r"'task.train_jsonl': expected string or null, got 3"):
        C.load_config(None, ["task.train_jsonl=3"])
