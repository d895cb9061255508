"""reasoning (worked answers): the reduction format, gold lengths with the project's tokenizer, the context
they need, final-answer parsing and scoring."""
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trace.models.registry import build_config
from trace.models.tokenizer import build_tokenizer
from trace.tasks import get_task
from trace.tasks.reasoning import evaluate, parse_expr, parse_final_answer, reduction_steps


def test_worked_example():
    assert reduction_steps([12, 34, 5, 6, 7, 8], list("+*-*+")) == [
        "12+170-6*7+8", "12+170-42+8", "182-42+8", "140+8", "148"]
    assert reduction_steps([12, 50, 3], list("-+")) == ["-38+3", "-35"]  # only the leading number is negative
    t = get_task("reasoning")
    ex = t.make_split("train", 1, seed=1)[0]
    assert ex.prompt == "Q: 7*19+9+40+54=\nSteps:\n" and ex.label == "236"
    assert t.sft_target(ex) == "133+9+40+54\n142+40+54\n182+54\n236\nanswer: 236\n\n"
    assert t.stop == "\n\n" and ex.datasource == "reasoning"


@given(st.lists(st.integers(0, 99), min_size=2, max_size=8), st.data())
def test_every_step_keeps_the_value_and_the_last_is_it(operands, data):
    ops = data.draw(st.lists(st.sampled_from("+-*"), min_size=len(operands) - 1, max_size=len(operands) - 1))
    steps = reduction_steps(operands, ops)
    assert len(steps) == len(operands) - 1
    value = evaluate(operands, ops)
    for line in steps:  # each line is an expression of the same value with one operation less
        assert eval(line, {"__builtins__": {}}) == value
        assert "+-" not in line and "--" not in line and "*-" not in line
    assert steps[-1] == str(value)
    assert parse_expr(steps[0].lstrip("-")) is not None


TOKENIZER = build_tokenizer()


@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
def test_gold_length_in_tokens(difficulty, charset_ok):
    """Mean gold response 40-200 tokens of the project's tokenizer; prompt + gold fits the tiny flavors'
    256 positions."""
    t = get_task("reasoning", difficulty=difficulty)
    exs = t.make_split("train", 400, seed=0)
    lengths = [len(TOKENIZER(t.sft_target(e), add_special_tokens=False)["input_ids"]) for e in exs]
    assert lengths == [len(t.sft_target(e)) for e in exs]  # one token per character
    assert 40 <= statistics.mean(lengths) <= 200, statistics.mean(lengths)
    context = min(build_config(f"{fam}-tiny").max_position_embeddings
                  for fam in ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe"))
    assert max(1 + len(e.prompt) + len(t.sft_target(e)) for e in exs) <= context
    for e in exs[:50]:
        charset_ok(e.prompt)
        charset_ok(t.sft_target(e))


@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
def test_gold_scores_one_and_off_by_one_scores_zero(difficulty):
    t = get_task("reasoning", difficulty=difficulty)
    for ex in t.make_split("test", 100, seed=0):
        gold = t.sft_target(ex)
        assert gold.endswith(t.stop) and gold.count(t.stop) == 1  # the stop string only at the end
        assert parse_final_answer(gold) == int(ex.label)
        assert t.score(ex, gold) == 1.0
        for off in (1, -1):
            wrong = gold.replace(f"answer: {ex.label}\n", f"answer: {int(ex.label) + off}\n")
            assert t.score(ex, wrong) == 0.0
        assert t.score(ex, gold.replace("answer:", "")) == 0.0  # no answer line
        assert t.score(ex, "") == 0.0
        assert t.score(ex, f"{ex.label}\n\n") == 0.0  # the value alone is not an answer line


def test_final_answer_parsing():
    assert parse_final_answer("1+2\n3\nanswer: 3\n\n") == 3
    assert parse_final_answer("  answer:   -12  \n") == -12
    assert parse_final_answer("answer:7") == 7
    assert parse_final_answer("answer: 5\nanswer: 6\n") == 5  # the first answer line counts
    for bad in ["", "3\n", "answer:\n", "answer: 1_0\n", "answer: ١٠\n", "answer: 10.0\n", "answer: +5\n",
                "answer: ten\n", "answer: --1\n", "answer: 3 4\n", "Answer: 3\n", "answer: " + "9" * 41 + "\n"]:
        assert parse_final_answer(bad) is None, bad


def test_knobs_and_errors():
    t = get_task("reasoning", n_operands=5, max_value=9, ops="+-")
    for ex in t.make_split("train", 30, seed=0):
        operands, ops = parse_expr(ex.meta["expr"])
        assert len(operands) == 5 and max(operands) <= 9 and set(ops) <= set("+-")
    with pytest.raises(ValueError, match="min_operands"):
        get_task("reasoning", min_operands=5, max_operands=4)
    with pytest.raises(ValueError, match="ops"):
        get_task("reasoning", ops="/")
    with pytest.raises(ValueError, match="difficulty"):
        get_task("reasoning", difficulty="extreme")
    with pytest.raises(ValueError, match="not an expression"):
        parse_expr("1+-2")


def test_gold_from_a_loaded_example_without_steps():
    """An example read back from JSONL (meta without the steps) gets the same gold response."""
    from trace.tasks import Example
    t = get_task("reasoning")
    ex = t.make_split("train", 1, seed=2)[0]
    bare = Example(ex.prompt, ex.label, ex.datasource, {"expr": ex.meta["expr"]})
    assert t.sft_target(bare) == t.sft_target(ex)


def test_knobs_override_the_difficulty_preset_one_by_one():
    from trace.tasks.reasoning import PRESETS

    t = get_task("reasoning", difficulty="hard", max_value=7)
    assert t.max_value == 7 and (t.min_operands, t.max_operands) == (PRESETS["hard"]["min_operands"],
                                                                      PRESETS["hard"]["max_operands"])
    assert (get_task("reasoning", n_operands=3).min_operands, get_task("reasoning", n_operands=3).max_operands) == (3, 3)
    with pytest.raises(ValueError, match="difficulty must be one of"):
        get_task("reasoning", difficulty="impossible")
