"""The SFT base gate (trace/gate.py, DESIGN.md §4): a base that does not answer is refused with one line, by the
gate's CLI (the calibration unit and the SFT search) and by the pipeline's launcher before an RL run's directory
exists; a base inside the band with long responses passes."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trace import config as C
from trace.gate import ACC_BAND, MIN_RESPONSE_TOKENS, GateError, check, failures

ROOT = Path(__file__).resolve().parent.parent


def _ev(acc_bf16=0.4, acc_fp4=0.35, len_bf16=70.0, len_fp4=72.0, split="validation") -> dict:
    return {"eval": {"split": split}, "bf16": {"accuracy": acc_bf16, "response_len": len_bf16},
            "fp4": {"accuracy": acc_fp4, "response_len": len_fp4}}


@pytest.fixture(scope="module")
def floor_base_eval(tmp_path_factory) -> Path:
    """`python -m trace.eval` on the validation split of the long reasoning task, of a qwen3_moe-tiny base that
    cannot answer (untrained: no answer line parses), at temperature 1 as the profiles evaluate."""
    from trace.models import build_model, build_tokenizer, save_checkpoint
    tmp = tmp_path_factory.mktemp("gate")
    save_checkpoint(build_model("qwen3_moe-tiny", seed=0), build_tokenizer(), tmp / "base")
    cfg = C.load_config(None, ["wandb.mode=disabled", "threads=2", "task.name=reasoning", "task.difficulty=easy",
                               "task.n_test=8", "eval.samples_per_prompt=2", "eval.split=validation",
                               "rl.max_new_tokens=48"])
    (tmp / "c.yaml").write_text(C.dump_config(cfg))
    out = tmp / "validation.json"
    r = subprocess.run([sys.executable, "-m", "trace.eval", "--config", str(tmp / "c.yaml"), "--ckpt",
                        str(tmp / "base"), "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def test_bounds():
    lo, hi = ACC_BAND
    assert failures(_ev()) == []
    assert failures(_ev(acc_bf16=lo, acc_fp4=hi, len_bf16=MIN_RESPONSE_TOKENS, len_fp4=MIN_RESPONSE_TOKENS)) == []
    assert failures(_ev(acc_fp4=0.018)) == ["FP4 accuracy 0.018 outside 0.15-0.85"]
    assert failures(_ev(acc_bf16=0.9)) == ["BF16 accuracy 0.900 outside 0.15-0.85"]
    assert failures(_ev(len_bf16=39.9)) == ["BF16 mean response 39.9 tokens < 40"]
    assert failures(_ev(split="test")) == ["evaluated on the test split, not validation"]
    ev = _ev()
    del ev["fp4"]
    assert failures(ev) == ["no FP4 evaluation"]


def test_gate_refuses_a_base_that_cannot_answer(floor_base_eval, tmp_path):
    ev = json.loads(floor_base_eval.read_text())
    assert ev["eval"]["split"] == "validation" and ev["bf16"]["accuracy"] < ACC_BAND[0]
    with pytest.raises(GateError, match="BF16 accuracy 0.000 outside 0.15-0.85") as e:
        check(floor_base_eval)
    assert "\n" not in str(e.value) and "FP4 accuracy" in str(e.value)
    # the CLI (the GPU units): exit 1, one line
    r = subprocess.run([sys.executable, "-m", "trace.gate", str(floor_base_eval)], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and r.stdout == ""
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("error: SFT base gate"), r.stderr
    # the pipeline's launcher: one line, no run directory
    out = tmp_path / "run"
    r = _launch(floor_base_eval, out, tmp_path)
    assert r.returncode == 1 and not out.exists()
    assert [ln for ln in r.stderr.splitlines() if ln] == [f"[launch] error: {e.value}"]
    # the same evaluation inside the band, with long responses, lets the run start
    passing = copy.deepcopy(ev)
    for m in ("bf16", "fp4"):
        passing[m].update(accuracy=0.3, response_len=64.0)
    (tmp_path / "ok.json").write_text(json.dumps(passing))
    r = _launch(tmp_path / "ok.json", out, tmp_path)
    assert r.returncode == 0, r.stderr
    assert (out / "done").exists()


def _launch(gate: Path, out: Path, tmp_path: Path):
    """workflow/scripts/launch.py --stage rl with `gate`, a stand-in trainer that only marks its run done."""
    (tmp_path / "rl.yaml").write_text("seed: 0\n")
    trainer = f"{sys.executable} -c 'import sys; open(sys.argv[sys.argv.index(\"--out\") + 1] + \"/done\", \"w\")'"
    return subprocess.run([sys.executable, "-m", "workflow.scripts.launch", "--stage", "rl", "--cmd", trainer,
                           "--config", str(tmp_path / "rl.yaml"), "--out", str(out), "--gate", str(gate)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, TRACE_ALLOW_DIRTY="1"))  # the gate, whatever the tree's state
