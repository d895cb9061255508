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
    """Base (0, 0.5, 0.5, 1) -> final (0.5, 0.5, 1, 1): rise 0.25; clustered SEs 0.2041 and 0.1443,
    unpaired SE sqrt(0.2041^2 + 0.1443^2) = 0.25; paired: per-prompt rises (0.5, 0, 0.5, 0), SE 0.1443."""
    r = rise({"per_prompt": [0, 0.5, 0.5, 1]}, {"per_prompt": [0.5, 0.5, 1, 1]})
    assert r["rise"] == pytest.approx(0.25)
    assert r["se_base"] == pytest.approx(0.2041, abs=1e-4) and r["se_final"] == pytest.approx(0.1443, abs=1e-4)
    assert r["se_rise"] == pytest.approx(0.25, abs=1e-4)
    assert r["se_rise_paired"] == pytest.approx(0.1443, abs=1e-4)
    with pytest.raises(ValueError, match="same evaluation set"):
        rise({"per_prompt": [0, 1]}, {"per_prompt": [0, 1, 1]})


def test_check_passes_only_above_three_standard_errors(tmp_path):
    """80 prompts: base alternates 0 / 0.5 (mean 0.25, SE 0.0281); a final policy alternating 0 / 1
    (mean 0.5, SE 0.0563) rises 0.25 = 3.97 unpaired SEs (0.0629): passes; one alternating 0.125 / 0.5
    (mean 0.3125, SE 0.0211) rises 0.0625 = 1.78 SEs (0.0352): fails."""
    runs = tmp_path / "runs" / "smoke"
    write_profile(runs, models=["qwen3_moe-tiny"], seeds=[0, 1], ablation_models=(), steps=2)
    _write_base(runs, [0.0, 0.5] * 40)
    _write_final(runs, 0, [0.0, 1.0] * 40)
    _write_final(runs, 1, [0.125, 0.5] * 40)
    t = build(str(runs), str(tmp_path / "t")).set_index("seed")
    assert t.loc[0, "passed"] and not t.loc[1, "passed"]
    assert t.loc[0, "z"] == pytest.approx(3.97, abs=0.01) and t.loc[1, "z"] == pytest.approx(1.78, abs=0.01)
    with pytest.raises(SystemExit, match="learning check failed"):
        build(str(runs), str(tmp_path / "t"), strict=True)
    _write_final(runs, 1, [0.0, 1.0] * 40)
    build(str(runs), str(tmp_path / "t"), strict=True)
    assert "| qwen3_moe-tiny | reasoning | 0 | 80 |" in (tmp_path / "t" / "learning.md").read_text()


def test_missing_base_evaluation_is_a_problem(tmp_path):
    runs = tmp_path / "runs" / "smoke"
    write_profile(runs, models=["qwen3_moe-tiny"], seeds=[0], ablation_models=(), steps=2)
    with pytest.raises(SystemExit):
        build(str(runs), str(tmp_path / "t"), strict=True)
