"""OpenRLHF's whole `train_ppo_ray` on the CPU through our launcher, for the arms bf16, qat-independent, trace.

Each arm is one `python -m trace.integrations.openrlhf.launch` process: Ray with logical GPUs, the
plugin in every worker, our engine actor in place of vLLM, DeepSpeed ZeRO-3 on gloo with every
parameter partitioned (`--zero-persistence-threshold 0`; DeepSpeed's default would partition none of
the tiny model's, and the ZeRO-3 leaf hooks only matter when parameters are released). The run dirs
must be what analysis/ reads (a table row per arm, k3 finite), the trace arm's k3 must be below
qat-independent's (bf16 lowest), and the eval stage must read the checkpoint OpenRLHF saved. Both FP4
arms log per-layer flip rates on every step (from the diagnostic record of all layers, which the
trace arm's rollout sends beside its guidance record), bf16 none, and the trace arm's mean code flip
rate is below qat-independent's (its guided layers replay the rollout's rounding).
About 1.5 minutes per arm on 2 cores, hence slow.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
ARMS = ("bf16", "qat-independent", "trace")
STEPS = 2


def _launch(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "trace.integrations.openrlhf.launch", *map(str, args)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]


@pytest.mark.slow
def test_train_ppo_ray_three_arms(tmp_path, tiny_rl_config):
    cfg = tiny_rl_config(STEPS)
    runs = tmp_path / "runs"
    flips = {}
    for arm in ARMS:
        out = runs / "qwen3_moe-tiny" / "reasoning" / arm / "seed0"
        _launch("--config", cfg, "--out", out, "--gpus", 0, "--zero-persistence-threshold", 0,
                "--set", f"rl.method={arm}")
        lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert [x["step"] for x in lines] == list(range(1, STEPS + 1))
        assert (out / "done").exists() and (out / "ckpt" / "latest").read_text().strip() == f"step_{STEPS:06d}"
        assert json.loads((out / "meta.json").read_text())["kind"] == "rl-openrlhf"
        flips[arm] = [x["code_flip_rate"] for x in lines]
    assert all(not f for f in flips["bf16"])
    assert all(f for a in ("qat-independent", "trace") for f in flips[a])  # every step, every FP4 arm
    assert all(len(f) == len(flips["trace"][0]) for a in ("qat-independent", "trace") for f in flips[a])
    trace_dir = runs / "qwen3_moe-tiny" / "reasoning" / "trace" / "seed0"
    _launch("--stage", "eval", "--config", cfg, "--ckpt", trace_dir, "--out", trace_dir / "eval.json",
            "--set", "rl.method=trace")
    assert "accuracy" in json.loads((trace_dir / "eval.json").read_text())["fp4"]

    from analysis.runs import load_runs, summarize
    rows = {r.arm: summarize(r) for r in load_runs(str(runs))}
    assert sorted(rows) == sorted(ARMS)
    k3 = {a: rows[a]["k3_mean"] for a in ARMS}
    print("k3 mean per arm:", k3)
    assert all(v == v for v in k3.values())  # finite, not NaN
    assert k3["bf16"] < k3["trace"] < k3["qat-independent"]
    code_flips = {a: rows[a]["code_flip_rate"] for a in ("qat-independent", "trace")}
    print("mean code flip rate per arm:", code_flips)
    assert code_flips["trace"] < code_flips["qat-independent"]
    # the analysis reads the same byte and speed columns as for embedded runs
    assert rows["trace"]["guidance_bytes_per_gen_token"] > 0 and rows["bf16"]["guidance_bytes_per_gen_token"] == 0
    assert all(rows[a]["rollout_gen_tokens_per_s"] > 0 for a in ARMS)
