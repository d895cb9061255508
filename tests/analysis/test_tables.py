"""analysis.tables on synthetic run dirs (tests/analysis/synthetic.py): every arm present, finite numbers,
posthoc-fp4 derived from the bf16 run with its training columns n/a, ablation factors read from the run
configs, strict mode, the k3 "final" window, standard errors beside accuracies, generation speed
without recording, seconds per step and trace's step-time overhead over the same seed's qat-independent
run."""
import json
import math
import os

import numpy as np
import pandas as pd
import pytest

from analysis.runs import se_clustered
from analysis.tables import build
from tests.analysis.synthetic import ABLATIONS, METHODS, STEP_S, eval_block, write_profile
from trace.rundir import read_metrics
from trace.stats import two_way_se

MAIN_NUM = ["acc_bf16", "acc_fp4", "reward_final", "response_len", "k3_mean", "k3_final", "guidance_bytes_per_gen_token",
            "rollout_gen_tokens_per_s", "rollout_speedup", "record_overhead", "step_s"]
TRAINING = [c for c in MAIN_NUM if c != "acc_fp4"] + ["step_overhead_vs_qat"]


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
    trained = main[main.arm != "posthoc-fp4"]
    assert all(math.isfinite(v) for v in trained[MAIN_NUM].to_numpy().ravel())
    assert (main["n_seeds"] == 2).all()
    q = main[main.model == "qwen3_moe-tiny"].set_index("arm")
    assert q.loc["bf16", "rollout_speedup"] == pytest.approx(1.0)
    assert q.loc["fp4-naive", "rollout_speedup"] > 1.5
    assert len(t["runs"]) == 2 * 2 * 5 + 2 * len(ABLATIONS)
    md = (out / "main.md").read_text()
    assert "posthoc-fp4" in md and "trace" in md
    # the training reward: the seeds' mean of each run's last-third mean reward (synthetic accuracy 0.2 + 0.05 s
    # + noise < 0.02 over steps 0-7, whose last third is steps 5-7: 0.45 to 0.57)
    r = pd.read_csv(out / "runs.csv")
    r = r[(r.model == "qwen3_moe-tiny") & (r.arm == "trace")]
    assert q.loc["trace", "reward_final"] == pytest.approx(r["reward_final"].mean())
    assert 0.45 <= q.loc["trace", "reward_final"] <= 0.57


def test_posthoc_row_has_only_its_fp4_accuracy(profile):
    """posthoc-fp4 is the bf16 policy evaluated in FP4; before the fix its row repeated the bf16 run's
    k3 (e.g. 2.11e-05) and speedup (1.00x) as if it had been trained and rolled out in FP4."""
    runs, out, _ = profile
    build(str(runs), str(out), strict=True)
    q = pd.read_csv(out / "main.csv").set_index(["model", "arm"]).loc["qwen3_moe-tiny"]
    assert q.loc["posthoc-fp4", "acc_fp4"] == pytest.approx(q.loc["bf16", "acc_fp4"])
    assert q.loc["posthoc-fp4", TRAINING].isna().all()
    row = next(line for line in (out / "main.md").read_text().splitlines() if "| posthoc-fp4 |" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3] == "n/a" and cells[4].startswith(f"{q.loc['bf16', 'acc_fp4']:.3f} ± ")
    assert cells[5:-2] == ["n/a"] * len(TRAINING[1:])  # then seeds and the commits column


def test_accuracy_cells_carry_a_standard_error(profile):
    """Every accuracy is printed as `mean ± SE`; the SE of a seed mean is never below the evaluation's
    own prompt-clustered SE / sqrt(seeds) (synthetic per-prompt accuracies final-0.1, final, final+0.1:
    clustered SE 0.0577 per run)."""
    runs, out, _ = profile
    build(str(runs), str(out), strict=True)
    main = pd.read_csv(out / "main.csv")
    trained = main[main.arm != "posthoc-fp4"]
    assert (trained["acc_bf16_se"] >= 0.0577 / math.sqrt(2) - 1e-4).all()
    for line in (out / "main.md").read_text().splitlines():
        if line.startswith("| qwen3") and "posthoc" not in line:
            cells = [c.strip() for c in line.strip("|").split("|")]
            assert " ± " in cells[3] and " ± " in cells[4], line


def test_k3_final_is_the_last_third_with_its_range(tmp_path):
    """k3 final = mean over the last third of the steps: 6 last steps at 1e-2 among 60 at 1e-4 give
    (6 * 1e-2 + 14 * 1e-4) / 20 = 3.07e-3 (the old last-10% window said 1e-2); with two seeds the
    markdown shows [min, max]."""
    runs = tmp_path / "runs" / "smoke"
    write_profile(runs, models=["qwen3_moe-tiny"], seeds=[0, 1], ablation_models=(), steps=60)
    for seed, spike in ((0, 1e-2), (1, 2e-2)):
        p = runs / "qwen3_moe-tiny" / "reasoning" / "trace" / f"seed{seed}" / "metrics.jsonl"
        recs = read_metrics(str(p))
        for i, r in enumerate(recs):
            r["k3"] = spike if i >= 54 else 1e-4
        p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    build(str(runs), str(tmp_path / "t"), strict=True)
    df = pd.read_csv(tmp_path / "t" / "runs.csv").set_index(["arm", "seed"])
    assert df.loc[("trace", 0), "k3_final"] == pytest.approx((6 * 1e-2 + 14 * 1e-4) / 20)
    assert df.loc[("trace", 1), "k3_final"] == pytest.approx((6 * 2e-2 + 14 * 1e-4) / 20)
    row = next(line for line in (tmp_path / "t" / "main.md").read_text().splitlines() if "| trace |" in line)
    assert "[3.07e-03, 6.07e-03]" in row


def test_speed_is_generation_alone_and_overhead_is_separate(tmp_path):
    """The speed column reads generation-only tokens/s (a run logging 1228 tok/s of generation and
    0.46 recording overhead shows 1228, not 1228 / 1.46 = 842), overhead in its own column."""
    runs = tmp_path / "runs" / "smoke"
    write_profile(runs, models=["qwen3_moe-tiny"], seeds=[0], ablation_models=(), steps=4)
    p = runs / "qwen3_moe-tiny" / "reasoning" / "trace" / "seed0" / "metrics.jsonl"
    recs = read_metrics(str(p))
    for r in recs:
        r["rollout_gen_tokens_per_s"], r["record_overhead"] = 1228.0, 0.46
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    build(str(runs), str(tmp_path / "t"), strict=True)
    main = pd.read_csv(tmp_path / "t" / "main.csv").set_index("arm")
    assert main.loc["trace", "rollout_gen_tokens_per_s"] == pytest.approx(1228.0)
    assert main.loc["trace", "record_overhead"] == pytest.approx(0.46)
    assert "| 1228 |" in (tmp_path / "t" / "main.md").read_text()


def _md_row(path, model: str, arm: str) -> list[str]:
    line = next(line for line in path.read_text().splitlines() if line.startswith(f"| {model} |")
                and f"| {arm} |" in line)
    return [c.strip() for c in line.strip("|").split("|")]


def test_step_time_is_the_median_per_run_and_overhead_pairs_seeds(profile):
    """s/step = median of time_step_s over a run's steps after the warm-up (synthetic: 5x warm-up, then
    the arm's time +-10%; the mean over all 8 steps would be 1.49x the median), mean [min, max] over
    seeds. Seed 1's runs are all 1.5x seed 0's, so trace's overhead is +60% in both seeds only when each
    is divided by its own seed's qat-independent run: against the other seed it would be +7% / +140%,
    against the seed mean +28% / +92%."""
    runs, out, _ = profile
    build(str(runs), str(out), strict=True)
    df = pd.read_csv(out / "runs.csv").set_index(["model", "arm", "seed"]).loc["qwen3_moe-tiny"]
    for seed in (0, 1):
        t = STEP_S["trace"] * (1 + 0.5 * seed)
        assert df.loc[("trace", seed), "step_s"] == pytest.approx(t)
        assert df.loc[("trace", seed), "time_step_s"] == pytest.approx((5 * t + 6.9 * t) / 8)  # runs.csv's mean
        assert df.loc[("qat-independent", seed), "step_s"] == pytest.approx(STEP_S["qat-independent"] * (1 + 0.5 * seed))
        assert df.loc[("trace", seed), "step_overhead_vs_qat"] == pytest.approx(0.6)
        assert df.loc[("trace-fullcodes", seed), "step_overhead_vs_qat"] == pytest.approx(0.8)
    main = pd.read_csv(out / "main.csv").set_index(["model", "arm"]).loc["qwen3_moe-tiny"]
    assert main.loc["trace", ["step_s", "step_s_min", "step_s_max"]].tolist() == pytest.approx([2.0, 1.6, 2.4])
    assert main.loc["trace", "step_overhead_vs_qat"] == pytest.approx(0.6)
    cells = _md_row(out / "main.md", "qwen3_moe-tiny", "trace")
    assert cells[-4:] == ["2.00 [1.60, 2.40]", "+60% [+60%, +60%]", "2", "n/a"]  # no meta.json: no commit
    abl = pd.read_csv(out / "ablation.csv").set_index("arm")
    assert abl.loc["trace-noalign", "step_overhead_vs_qat"] == pytest.approx(0.5)
    assert "+80% [+80%, +80%]" in _md_row(out / "ablation.md", "qwen3_moe-tiny", "trace-fullcodes")


def test_step_overhead_is_na_where_it_does_not_apply(profile):
    """Only arms that guide the rollout get an overhead; posthoc-fp4 has no step time at all."""
    runs, out, _ = profile
    build(str(runs), str(out), strict=True)
    main = pd.read_csv(out / "main.csv").set_index(["model", "arm"])
    for model in ("qwen3_moe-tiny", "mixtral-tiny"):
        for arm in ("bf16", "fp4-naive", "qat-independent", "qat-weight-only", "posthoc-fp4"):
            assert math.isnan(main.loc[(model, arm), "step_overhead_vs_qat"]), (model, arm)
            assert _md_row(out / "main.md", model, arm)[-3] == "n/a", (model, arm)
        assert math.isnan(main.loc[(model, "posthoc-fp4"), "step_s"])
        assert _md_row(out / "main.md", model, "posthoc-fp4")[-3] == "n/a"
        assert main.loc[(model, "bf16"), "step_s"] == pytest.approx((0.5 + 0.75) / 2)
    abl = pd.read_csv(out / "ablation.csv").set_index("arm")
    assert math.isnan(abl.loc["qat-independent", "step_overhead_vs_qat"])
    assert abl.drop(index="qat-independent")["step_overhead_vs_qat"].map(math.isfinite).all()


def test_step_overhead_is_na_without_the_same_seeds_qat_run(profile, capsys):
    """No qat-independent run of that model/task/seed: n/a, and strict mode still passes (mixtral has
    none; qwen3 lacks seed 1's, so its trace row averages seed 0 alone). A run without time_step_s is
    still an error."""
    import shutil

    runs, out, _ = profile
    gone = {("mixtral-tiny", 0), ("mixtral-tiny", 1), ("qwen3_moe-tiny", 1)}
    for model, seed in gone:
        shutil.rmtree(runs / model / "reasoning" / "qat-independent" / f"seed{seed}")
    man = json.loads((runs / "manifest.json").read_text())
    man["runs"] = [e for e in man["runs"] if not (e["arm"] == "qat-independent" and (e["model"], e["seed"]) in gone)]
    (runs / "manifest.json").write_text(json.dumps(man))
    build(str(runs), str(out), strict=True)
    df = pd.read_csv(out / "runs.csv").set_index(["model", "arm", "seed"])
    assert df.loc[("qwen3_moe-tiny", "trace", 0), "step_overhead_vs_qat"] == pytest.approx(0.6)
    assert math.isnan(df.loc[("qwen3_moe-tiny", "trace", 1), "step_overhead_vs_qat"])
    assert math.isnan(df.loc[("mixtral-tiny", "trace", 0), "step_overhead_vs_qat"])
    assert _md_row(out / "main.md", "mixtral-tiny", "trace")[-3] == "n/a"
    assert _md_row(out / "main.md", "mixtral-tiny", "trace")[-4] == "2.00 [1.60, 2.40]"
    assert _md_row(out / "main.md", "qwen3_moe-tiny", "trace")[-3] == "+60% [+60%, +60%]"
    assert pd.read_csv(out / "ablation.csv").set_index("arm").loc["trace-noalign", "step_overhead_vs_qat"] == \
        pytest.approx(0.5)

    for seed in (0, 1):
        p = runs / "mixtral-tiny" / "reasoning" / "trace" / f"seed{seed}" / "metrics.jsonl"
        p.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "time_step_s"}) + "\n"
                             for r in read_metrics(str(p))))
    with pytest.raises(SystemExit, match="problem"):
        build(str(runs), str(out), strict=True)
    assert "mixtral-tiny/reasoning/trace: non-finite step_s" in capsys.readouterr().err


def test_clustered_se_of_prompt_accuracies():
    """sd over prompts / sqrt(prompts): per-prompt accuracies (0, 0.5, 1, 1) -> sd 0.4787, SE 0.2394."""
    assert se_clustered([0.0, 0.5, 1.0, 1.0]) == pytest.approx(0.47871 / 2, rel=1e-4)


def test_an_arms_se_does_not_shrink_with_seeds_that_share_prompts(tmp_path):
    """Every seed scores the same test prompts, so a prompt's difficulty recurs in each: three seeds with the same
    per-prompt accuracies have the SE of one evaluation (the old formula divided it by sqrt(3)), and seeds that
    disagree add their spread; both equal `two_way_se` of the runs' per-prompt matrix."""
    runs = tmp_path / "runs" / "smoke"
    write_profile(runs, models=["qwen3_moe-tiny"], seeds=[0, 1, 2], ablation_models=(), steps=4)
    shared = [0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 0.5, 0.0]
    apart = [[min(1.0, p + 0.25 * k) for p in shared] for k in range(3)]
    for arm, rows in (("bf16", [shared] * 3), ("trace", apart)):
        for seed, pp in enumerate(rows):
            path = runs / "qwen3_moe-tiny" / "reasoning" / arm / f"seed{seed}" / "eval.json"
            ev = json.loads(path.read_text())
            ev["bf16"] = eval_block(pp)
            path.write_text(json.dumps(ev))
    build(str(runs), str(tmp_path / "t"), strict=True)
    main = pd.read_csv(tmp_path / "t" / "main.csv").set_index("arm")
    assert main.loc["bf16", "acc_bf16_se"] == pytest.approx(se_clustered(shared), rel=1e-5)
    assert main.loc["trace", "acc_bf16_se"] == pytest.approx(float(two_way_se(np.array(apart))[1]), rel=1e-5)
    assert main.loc["trace", "acc_bf16_se"] > se_clustered(np.mean(apart, axis=0))


def test_ablation_table_factors(profile):
    runs, out, _ = profile
    build(str(runs), str(out), strict=True)
    abl = pd.read_csv(out / "ablation.csv").set_index("arm")
    assert set(abl.index) == {"qat-independent", "trace", *ABLATIONS}
    assert abl.loc["trace-rho0.5", "rho"] == 0.5 and abl.loc["trace-rho1", "rho"] == 1.0
    assert abl.loc["trace-fullcodes", "guidance"] == "full codes"
    assert abl.loc["trace", "guidance"] == "mantissa+scale"
    assert abl.loc["trace-noalign", "align_coef"] == 0 and abl.loc["trace", "align_coef"] == 0.1
    assert abl.loc["trace-align0.01", "align_coef"] == 0.01
    # the trainer's gradient split: align / rest = 2 x coef in the synthetic runs, n/a without the term
    assert abl.loc["trace", "align_grad_ratio"] == pytest.approx(0.2)
    assert abl.loc["trace-align0.01", "align_grad_ratio"] == pytest.approx(0.02)
    assert all(math.isnan(abl.loc[a, "align_grad_ratio"]) for a in ("qat-independent", "trace-noalign"))
    assert abl.loc["trace", "align_scale_share"] == pytest.approx(0.5)
    assert abl.loc["trace-fullcodes", "align_scale_share"] == pytest.approx(0.1)
    assert all(math.isnan(abl.loc[a, "align_scale_share"]) for a in ("qat-independent", "trace-noalign"))
    assert not abl.loc["trace-noroutingreplay", "routing_replay"] and abl.loc["trace", "routing_replay"]
    assert abl.loc["trace", "align_parts"] == "codes+scales" and abl.loc["trace-alignelements", "align_parts"] == "codes"
    assert abl.loc["trace-noalign", "align_parts"] == "none" and abl.loc["trace-alignelements", "align_scale_share"] == 0
    assert abl.loc["trace-rho1", "k3_mean"] < abl.loc["trace", "k3_mean"] < abl.loc["qat-independent", "k3_mean"]
    for c in ("acc_fp4", "k3_mean", "k3_final", "code_flip_rate", "guidance_bytes_per_gen_token"):
        assert abl[c].map(math.isfinite).all(), c
    assert abl.loc["qat-independent", ["guidance_bits_per_element", "unrecoverable_rate"]].isna().all()
    assert math.isfinite(abl.loc["trace-fullcodes", "unrecoverable_rate"])
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


def test_main_table_shows_the_exact_arms_gradient_k3(tmp_path):
    """The exact arm (an ablation arm) is a row of the main table with its k3 (0) and k3_grad, the k3 of the forward
    whose gradient it takes (mean over steps: 1e-4 * mean(1..8) = 4.5e-4); the column and its note are there only
    where the profile has that arm."""
    from tests.analysis.synthetic import write_run

    runs = tmp_path / "runs" / "smoke"
    write_profile(runs, models=["qwen3_moe-tiny"], seeds=[0], ablations=())
    build(str(runs), str(tmp_path / "without"))
    assert "gradient's forward" not in (tmp_path / "without" / "main.md").read_text()
    write_run(str(runs / "qwen3_moe-tiny" / "reasoning" / "exact" / "seed0"), "qwen3_moe-tiny", "reasoning", "exact",
              "exact", 0)
    man = json.loads((runs / "manifest.json").read_text())
    man["runs"].append({"model": "qwen3_moe-tiny", "task": "reasoning", "arm": "exact", "seed": 0, "method": "exact",
                        "ablation": True})
    (runs / "manifest.json").write_text(json.dumps(man))
    t = build(str(runs), str(tmp_path / "with"))["main"].set_index("arm")
    assert t.loc["exact", "k3_mean"] == 0.0 and t.loc["exact", "k3_grad_mean"] == pytest.approx(4.5e-4)
    assert t["k3_grad_mean"].drop("exact").isna().all()
    md = (tmp_path / "with" / "main.md").read_text()
    assert "| k3 of the gradient's forward |" in md and "| 4.50e-04 |" in md and 'what "exact" covers' in md
