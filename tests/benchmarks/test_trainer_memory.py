"""benchmarks/trainer_memory.py: one RL step of the smoke profile's tiny model, with the bytes autograd keeps.
TRACE's guided forward (every layer guided) keeps little more than independent QAT's (the same step and samples):
its alignment term is recomputed in the backward. Kept for the backward, the term's fp32 intermediates made trace
keep 2.7x qat-independent's memory here (1.3x with the recomputation) and 2.1x on mixtral-small coding, whose trace
runs then ran out of GPU memory 6 to a GPU."""
import os

import pytest
import yaml

from benchmarks.trainer_memory import saved_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cfg(arm):
    C = pytest.importorskip("trace.config")
    from runplan import Plan  # workflow/scripts, on sys.path through benchmarks.trainer_memory

    with open(os.path.join(ROOT, "experiments", "profiles", "smoke.yaml")) as f:
        plan = Plan(yaml.safe_load(f))
    cfg = plan.run_config("qwen3_moe-tiny", "reasoning", arm, 0)
    cfg.update(device="cpu", threads=1)
    cfg["rl"].update(init_ckpt=None, prompts_per_step=4, autocast="bf16", rho=1.0)
    return C.validate(C.deep_merge(C.DEFAULTS, cfg))


def test_trace_keeps_little_more_than_independent_qat():
    trace, n_trace = saved_bytes(_cfg("trace"))
    qat, n_qat = saved_bytes(_cfg("qat-independent"))
    assert n_trace == n_qat > 0  # the same samples: both arms roll out in FP4 from the same weights and seed
    assert any(where.startswith("qat/") for where, _ in trace)
    assert sum(trace.values()) < 1.5 * sum(qat.values()), (sum(trace.values()), sum(qat.values()))
