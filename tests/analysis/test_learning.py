"""analysis.learning: the rise of held-out accuracy from the SFT base to the end of RL, with its
prompt-clustered standard error, on synthetic eval.json files (tests/analysis/synthetic.py)."""
import json

import pytest

from analysis.learning import build, rise
from tests.analysis.synthetic import eval_block, write_profile


def _write_base(runs, per_prompt):
    d = runs / "qwen3_moe-tiny" / "reasoning" / "sft"
    d.mkdir(parents=True, exist_ok=True)
    (d / "eval.json").write_text(json.dumps({"bf16": eval_block(per_prompt)}))


def _write_final(runs, seed, per_prompt):
    p = runs / "qwen3_moe-tiny" / "reasoning" / "bf16" / f"seed{seed}" / "eval.json"
    ev = json.loads(p.read_text())
    ev["bf16"] = eval_block(per_prompt)
    p.write_text(json.dumps(ev))


def test_rise_and_its_standard_errors():
    """Base (0, 0.5, 0.5, 1) -> final (0.5, 0.5, 1, 1): rise 0.25; clustered SEs 0.2041 and 0.1443;
    SE of the rise from the per-prompt rises (0.5, 0, 0.5, 0): 0.1443; unpaired sqrt(0.2041^2 + 0.1443^2)
    = 0.25."""
    r = rise({"per_prompt": [0, 0.5, 0.5, 1]}, {"per_prompt": [0.5, 0.5, 1, 1]})
    assert r["rise"] == pytest.approx(0.25)
    assert r["se_base"] == pytest.approx(0.2041, abs=1e-4) and r["se_final"] == pytest.approx(0.1443, abs=1e-4)
    assert r["se_rise"] == pytest.approx(0.1443, abs=1e-4)
    assert r["se_rise_unpaired"] == pytest.approx(0.25, abs=1e-4)
    with pytest.raises(ValueError, match="same evaluation set"):
        rise({"per_prompt": [0, 1]}, {"per_prompt": [0, 1, 1]})


def test_check_is_on_the_seed_mean_above_three_standard_errors(tmp_path):
    """40 prompts, base 0 / 0.5 / 0.5 / 0.25 repeated (mean 0.3125). Seed A rises each prompt by
    0.25 / 0 / 0 / 0 (mean 0.0625, sd 0.1096, SE 0.0173: 3.61 SEs); seed B by 0.25 / 0 / -0.25 / 0.125
    (1.06 SEs). Their mean rises by 0.25 / 0 / -0.125 / 0.0625 (mean 0.0469, SE 0.0217: 2.16 SEs): fails;
    with B replaced by a copy of A the mean is A: passes."""
    runs = tmp_path / "runs" / "smoke"
    write_profile(runs, models=["qwen3_moe-tiny"], seeds=[0, 1], ablation_models=(), steps=2)
    _write_base(runs, [0.0, 0.5, 0.5, 0.25] * 10)
    _write_final(runs, 0, [0.25, 0.5, 0.5, 0.25] * 10)
    _write_final(runs, 1, [0.25, 0.5, 0.25, 0.375] * 10)
    t = build(str(runs), str(tmp_path / "t")).set_index("seed")
    assert t.loc["0", "z"] == pytest.approx(3.61, abs=0.01) and t.loc["1", "z"] == pytest.approx(1.06, abs=0.01)
    assert t.loc["mean", "rise"] == pytest.approx(0.046875)
    assert t.loc["mean", "z"] == pytest.approx(2.16, abs=0.01) and not t.loc["mean", "passed"]
    with pytest.raises(SystemExit, match="learning check failed"):
        build(str(runs), str(tmp_path / "t"), strict=True)
    _write_final(runs, 1, [0.25, 0.5, 0.5, 0.25] * 10)
    t = build(str(runs), str(tmp_path / "t"), strict=True).set_index("seed")
    assert t.loc["mean", "passed"] and t.loc["mean", "n_seeds"] == 2
    assert "| qwen3_moe-tiny | reasoning | mean | 40 |" in (tmp_path / "t" / "learning.md").read_text()


def test_missing_base_evaluation_is_a_problem(tmp_path):
    runs = tmp_path / "runs" / "smoke"
    write_profile(runs, models=["qwen3_moe-tiny"], seeds=[0], ablation_models=(), steps=2)
    with pytest.raises(SystemExit):
        build(str(runs), str(tmp_path / "t"), strict=True)
