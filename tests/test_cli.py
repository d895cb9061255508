"""Start-up errors of the entry points: one `error:` line on stderr, exit status 2, nothing written.

Each case runs an entry point's main(argv) in-process (the same code path as `python -m ...`), so the
checks cost no training: every error is raised before a run directory or output file exists.
"""
from __future__ import annotations

import json
import re

import pytest
import yaml

from trace.models import build_model, save_checkpoint


@pytest.fixture(scope="module")
def qwen_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck") / "qwen"
    save_checkpoint(build_model("qwen3_moe-tiny", seed=0), None, d)
    return d


@pytest.fixture
def cfg_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"model": "qwen3_moe-tiny", "rl": {"steps": 1}, "sft": {"steps": 1}}))
    return p


def _run(entry, argv, capsys):
    if entry == "rl":
        from trace.rl.__main__ import main
    elif entry == "sft":
        from trace.sft import main
    else:
        from trace.eval import main
    with pytest.raises(SystemExit) as ei:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return ei.value.code, err


def _cases(tmp_path, ckpt):
    bad = tmp_path / "bad.jsonl"
    line2 = '{"prompt": "What is two plus two?", "label": "4" "x": 1}'
    col = line2.index('"x"') + 1  # the fault's column within line 2 (1-based)
    bad.write_text('{"prompt": "p", "label": "l"}\n' + line2 + "\n")
    return {
        "no config file": (["--config", str(tmp_path / "nope.yaml")], r"config file .*nope\.yaml.*No such file"),
        "unknown model": (["--set", "model=qwen9_moe-tiny"], r"config key 'model': unknown model 'qwen9_moe-tiny'"),
        "missing init ckpt": (["--set", f"rl.init_ckpt={tmp_path / 'nockpt'}"], r"rl\.init_ckpt: no checkpoint at"),
        "mismatched init ckpt": (["--set", "model=mixtral-tiny", "--set", f"rl.init_ckpt={ckpt}"],
                                 r"rl\.init_ckpt: checkpoint .* does not match model='mixtral-tiny': "
                                 r"model_type 'qwen3_moe' \(model 'mixtral'\)"),
        "missing jsonl": (["--set", f"task.train_jsonl={tmp_path / 'no.jsonl'}"],
                          r"task\.train_jsonl': .*no\.jsonl: no such file"),
        "bad jsonl": (["--set", f"task.test_jsonl={bad}"],
                      r"task\.test_jsonl': .*bad\.jsonl:2: invalid JSON \(Expecting ',' delimiter at column " + f"{col}\\)"),
    }


@pytest.mark.parametrize("case", ["no config file", "unknown model", "missing init ckpt", "mismatched init ckpt",
                                  "missing jsonl", "bad jsonl"])
def test_rl_startup_errors_write_nothing(tmp_path, cfg_file, qwen_ckpt, capsys, case):
    extra, msg = _cases(tmp_path, qwen_ckpt)[case]
    out = tmp_path / "run"
    argv = ["--config", str(cfg_file), "--out", str(out), "--no-progress"] + extra
    rc, err = _run("rl", argv, capsys)
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert re.search(msg, err[0]), err[0]
    assert not out.exists()


@pytest.mark.parametrize("case", ["no config file", "unknown model", "missing jsonl"])
def test_sft_startup_errors_write_nothing(tmp_path, cfg_file, qwen_ckpt, capsys, case):
    extra, msg = _cases(tmp_path, qwen_ckpt)[case]
    out = tmp_path / "run"
    rc, err = _run("sft", ["--config", str(cfg_file), "--out", str(out), "--no-progress"] + extra, capsys)
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ")
    assert re.search(msg, err[0]), err[0]
    assert not out.exists()


def test_eval_checkpoint_must_match_the_model(tmp_path, cfg_file, qwen_ckpt, capsys):
    out = tmp_path / "ev" / "eval.json"
    rc, err = _run("eval", ["--config", str(cfg_file), "--ckpt", str(qwen_ckpt), "--out", str(out),
                            "--set", "model=olmoe-tiny"], capsys)
    assert rc == 2 and len(err) == 1
    assert "--ckpt: checkpoint" in err[0] and "model_type 'qwen3_moe' (model 'olmoe')" in err[0]
    assert not out.parent.exists()
    rc, err = _run("eval", ["--config", str(cfg_file), "--ckpt", str(tmp_path / "none"), "--out", str(out)], capsys)
    assert rc == 2 and "--ckpt: no checkpoint at" in err[0] and not out.parent.exists()


def test_same_family_other_shape_is_a_mismatch(tmp_path, qwen_ckpt):
    from trace.models.checkpoint import check_checkpoint_model
    check_checkpoint_model("qwen3_moe-tiny", qwen_ckpt)  # its own model passes
    d = tmp_path / "c"
    d.mkdir()
    cfg = json.loads((qwen_ckpt / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "hidden_size": 96}))
    with pytest.raises(ValueError, match=r"hidden_size 96 \(model 64\)"):
        check_checkpoint_model("qwen3_moe-tiny", d)
