"""Config schema (errors name the key), overrides, run-dir files and the resume truncation of metrics.jsonl."""
from __future__ import annotations

import json
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
    assert cfg["rl"]["method"] == "bf16" and cfg["task"]["name"] == "reasoning"
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


def test_run_dir_and_metrics_truncation(tmp_path):
    cfg = C.load_config(None, [])
    d = C.prepare_run_dir(tmp_path / "run", cfg, kind="rl")
    meta = json.loads((d / "meta.json").read_text())
    for k in ("git_commit", "torch", "transformers", "triton", "hostname", "cpu", "gpu", "python", "start_time"):
        assert k in meta
    assert yaml.safe_load((d / "config.yaml").read_text()) == cfg
    # a restart with the same config is accepted and recorded; a different config is refused
    C.prepare_run_dir(d, cfg, kind="rl")
    assert len(json.loads((d / "meta.json").read_text())["resumes"]) == 1
    with pytest.raises(C.ConfigError, match="different config"):
        C.prepare_run_dir(d, C.load_config(None, ["rl.lr=0.5"]), kind="rl")

    log = C.MetricsLog.open(d, upto_step=None)
    for s in range(1, 6):
        log.log({"step": s, "x": float(s), "d": {1: 0.5}})
    log.close()
    with open(d / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "x":')  # torn by a kill -9
    log = C.MetricsLog.open(d, upto_step=3)
    log.log({"step": 4, "x": 40.0})
    log.close()
    recs = C.read_metrics(d / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3, 4] and recs[-1]["x"] == 40.0
    assert recs[0]["d"] == {"1": 0.5}


def test_resolve_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError):
        C.resolve_checkpoint(tmp_path)
    step = tmp_path / "ckpt" / "step_000003"
    step.mkdir(parents=True)
    (step / "config.json").write_text("{}")
    C.commit_checkpoint(tmp_path, step)
    assert C.resolve_checkpoint(tmp_path) == step
    assert C.resolve_checkpoint(tmp_path / "ckpt") == step
    assert C.resolve_checkpoint(step) == step
