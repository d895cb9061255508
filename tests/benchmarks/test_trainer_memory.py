"""benchmarks/trainer_memory.py: one RL step of the smoke profile's tiny model, with the bytes autograd keeps.
TRACE's guided forward (every layer guided) keeps little more than independent QAT's (the same step and samples):
its alignment term is recomputed in the backward. Kept for the backward, the term's fp32 intermediates made trace
keep 2.7x qat-independent's memory here (1.3x with the recomputation) and 2.1x on mixtral-small coding, whose trace
runs then ran out of GPU memory 6 to a GPU."""
import os

import pytest

pytest.importorskip("trace.config")
import torch  # noqa: E402

from benchmarks.trainer_memory import SavedStorages, saved_bytes, step_config  # noqa: E402

SMOKE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                     "experiments", "profiles", "smoke.yaml")


def _cfg(arm):
    return step_config(SMOKE, "qwen3_moe-tiny", "reasoning-short", arm, 4, threads=1, rho=1.0)[0]


def test_trace_keeps_little_more_than_independent_qat():
    trace, n_trace = saved_bytes(_cfg("trace"))
    qat, n_qat = saved_bytes(_cfg("qat-independent"))
    assert n_trace == n_qat > 0  # the same samples: both arms roll out in FP4 from the same weights and seed
    assert any(where.startswith("qat/") for where, _ in trace)
    assert sum(trace.values()) < 1.5 * sum(qat.values()), (sum(trace.values()), sum(qat.values()))


def test_a_storage_counts_once_and_whole():
    """sigmoid saves its output and the product saves it twice more: one storage of 4,000 bytes. A saved view of
    half of a [10, 100] fp32 tensor keeps the whole 4,000-byte base alive."""
    x = torch.randn(1000, requires_grad=True)
    a = torch.randn(10, 100, requires_grad=True)
    saved = SavedStorages()
    with saved():
        y = x.sigmoid()
        (y * y).sum().backward()
    assert sum(saved.by.values()) == 4000
    saved = SavedStorages()
    with saved():
        b = a * 2
        b[:, :50].sin().sum().backward()
    assert sum(saved.by.values()) == 4000
