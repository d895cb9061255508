"""analysis.tables on synthetic run dirs (tests/analysis/synthetic.py): every arm present, finite numbers,
posthoc-fp4 derived from the bf16 run, ablation factors read from the run configs, strict mode."""
import math
import os

import pandas as pd
import pytest

from analysis.tables import build
from tests.analysis.synthetic import ABLATIONS, METHODS, write_profile

MAIN_NUM = ["acc_bf16", "acc_fp4", "k3_mean", "k3_final", "guidance_bytes_per_token", "rollout_tokens_per_s",
            "rollout_speedup"]


@pytest.fixture()
def profile(tmp_path):
    runs = tmp_path / "runs" / "smoke"
    keys = write_profile(runs, models=["qwen3_moe-tiny", "mixtral-tiny"], seeds=[0, 1])
    return runs, tmp_path / "tables", keys


def test_main_table_has_every_arm_with_finite_numbers(profile):
    runs, out, _ = profile
    t = build(str(runs), str(out), strict=True)
    main = pd.read_csv(out / "main.csv")
    for model in ("qwen3_moe-tiny", "mixtral-tiny"):
        arms = set(main[main.model == model].arm)
        assert arms == set(METHODS) | {"posthoc-fp4"}
    assert main[MAIN_NUM].notna().all().all()
    assert all(math.isfinite(v) for v in main[MAIN_NUM].to_numpy().ravel())
    assert (main["n_seeds"] == 2).all()
    # posthoc-fp4 is the bf16 policy deployed in FP4
    q = main[main.model == "qwen3_moe-tiny"].set_index("arm")
    assert q.loc["posthoc-fp4", "acc_fp4"] == pytest.approx(q.loc["bf16", "acc_fp4"])
    assert q.loc["bf16", "rollout_speedup"] == pytest.approx(1.0)
    assert q.loc["fp4-naive", "rollout_speedup"] > 1.5
    assert len(t["runs"]) == 2 * 2 * 5 + 2 * len(ABLATIONS)
    md = (out / "main.md").read_text()
    assert "posthoc-fp4" in md and "trace" in md and "n/a" not in md


def test_ablation_table_factors(profile):
    runs, out, _ = profile
    build(str(runs), str(out), strict=True)
    abl = pd.read_csv(out / "ablation.csv").set_index("arm")
    assert set(abl.index) == {"qat-independent", "trace", *ABLATIONS}
    assert abl.loc["trace-rho0.5", "rho"] == 0.5 and abl.loc["trace-rho1", "rho"] == 1.0
    assert abl.loc["trace-fullcodes", "guidance"] == "full codes"
    assert abl.loc["trace", "guidance"] == "mantissa+scale"
    assert not abl.loc["trace-noalign", "align_loss"] and abl.loc["trace", "align_loss"]
    assert not abl.loc["trace-noroutingreplay", "routing_replay"] and abl.loc["trace", "routing_replay"]
    assert abl.loc["trace-rho1", "k3_mean"] < abl.loc["trace", "k3_mean"] < abl.loc["qat-independent", "k3_mean"]
    for c in ("acc_fp4", "k3_mean", "k3_final", "code_flip_rate", "guidance_bytes_per_token"):
        assert abl[c].map(math.isfinite).all(), c
    assert "\\|dlp\\|" in (out / "ablation.md").read_text()


def test_strict_flags_missing_and_unfinished_runs(profile):
    runs, out, _ = profile
    os.remove(runs / "mixtral-tiny" / "reasoning" / "trace" / "seed1" / "eval.json")
    os.remove(runs / "qwen3_moe-tiny" / "reasoning" / "bf16" / "seed0" / "done")
    with pytest.raises(SystemExit, match="problem"):
        build(str(runs), str(out), strict=True)
    build(str(runs), str(out), strict=False)  # non-strict still writes the tables
    assert (out / "main.csv").exists()


def test_discovery_without_manifest(profile):
    runs, out, keys = profile
    os.remove(runs / "manifest.json")
    os.makedirs(runs / "qwen3_moe-tiny" / "reasoning" / "sft" / "ckpt")  # not an RL run
    t = build(str(runs), str(out))
    assert len(t["runs"]) == len(keys)


def test_cli(profile, tmp_path):
    import subprocess
    import sys

    runs, out, _ = profile
    r = subprocess.run([sys.executable, "-m", "analysis.tables", "--runs", str(runs), "--out", str(out), "--strict"],
                       capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert r.returncode == 0, r.stderr
    assert (out / "ablation.md").exists()
