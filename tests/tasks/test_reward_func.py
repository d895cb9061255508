"""OpenRLHF-style reward_func: output structure, routing to the five verifiers, prompt stripping."""
import pytest
import torch

from trace.tasks import get_task
from trace.tasks.reward_func import infer_task, reward_func


def batch():
    qs, ps, ls, want, srcs = [], [], [], [], []
    for name in ("reasoning", "reasoning-short", "coding", "program", "long_horizon"):
        t = get_task(name, difficulty="easy")
        for ex in t.make_split("test", 3, seed=0):
            gold = t.sft_target(ex)
            for resp, r in ((gold, 1.0), ("zz\n", 0.0)):
                qs.append(ex.prompt + resp)
                ps.append(ex.prompt)
                ls.append(ex.label)
                want.append(r)
                srcs.append(ex.datasource)
    return qs, ps, ls, want, srcs


def test_structure_and_values():
    qs, ps, ls, want, srcs = batch()
    out = reward_func(qs, ps, ls)
    assert set(out) == {"rewards", "scores", "extra_logs"}
    assert isinstance(out["rewards"], torch.Tensor) and out["rewards"].shape == (len(qs),)
    assert out["rewards"].tolist() == want and out["scores"].tolist() == want
    logs = out["extra_logs"]
    assert set(logs) == {"accuracy", "response_chars", "correct_reasoning", "correct_reasoning_short", "correct_coding",
                         "correct_program", "correct_long_horizon"}
    assert all(v.shape == (len(qs),) for v in logs.values())
    assert logs["correct_coding"].sum().item() == 3 and logs["correct_program"].sum().item() == 3
    assert logs["correct_reasoning"].sum().item() == 3 and logs["correct_reasoning_short"].sum().item() == 3


def test_prompt_shapes_route_the_two_reasoning_tasks():
    for name in ("reasoning", "reasoning-short"):
        ex = get_task(name).make_split("test", 1, seed=0)[0]
        assert infer_task(ex.prompt) == name

def test_explicit_datasources_and_kwargs_pass_through():
    qs, ps, ls, want, srcs = batch()
    out = reward_func(qs, ps, ls, datasources=[s + "/easy" for s in srcs], unused_openrlhf_kwarg=1)
    assert out["scores"].tolist() == want


def test_wrapped_prompt_is_found():
    t = get_task("reasoning")
    ex = t.make_split("test", 1, seed=0)[0]
    q = "<|im_start|>user\n" + ex.prompt + t.sft_target(ex)
    assert reward_func([q], [ex.prompt], [ex.label])["rewards"].tolist() == [1.0]


def test_errors():
    with pytest.raises(ValueError, match="length mismatch"):
        reward_func(["a"], ["a", "b"], ["1"])
    with pytest.raises(ValueError, match="cannot tell"):
        infer_task("hello")
    with pytest.raises(KeyError, match="unknown task"):
        reward_func(["x1"], ["x"], ["1"], datasources=["chess"])
