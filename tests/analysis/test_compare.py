"""analysis.compare: arm-vs-arm differences of held-out accuracy, paired by seed and prompt, with the main
table's SE convention, on synthetic eval.json files (tests/analysis/synthetic.py)."""
import json
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from analysis.compare import build, holm, paired
from analysis.runs import se_clustered
from tests.analysis.synthetic import eval_block, write_profile
from trace.stats import two_way_se


def test_paired_difference_and_its_standard_error():
    """Seed 0: A - B per prompt (0.5, 0, 0.5, 0), seed 1: (0, 0, 0.5, 0.5), both +0.25. Seed-averaged per-prompt
    differences (0.25, 0, 0.5, 0.25): prompt component sd 0.2041 / sqrt(4) = 0.1021. The per-seed differences
    agree, so the seed component is 0 (floored): SE 0.1021, t = 2.449 on 1 df, two-sided p = 1 - 2 atan(t) / pi."""
    a = [np.array([0.5, 0.5, 1, 1]), np.array([0.5, 0.5, 1, 1])]
    b = [np.array([0, 0.5, 0.5, 1]), np.array([0.5, 0.5, 0.5, 0.5])]
    r = paired(a, b)
    assert r["diff"] == pytest.approx(0.25) and r["se"] == pytest.approx(0.1021, abs=1e-4)
    assert r["t"] == pytest.approx(2.449, abs=1e-3) and r["df"] == 1 and (r["a_better"], r["n_seeds"]) == (2, 2)
    assert r["p"] == pytest.approx(1 - 2 * math.atan(r["t"]) / math.pi)  # Student's t with 1 df (Cauchy)
    assert r["per_seed"] == "+0.250 +0.250"


def test_seed_spread_dominates_when_seeds_disagree():
    """Every prompt moves by the same amount within a seed (prompt component 0), +0.3 and -0.1 across seeds: the
    SE is the seed spread's, sd 0.2828 / sqrt(2) = 0.2, and only one seed has A > B."""
    a = [np.full(8, 0.6), np.full(8, 0.4)]
    b = [np.full(8, 0.3), np.full(8, 0.5)]
    r = paired(a, b)
    assert r["diff"] == pytest.approx(0.1) and r["se"] == pytest.approx(0.2) and r["a_better"] == 1
    with pytest.raises(ValueError, match="different prompt sets"):
        paired([np.zeros(3)], [np.zeros(4)])


def test_a_prompt_effect_every_seed_shares_does_not_shrink_with_seeds():
    """The same per-prompt difference u in every seed (a prompt easier for A than for B, whatever the seed): more
    seeds measure the same prompts again, so the SE stays the prompt-clustered SE of u (dividing it by the seeds
    would understate it by sqrt(K))."""
    u = np.random.default_rng(0).normal(0.0, 0.2, 64)
    for k in (2, 5):
        r = paired([0.5 + u] * k, [np.full(64, 0.5)] * k)
        assert r["se"] == pytest.approx(se_clustered(u), rel=1e-9) and r["df"] == k - 1


def test_one_seed_is_not_tested():
    r = paired([np.array([1.0, 0.5, 1.0])], [np.array([0.0, 0.5, 0.5])])
    assert r["diff"] == pytest.approx(0.5) and r["df"] == 0 and math.isnan(r["p"]) and math.isnan(r["p_equiv"])
    t = holm(pd.DataFrame([{"diff": 0.5, "se": r["se"], "df": 0, "p": r["p"]}]))
    assert t["verdict"].tolist() == ["not tested"] and math.isnan(t["lo_sim"].iloc[0])


def _draw(rng, reps, seeds, prompts, seed_sd, arm_prompt_sd, samples):
    """A - B of `reps` synthetic profiles under the null (both arms equal in expectation): prompts of accuracy
    U(0.2, 0.8) shared by every seed and arm, a per-arm per-prompt effect (sd arm_prompt_sd) shared by every
    seed, a per-arm per-seed effect (sd seed_sd), `samples` samples per prompt. -> [reps, seeds, prompts]."""
    base = rng.uniform(0.2, 0.8, (reps, 1, 1, prompts))
    u = rng.normal(0.0, arm_prompt_sd, (reps, 2, 1, prompts))
    s = rng.normal(0.0, seed_sd, (reps, 2, seeds, 1))
    acc = rng.binomial(samples, np.clip(base + u + s, 0.0, 1.0)) / samples
    return acc[:, 0] - acc[:, 1]


def _rejects(d):
    """The comparison's two-sided test at 0.05 (`two_way_se`, t at seeds - 1 df), per synthetic profile."""
    diff, se = two_way_se(d)
    return np.abs(diff / se) > stats.t.isf(0.025, d.shape[1] - 1)


def _normal_reference(d):
    """The former test: normal reference, SE sqrt(max(seed variance, mean per-seed prompt SE^2) / seeds)."""
    per_seed = d.mean(2)
    se = np.sqrt(np.maximum(per_seed.var(1, ddof=1), (d.var(2, ddof=1) / d.shape[2]).mean(1)) / d.shape[1])
    return np.abs(per_seed.mean(1) / se) > 1.96


def test_false_positive_rate_at_three_seeds():
    """Monte Carlo under the null at 3 seeds, per-arm seed sd 0.03, prompts shared by every seed (4,000 synthetic
    profiles, fixed generator seed): the test's false-positive rate is 5% +- 2 points (4.0% at this seed), where
    a normal reference with the SE divided by the seeds rejects 18.4%. Where the arms differ prompt by prompt
    the same way in every seed and the seeds not at all, t at 2 df is conservative (0 of 2,000 profiles), the
    normal reference rejects 14.8%."""
    rng = np.random.default_rng(20240601)
    d = _draw(rng, 4000, 3, 256, seed_sd=0.03, arm_prompt_sd=0.02, samples=32)
    rate = _rejects(d).mean()
    assert 0.03 <= rate <= 0.07, rate
    assert _normal_reference(d).mean() > 0.12
    d = _draw(rng, 2000, 3, 256, seed_sd=0.0, arm_prompt_sd=0.1, samples=16)
    assert _rejects(d).mean() <= 0.07 and _normal_reference(d).mean() > 0.10


def test_table_pairs_seeds_and_deployments(tmp_path):
    """trace (FP4) - qat-independent (FP4) over the seeds both have; ablation arms are never compared; the
    bf16 arm's FP4 block is the posthoc comparison."""
    runs = tmp_path / "runs" / "smoke"
    write_profile(runs, models=["qwen3_moe-tiny"], seeds=[0, 1], steps=2)
    base = runs / "qwen3_moe-tiny" / "reasoning"
    for arm, dep, pp in (("trace", "fp4", [0.5, 0.75, 1.0]), ("qat-independent", "fp4", [0.25, 0.5, 1.0]),
                         ("bf16", "fp4", [0.5, 0.5, 0.5])):
        for seed in (0, 1):
            p = base / arm / f"seed{seed}" / "eval.json"
            ev = json.loads(p.read_text())
            ev[dep] = eval_block(pp)
            p.write_text(json.dumps(ev))
    (base / "qat-independent" / "seed1" / "eval.json").unlink()
    t = build(str(runs), str(tmp_path / "t")).set_index(["a", "b"])
    row = t.loc[("trace (FP4)", "qat-independent (FP4)")]
    assert row["n_seeds"] == 1 and row["diff"] == pytest.approx(1 / 6)
    assert t.loc[("trace (FP4)", "bf16 (FP4)"), "diff"] == pytest.approx(0.25)
    assert not any("rho" in a or "rho" in b for a, b in t.index)
    md = (tmp_path / "t" / "compare.md").read_text()
    assert "| qwen3_moe-tiny | reasoning | trace (FP4) | qat-independent (FP4) | 3 |" in md
    assert len({ln.count("|") for ln in md.splitlines() if ln.startswith("|")}) == 1  # header, rule, rows agree


def test_no_pair_still_writes_a_readable_table(tmp_path):
    """A profile without two arms to pair writes compare.csv with its header (the figure reads it back)."""
    runs = tmp_path / "runs" / "smoke"
    runs.mkdir(parents=True)
    t = build(str(runs), str(tmp_path / "t"))
    assert t.empty
    back = pd.read_csv(tmp_path / "t" / "compare.csv")
    assert back.empty and {"a", "b", "diff", "se"} <= set(back.columns)


def test_prompt_groups_split_each_comparison(tmp_path):
    """Long-horizon comparisons within each bisection-guesses group: the groups partition the held-out prompts
    of the run config, and the prompt-weighted mean of a comparison's group differences is its difference."""
    import yaml

    from trace.episode import build_task, heldout_examples
    from trace.tasks.long_horizon import bisection_guesses

    runs = tmp_path / "runs" / "smoke"
    write_profile(runs, models=["mixtral-tiny"], tasks=("long_horizon",), seeds=[0, 1], ablations=(), steps=2)
    base = runs / "mixtral-tiny" / "long_horizon"
    cfg = None
    rng = np.random.default_rng(0)
    for arm in ("trace", "qat-independent", "fp4-naive", "bf16"):
        for seed in (0, 1):
            d = base / arm / f"seed{seed}"
            cfg = yaml.safe_load((d / "config.yaml").read_text())
            cfg["eval"] = {"n_test": 0, "samples_per_prompt": 4, "temperature": 1.0, "max_new_tokens": 16, "seed": 1,
                           "split": "test"}
            (d / "config.yaml").write_text(yaml.safe_dump(cfg))
            n = len(heldout_examples(cfg, build_task(cfg)))
            ev = json.loads((d / "eval.json").read_text())
            for dep in ("bf16", "fp4"):
                ev[dep] = eval_block((rng.integers(0, 5, n) / 4).tolist())
            (d / "eval.json").write_text(json.dumps(ev))
    t = build(str(runs), str(tmp_path / "t")).set_index(["a", "b"])
    g = pd.read_csv(tmp_path / "t" / "compare_groups.csv")
    labels = sorted({bisection_guesses(e) for e in heldout_examples(cfg, build_task(cfg))})
    assert sorted(g["group"].unique()) == [f"bisection guesses = {v}" for v in labels] and len(labels) > 1
    for (a, b), rows in g.groupby(["a", "b"]):
        assert rows["n_prompts"].sum() == t.loc[(a, b), "n_prompts"]
        weighted = (rows["diff"] * rows["n_prompts"]).sum() / rows["n_prompts"].sum()
        assert weighted == pytest.approx(t.loc[(a, b), "diff"], abs=1e-5)  # the CSV keeps 6 significant digits
    assert "| bisection guesses = 1 | trace (FP4) | qat-independent (FP4) |" in (tmp_path / "t" / "compare_groups.md").read_text()


def _family(z):
    """holm() on a table of normal statistics z (df = inf), SE 0.01."""
    z = np.asarray(z, dtype=float)
    return holm(pd.DataFrame({"diff": z * 0.01, "se": 0.01, "df": np.inf, "p": 2 * stats.norm.sf(np.abs(z))}))


def test_holm_adjusts_over_the_whole_table():
    """Holm's step-down: the smallest p is multiplied by m, the next by m - 1, ... (kept monotone); the verdict
    is its decision at family-wise 0.05, with the difference's sign."""
    z = np.array([3.5, -2.6, 2.2, 0.4, -1.0])
    t = _family(z)
    p = t["p"].to_numpy()
    # ranks by p: 3.5 (x5), 2.6 (x4), 2.2 (x3), 1.0 (x2), 0.4 (x1), with the running maximum
    expect = np.maximum.accumulate([min(1, 5 * p[0]), min(1, 4 * p[1]), min(1, 3 * p[2]), min(1, 2 * p[4]), min(1, p[3])])
    assert np.allclose(t["p_holm"].to_numpy()[[0, 1, 2, 4, 3]], expect)
    # 2.2 would pass uncorrected (p 0.028), not at x3
    assert t["verdict"].tolist() == ["higher", "lower", "no difference detected", "no difference detected",
                                     "no difference detected"]


def test_verdicts_and_simultaneous_intervals_agree():
    """z = (2.33, 2.26, 0.1): Holm's first step needs p < 0.05 / 3 (|z| > 2.39), so it rejects nothing, and no
    Bonferroni interval (± 2.39 SE) excludes 0 (the level Holm would test 2.26 at had it reached it, 0.05 / 2,
    gave an interval without 0 beside a decision without a rejection). In general an interval that excludes 0
    comes with a Holm verdict of its sign; Holm can decide where the interval still touches 0 (z = 2.1 of
    (3.5, 3.0, 2.1): tested at 0.05 after two rejections)."""
    t = _family([2.33, 2.26, 0.1])
    assert (t["verdict"] == "no difference detected").all()
    assert ((t["lo_sim"] < 0) & (t["hi_sim"] > 0)).all()
    assert t["hi_sim"].iloc[0] - t["diff"].iloc[0] == pytest.approx(stats.norm.isf(0.05 / 6) * 0.01)
    rng = np.random.default_rng(0)
    for _ in range(200):
        t = _family(rng.normal(0.0, 2.5, rng.integers(1, 12)))
        assert (t.loc[t["lo_sim"] > 0, "verdict"] == "higher").all()
        assert (t.loc[t["hi_sim"] < 0, "verdict"] == "lower").all()
    t = _family([3.5, 3.0, 2.1])
    assert t["verdict"].tolist() == ["higher"] * 3 and t["lo_sim"].iloc[2] < 0


def test_equivalence_by_two_one_sided_tests():
    """TOST against the margin: p_equiv is the larger one-sided p of |difference| >= margin; small where the
    difference is near 0 with a small SE, large where it is near the margin or the SE is large."""
    rng = np.random.default_rng(1)
    b = [rng.integers(0, 5, 400) / 4 for _ in range(3)]
    noisy = [np.clip(x + rng.normal(0.0, 0.05, 400), 0, 1) for x in b]
    r = paired(noisy, b, margin=0.02)
    lo, hi = stats.t.sf((r["diff"] + 0.02) / r["se"], 2), stats.t.sf((0.02 - r["diff"]) / r["se"], 2)
    assert r["p_equiv"] == pytest.approx(max(lo, hi))
    assert paired(noisy, b, margin=0.2)["p_equiv"] < 0.05 < paired(noisy, b, margin=0.001)["p_equiv"]


def test_a_comparison_clusters_its_se_by_the_prompts_clusters():
    """Examples that share a prompt (long-horizon's secrets of one prompt) are one cluster: the paired SE is the
    cluster-robust one, above the per-example SE when the examples of a cluster move together, and equal to it
    when every example is its own cluster."""
    rng = np.random.default_rng(0)
    shift = np.repeat(rng.normal(0, 0.3, 20), 7)  # 20 prompts x 7 examples, each prompt's examples moving together
    a = [np.clip(0.5 + shift + rng.normal(0, 0.05, 140), 0, 1) for _ in range(3)]
    b = [np.full(140, 0.5) for _ in range(3)]
    cluster = np.repeat(np.arange(20), 7)
    per_example, clustered = paired(a, b)["se"], paired(a, b, cluster)["se"]
    assert clustered > 1.5 * per_example
    assert paired(a, b, np.arange(140))["se"] == pytest.approx(per_example, rel=1e-9)
    assert se_clustered(a[0], np.arange(140)) == pytest.approx(se_clustered(a[0]), rel=1e-9)
