"""The SFT recipe search (scripts/gpu/sft_search_unit.sh, scripts/gpu/sft_search.py; DESIGN.md §4 "SFT recipe"): its
dry run lists every candidate base with configs the trainer accepts, evaluated on the validation split with the
profile's eval settings; the summaries carry what the rule reads; the rule picks by the order DESIGN fixes and picks
nothing when no candidate passes the gate."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "gpu"))
import sft_search as S  # noqa: E402


def test_dry_run_lists_the_candidates_and_their_configs():
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
               PYTHONPATH=str(ROOT))
    r = subprocess.run(["bash", "scripts/gpu/sft_search_unit.sh", "--dry-run"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    heads = [ln for ln in r.stdout.splitlines() if ln.startswith("## ")]
    assert [h.split(":")[0][3:] for h in heads] == [c["name"] for c in S.CANDIDATES]
    assert 4 <= len(S.CANDIDATES) <= 6 and len({c["name"] for c in S.CANDIDATES}) == len(S.CANDIDATES)
    assert "sft_config:" in r.stdout and "split: validation" in r.stdout


def test_candidate_configs_pass_the_trainer_schema_and_evaluate_as_the_profile():
    import yaml

    from trace import config as C
    with open(ROOT / "experiments" / "profiles" / "small-v2.yaml") as f:
        prof = yaml.safe_load(f)
    cfgs = S.configs("small-v2", "qwen3_moe-small", "reasoning")
    for name, c in cfgs.items():
        sft = C.validate(C.deep_merge(C.DEFAULTS, c["sft"]))
        ev = C.validate(C.deep_merge(C.DEFAULTS, c["eval"]))
        for k, v in c["set"].items():  # the candidate's keys in its SFT config, its task keys in its evaluation too
            sec, key = k.split(".")
            assert sft[sec][key] == v and (sec == "sft" or ev[sec][key] == v), (name, k)
        assert sft["sft"]["label_smoothing"] <= 0.05 and sft["sft"]["init_seed"] == 0
        assert ev["eval"]["split"] == "validation" and ev["rl"]["init_ckpt"] is None
        assert {k: ev["eval"][k] for k in prof["defaults"]["eval"]} == prof["defaults"]["eval"]  # temperature 1
        assert ev["rl"]["max_new_tokens"] == 192 and ev["task"]["n_test"] == prof["tasks"]["reasoning"]["n_test"]


def _summ(name, acc=(0.3, 0.25), length=70.0):
    spec = next(c for c in S.CANDIDATES if c["name"] == name)
    ev = {"eval": {"split": "validation"}}
    for m, a in zip(("bf16", "fp4"), acc, strict=True):
        ev[m] = {"accuracy": a, "se": 0.01, "response_len": length, "n": 2048, "n_prompts": 512}
    gate = S.failures(ev)
    return {"name": name, "set": spec["set"], **{m: ev[m] for m in ("bf16", "fp4")}, "gate": gate, "passes": not gate}


def test_the_rule():
    # passing medium before any easy one; among medium, fewest steps; then the FP4 accuracy
    assert S.choose([_summ("easy-ls0.05", (0.6, 0.6)), _summ("medium-ls0-n32k-3000", (0.2, 0.2))])["name"] == \
        "medium-ls0-n32k-3000"
    assert S.choose([_summ("medium-ls0-n32k-3000", (0.5, 0.5)), _summ("medium-ls0", (0.2, 0.16))])["name"] == \
        "medium-ls0"
    assert S.choose([_summ("medium-ls0", (0.3, 0.2)), _summ("medium-ls0-n32k", (0.25, 0.22))])["name"] == \
        "medium-ls0-n32k"
    # below the band, or too short: no pick
    assert S.choose([_summ("medium-ls0.05", (0.021, 0.018)), _summ("easy-ls0.05", (0.3, 0.3), length=30)]) is None


def test_summarise_writes_each_candidate_and_the_pick(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    for name, acc in (("medium-ls0.05", 0.02), ("medium-ls0", 0.3)):
        (work / name).mkdir(parents=True)
        (work / name / "sft_seconds").write_text("700\n")
        ev = {"eval": {"split": "validation"}}
        for m in ("bf16", "fp4"):
            ev[m] = {"accuracy": acc, "se": 0.01, "response_len": 66.0, "n": 2048, "n_prompts": 512}
        (work / name / "validation.json").write_text(json.dumps(ev))
    assert S.main(["summarise", str(work), str(out), "medium-ls0.05", "medium-ls0", "easy-ls0.05"]) == 0
    c = json.loads((out / "candidate_medium-ls0.json").read_text())
    assert c["passes"] and c["sft_seconds"] == 700 and c["fp4"]["se"] == 0.01 and c["bf16"]["response_len"] == 66
    assert not json.loads((out / "candidate_easy-ls0.05.json").read_text())["passes"]  # it never evaluated
    assert json.loads((out / "chosen.json").read_text())["chosen"] == "medium-ls0"
    (work / "medium-ls0" / "validation.json").unlink()
    assert S.main(["summarise", str(work), str(out), "medium-ls0.05", "medium-ls0"]) == 1
    assert json.loads((out / "chosen.json").read_text())["chosen"] is None


@pytest.mark.parametrize("script", ["sft_search_unit.sh", "calibrate_unit.sh"])
def test_units_source_the_gpu_environment_and_pack_runs_without_checkpoints(script):
    text = (ROOT / "scripts" / "gpu" / script).read_text()
    assert ". scripts/gpu/env.sh || exit 1" in text and "--exclude=ckpt" in text
