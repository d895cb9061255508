"""Reasoning task: deterministic disjoint splits, exact-match verifier, charset and length limits."""
import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trace.tasks import get_task, task_names
from trace.tasks.base import Example
from trace.tasks.reasoning import evaluate, parse_int_answer


def test_registry_names_and_unknown():
    assert task_names() == ["coding", "long_horizon", "reasoning"]
    with pytest.raises(KeyError, match="unknown task"):
        get_task("chess")
    assert get_task("reasoning/easy").name == "reasoning"


def test_split_is_deterministic_and_seed_dependent():
    t = get_task("reasoning")
    a = t.make_split("train", 100, seed=3)
    assert a == get_task("reasoning").make_split("train", 100, seed=3)
    assert [e.prompt for e in a] != [e.prompt for e in t.make_split("train", 100, seed=4)]
    # a prefix property is not promised, but a longer list must still be deterministic
    assert t.make_split("test", 50, seed=1) == t.make_split("test", 50, seed=1)


@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
def test_train_and_test_prompts_disjoint_across_seeds(difficulty):
    t = get_task("reasoning", difficulty=difficulty)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train = {e.prompt for s in range(3) for e in t.make_split("train", 150, seed=s)}
        test = {e.prompt for s in range(3, 5) for e in t.make_split("test", 40, seed=s)}
    assert train and test and not (train & test)


def test_unique_within_split_when_space_allows():
    t = get_task("reasoning", difficulty="medium")
    ex = t.make_split("test", 200, seed=0)
    assert len({e.prompt for e in ex}) == 200


def test_small_space_repeats_with_warning():
    t = get_task("reasoning", difficulty="easy")  # 200 prompts in all, ~20% of them test
    with pytest.warns(UserWarning, match="unique test examples"):
        ex = t.make_split("test", 100, seed=0)
    assert len(ex) == 100 and len({e.prompt for e in ex}) < 100


def test_heldout_is_every_unique_test_prompt_once():
    """Evaluation sets never repeat a prompt: the easy space's test share (44 of 200 prompts at seed 0;
    make_split("test", 64) repeats 20 of them) comes back whole, once each, whatever n above it."""
    import itertools
    t = get_task("reasoning", difficulty="easy")
    space = {f"Q: {a}{op}{b}=\nA:" for a, b in itertools.product(range(10), repeat=2) for op in "+-"}
    test_share = {p for p in space if t.split_of(Example(p, "", "reasoning")) == "test"}
    ex = t.heldout(64, seed=0)
    assert [e.prompt for e in ex] == list(dict.fromkeys(e.prompt for e in ex))  # no repeats
    assert {e.prompt for e in ex} == test_share and len(test_share) == 44
    assert t.heldout(500, seed=0) == ex
    assert len(t.heldout(10, seed=0)) == 10


@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
def test_gold_scores_one_and_wrong_scores_zero(difficulty, charset_ok):
    t = get_task("reasoning", difficulty=difficulty)
    for ex in t.make_split("train", 200, seed=0):
        gold = t.sft_target(ex)
        assert gold.endswith("\n")
        assert t.score(ex, gold) == 1.0
        assert t.score(ex, f"{int(ex.label) + 1}\n") == 0.0
        assert t.score(ex, "") == 0.0
        charset_ok(ex.prompt)
        charset_ok(gold)
        assert ex.prompt.startswith("Q: ") and ex.prompt.endswith("=\nA:")
        assert ex.datasource == "reasoning"
        if difficulty != "hard":
            assert len(ex.prompt) <= 48 and len(gold) <= 16


def test_label_matches_python_precedence():
    t = get_task("reasoning", difficulty="hard")
    for ex in t.make_split("train", 300, seed=7):
        # eval only on our own generated, digits-and-operators text
        assert int(ex.label) == eval(ex.meta["expr"], {"__builtins__": {}})


@given(st.lists(st.integers(0, 99), min_size=2, max_size=6), st.data())
def test_evaluate_matches_eval(operands, data):
    ops = data.draw(st.lists(st.sampled_from("+-*"), min_size=len(operands) - 1, max_size=len(operands) - 1))
    expr = str(operands[0]) + "".join(o + str(v) for o, v in zip(ops, operands[1:], strict=False))
    assert evaluate(operands, ops) == eval(expr, {"__builtins__": {}})


def test_answer_parsing_is_strict_first_line():
    assert parse_int_answer("10\nmore text") == 10
    assert parse_int_answer(" -3 \n") == -3
    for bad in ["", "\n10", "1_0\n", "١٠\n", "10.0\n", "+5\n", "ten\n", "--1\n"]:
        assert parse_int_answer(bad) is None, bad
    t = get_task("reasoning")
    ex = t.make_split("train", 1, seed=0)[0]
    assert t.score(ex, f"\n{ex.label}\n") == 0.0  # the answer must be on the first line


def test_bad_knobs_raise():
    with pytest.raises(ValueError, match="difficulty"):
        get_task("reasoning", difficulty="extreme")
    with pytest.raises(ValueError, match="ops"):
        get_task("reasoning", ops="/")
    with pytest.raises(ValueError, match="n_operands"):
        get_task("reasoning", n_operands=1)
    with pytest.raises(ValueError, match="split"):
        get_task("reasoning").make_split("val", 3, seed=0)
