"""The arm table is the one list: the config schema, the pipeline's run plan and the analysis read it."""
import os
import sys

import pytest

from analysis import runs as A
from trace import config as C
from trace.arms import ARMS, MAIN_METHODS, METHODS, POSTHOC

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_schema_and_analysis_use_the_table():
    assert C.SCHEMA["properties"]["rl"]["properties"]["method"]["enum"] == list(METHODS)
    assert A.MAIN_METHODS == MAIN_METHODS and A.POSTHOC == POSTHOC == "posthoc-fp4"
    assert MAIN_METHODS == ("bf16", "fp4-naive", "qat-independent", "qat-weight-only", "trace")


def test_pipeline_schema_lists_the_same_arms():
    import yaml
    with open(os.path.join(ROOT, "workflow", "schemas", "config.schema.yaml")) as f:
        schema = yaml.safe_load(f)
    assert tuple(schema["$defs"]["method"]["enum"]) == METHODS


def test_arm_semantics():
    assert {m for m, a in ARMS.items() if a.record == "guide"} == {m for m in METHODS if m.startswith("trace")}
    assert ARMS["trace"].guidance == "mantissa+scale" and ARMS["trace-fullcodes"].guidance == "full codes"
    assert ARMS["qat-independent"].guidance == "none" and ARMS["qat-independent"].record == "diag"
    assert ARMS["bf16"].deploy == "bf16" and all(ARMS[m].deploy == "fp4" for m in METHODS if m != "bf16")
    assert not ARMS["trace-noalign"].align and not ARMS["trace-noroutingreplay"].routing


def test_run_plan_rejects_an_unknown_method():
    sys.path.insert(0, os.path.join(ROOT, "workflow", "scripts"))
    from runplan import Plan
    with pytest.raises(ValueError, match="fp8-magic"):
        Plan({"profile": "x", "models": ["qwen3_moe-tiny"], "tasks": {"reasoning": {}}, "methods": ["fp8-magic"],
              "seeds": [0]})
