"""One metrics record (trace/metrics.py): the lines both trainers write and the names analysis/ reads are the fields
of `StepMetrics`.

What is checked: the embedded trainer's metrics.jsonl (a fresh run of the trace arm, whose lines hold the most
fields: record, flips, the alignment term's parts and gradient split, the evaluation at step 0 and the last step) and
the OpenRLHF policy actor's line (`metrics_line` on a status holding every key OpenRLHF and TRACE put there, then the
fields `fit` sets, read from its source) hold only fields and every field of a training line (`TRAIN_FIELDS`); every
name analysis/runs.py reads (`RunData.series` / `layer_profile`, which refuse other names) is a field; and every RL
line committed under results/ reads back (`StepMetrics.from_dict`).
"""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from trace.metrics import (
    ABSENT,
    ALIGN_PART_FIELDS,
    FIELDS,
    LAYER_FIELDS,
    TRAIN_FIELDS,
    StepMetrics,
    check_line,
)

ROOT = Path(__file__).resolve().parent


def _check_train_line(line: dict) -> None:
    check_line(line)
    assert set(TRAIN_FIELDS) <= set(line), sorted(set(TRAIN_FIELDS) - set(line))


def test_record_round_trip_and_refusals():
    m = StepMetrics(step=2, method="trace", k3=0.5, kl_ref=None)
    assert m.to_dict() == {"step": 2, "method": "trace", "k3": 0.5, "kl_ref": None}  # ABSENT left out, None kept
    assert StepMetrics.from_dict(m.to_dict()) == m and m.loss is ABSENT
    with pytest.raises(TypeError):
        StepMetrics(step=1, method="x", k4=1.0)
    with pytest.raises(AttributeError):
        m.k4 = 1.0
    with pytest.raises(ValueError, match="k4"):
        check_line({"step": 1, "k4": 1.0})
    assert set(TRAIN_FIELDS) <= set(FIELDS) and set(LAYER_FIELDS) <= set(FIELDS) and set(ALIGN_PART_FIELDS) <= set(FIELDS)


def test_embedded_trainer_writes_step_metrics(tmp_path):
    from tests.rl.conftest import small_cfg
    from trace.rl.trainer import RLTrainer
    cfg = small_cfg(["rl.method=trace", "rl.steps=1", "rl.prompts_per_step=2", "rl.group_size=2", "rl.eval_every=1",
                     "eval.samples_per_prompt=1", "task.n_test=4"])
    RLTrainer(cfg, tmp_path / "run", progress=False).run()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1]
    check_line(lines[0])
    _check_train_line(lines[1])
    # the fields only some steps have: the record's, the alignment term's parts and split, the evaluation
    assert {"grad_norm_align", "align_codes_share", "align_codes_hinge_layer", "eval_accuracy"} <= set(lines[1])


def _fit_fields() -> set[str]:
    """The StepMetrics attributes the OpenRLHF actor's `fit` sets on metrics_line's record (`m.<name> = ...`)."""
    tree = ast.parse((ROOT.parent / "trace/integrations/openrlhf/actor.py").read_text())
    fit = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "fit")
    out = set()
    for node in ast.walk(fit):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "m":
                        out.add(e.attr)
    return out


def test_openrlhf_actor_writes_step_metrics():
    from trace.integrations.openrlhf.actor import ALIGN_PARTS, metrics_line
    status = {"reward": 0.5, "accuracy": 0.25, "response_length": 4.0, "k1": 0.1, "k3": 0.2, "dlp_abs_mean": 0.1,
              "dlp_abs_max": 1.0, "ratio_out_frac": 0.0, "chi2": 0.1, "code_flip_rate/0": 0.1,
              "scale_flip_rate/0": 0.1, "unrecoverable_rate/0": 0.0, "routing_flip_rate/0": 0.0,
              "guidance_bytes_per_gen_token": 10.0, "rollout_gen_tokens_per_s": 100.0, "record_overhead": 0.1,
              "policy_loss": 0.3, "ppo_loss": 0.2, "kl": 0.01, "align_loss": 0.05, "actor_grad_norm": 1.0,
              "ppo_clip_ratio": 0.0, "is_filter_ratio": 0.0, **{k: 0.5 for k in ALIGN_PARTS}}
    m = metrics_line(3, "trace", status, kl_on=True)
    fit = _fit_fields()
    assert fit and fit <= set(FIELDS), sorted(fit - set(FIELDS))
    for name in fit:  # what fit adds, in place (the slots refuse any other name)
        setattr(m, name, 1.0)
    _check_train_line(m.to_dict())
    assert m.framework == "openrlhf" and m.kl_ref == 0.01 and m.align_codes_share == 0.5


def _names_read_by_runs() -> set[str]:
    """The string constants analysis/runs.py hands to series() / layer_profile(), directly or through a loop over a
    tuple, and its LAYER_METRICS."""
    tree = ast.parse((ROOT.parent / "analysis/runs.py").read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("series", "layer_profile") and node.args:
            a = node.args[0]
            if isinstance(a, ast.Constant):
                out.add(a.value)
        elif isinstance(node, ast.For) and isinstance(node.iter, ast.Tuple):
            calls = [c for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                     and c.func.attr in ("series", "layer_profile")]
            if calls:
                for e in node.iter.elts:
                    if isinstance(e, ast.Constant):
                        out.add(e.value)
                    elif isinstance(e, ast.Tuple) and e.elts and isinstance(e.elts[0], ast.Constant):
                        out.add(e.elts[0].value)
    return out


def test_analysis_reads_step_metrics_fields():
    from analysis import runs
    names = _names_read_by_runs()
    assert {"reward_mean", "k3", "grad_norm_align", "time_step_s", "rollout_gen_tokens_per_s"} <= names
    assert names <= set(FIELDS), sorted(names - set(FIELDS))
    assert runs.LAYER_METRICS == LAYER_FIELDS
    r = runs.RunData("m", "t", "trace", 0, "trace", False, "d", metrics=[{"step": 1, "k3": 0.5}])
    assert r.series("k3")[1].tolist() == [0.5]
    with pytest.raises(KeyError, match="StepMetrics"):
        r.series("k4")


def test_committed_rl_lines_read_back():
    """Every line of every committed RL run (results/, SFT runs aside) is a StepMetrics record."""
    n = 0
    for p in sorted((ROOT.parent / "results").rglob("metrics.jsonl")):
        meta = p.parent / "meta.json"
        if meta.exists() and json.loads(meta.read_text()).get("kind") == "sft":
            continue
        for x in p.read_text().splitlines():
            if x.strip():
                StepMetrics.from_dict(json.loads(x))
                n += 1
    assert n > 0
