"""analysis.compare: arm-vs-arm differences of held-out accuracy, paired by seed and prompt, with the main
table's SE convention, on synthetic eval.json files (tests/analysis/synthetic.py)."""
import json

import numpy as np
import pandas as pd
import pytest

from analysis.compare import build, paired
from tests.analysis.synthetic import eval_block, write_profile


def test_paired_difference_and_its_standard_error():
    """Seed 0: A - B per prompt (0.5, 0, 0.5, 0): +0.25, clustered SE 0.1443; seed 1: (0, 0, 0.5, 0.5): +0.25,
    SE 0.1443. Seed variance 0 < mean e^2, so SE = sqrt(0.1443^2 / 2) = 0.1021; z = 2.45; 2 of 2 seeds A > B."""
    a = [np.array([0.5, 0.5, 1, 1]), np.array([0.5, 0.5, 1, 1])]
    b = [np.array([0, 0.5, 0.5, 1]), np.array([0.5, 0.5, 0.5, 0.5])]
    r = paired(a, b)
    assert r["diff"] == pytest.approx(0.25) and r["se"] == pytest.approx(0.1021, abs=1e-4)
    assert r["z"] == pytest.approx(2.449, abs=1e-3) and (r["a_better"], r["n_seeds"]) == (2, 2)
    assert r["per_seed"] == "+0.250 +0.250"


def test_seed_spread_dominates_when_seeds_disagree():
    """Every prompt moves by the same amount within a seed (prompt SE 0), +0.3 and -0.1 across seeds: the SE is
    the seed spread's, sd 0.2828 / sqrt(2) = 0.2, and only one seed has A > B."""
    a = [np.full(8, 0.6), np.full(8, 0.4)]
    b = [np.full(8, 0.3), np.full(8, 0.5)]
    r = paired(a, b)
    assert r["diff"] == pytest.approx(0.1) and r["se"] == pytest.approx(0.2) and r["a_better"] == 1
    with pytest.raises(ValueError, match="different prompt sets"):
        paired([np.zeros(3)], [np.zeros(4)])


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
    assert "| qwen3_moe-tiny | reasoning | trace (FP4) | qat-independent (FP4) | 3 |" in (tmp_path / "t" / "compare.md").read_text()


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
            cfg["eval"] = {"n_test": 0, "samples_per_prompt": 4, "temperature": 1.0, "max_new_tokens": 16, "seed": 1}
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


def test_holm_adjusts_over_the_whole_table_and_its_interval_matches_the_decision():
    """Holm's step-down: the smallest p is multiplied by m, the next by m - 1, ... (kept monotone); the
    interval excludes 0 exactly where the adjusted p is below 0.05."""
    import math

    import numpy as np
    import pandas as pd

    from analysis.compare import holm

    z = np.array([3.5, -2.6, 2.2, 0.4, -1.0])
    t = holm(pd.DataFrame({"diff": z * 0.01, "se": 0.01, "z": z}))
    p = np.array([math.erfc(abs(v) / math.sqrt(2)) for v in z])
    assert np.allclose(t["p"], p)
    # ranks by p: 3.5 (x5), 2.6 (x4), 2.2 (x3), 1.0 (x2), 0.4 (x1), with the running maximum
    expect = np.maximum.accumulate([min(1, 5 * p[0]), min(1, 4 * p[1]), min(1, 3 * p[2]), min(1, 2 * p[4]), min(1, p[3])])
    assert np.allclose(t["p_holm"].to_numpy()[[0, 1, 2, 4, 3]], expect)
    excludes = (t["lo_holm"] > 0) | (t["hi_holm"] < 0)
    assert (excludes == (t["p_holm"] < 0.05)).all()
    assert excludes.tolist() == [True, True, False, False, False]  # 2.2 would pass uncorrected (p 0.028), not at x3


def test_a_comparison_clusters_its_se_by_the_prompts_clusters():
    """Examples that share a prompt (long-horizon's secrets of one prompt) are one cluster: the paired SE is the
    cluster-robust one, above the per-example SE when the examples of a cluster move together, and equal to it
    when every example is its own cluster."""
    import numpy as np

    from analysis.compare import paired
    from analysis.runs import se_clustered

    rng = np.random.default_rng(0)
    shift = np.repeat(rng.normal(0, 0.3, 20), 7)  # 20 prompts x 7 examples, each prompt's examples moving together
    a = [np.clip(0.5 + shift + rng.normal(0, 0.05, 140), 0, 1) for _ in range(3)]
    b = [np.full(140, 0.5) for _ in range(3)]
    cluster = np.repeat(np.arange(20), 7)
    per_example, clustered = paired(a, b)["se"], paired(a, b, cluster)["se"]
    assert clustered > 1.5 * per_example
    assert paired(a, b, np.arange(140))["se"] == pytest.approx(per_example, rel=1e-9)
    assert se_clustered(a[0], np.arange(140)) == pytest.approx(se_clustered(a[0]), rel=1e-9)
