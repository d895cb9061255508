"""reasoning-short (answers of a few tokens): deterministic disjoint splits, exact-match verifier, charset and
length limits, and the prompts, splits and scoring pinned to what this task produced under the name
`reasoning` (same seeds, same examples)."""
import hashlib
import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trace.tasks import get_task, task_names
from trace.tasks.base import Example
from trace.tasks.reasoning import evaluate, parse_int_answer


def test_registry_names_and_unknown():
    assert task_names() == ["coding", "long_horizon", "program", "reasoning", "reasoning-short"]
    with pytest.raises(KeyError, match="unknown task"):
        get_task("chess")
    assert get_task("reasoning-short/easy").name == "reasoning-short"
    assert get_task("reasoning/easy").name == "reasoning"


def _digest(exs) -> str:
    return hashlib.sha256(repr([(e.prompt, e.label) for e in exs]).encode()).hexdigest()[:16]


# (difficulty, knobs) -> digests of make_split("train", 512, seed=0), make_split("test", 128, seed=3),
# heldout(400, seed=0): the task's output under its former name `reasoning`, before the validation split
PINNED = {
    ("easy", ()): ("d6e3bf9c44bc0c3e", "756967f8596292f2", "275b10e00f0f1200"),
    ("medium", ()): ("4826d9d93c44b709", "d62f012bdb73c46f", "e6a22c152bcdf92c"),
    ("hard", ()): ("3a3517d83aaee200", "8eca88e8c417a349", "94343eebcfa75d9a"),
    ("easy", (("max_value", 19),)): ("78fc20f9ef057b82", "784ec4f14a49b612", "a4a7e889eb339252"),
    ("medium", (("max_value", 19),)): ("cc6c3662bc4127a1", "edc8e63415e9d16f", "77fa6c6b9c194585"),
}


@pytest.mark.parametrize("key", sorted(PINNED))
def test_pinned_examples_are_those_of_the_former_reasoning_task(key):
    """Test splits unchanged; the train split unchanged with val_fraction=0 (a validation split takes its
    examples out of train's share)."""
    difficulty, knobs = key
    train, test, held = PINNED[key]
    t = get_task("reasoning-short", difficulty=difficulty, **dict(knobs))
    legacy = get_task("reasoning-short", difficulty=difficulty, val_fraction=0.0, **dict(knobs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _digest(legacy.make_split("train", 512, seed=0)) == train
        for task in (t, legacy):
            assert _digest(task.make_split("test", 128, seed=3)) == test
            assert _digest(task.heldout(400, seed=0)) == held
        assert _digest(t.make_split("train", 512, seed=0)) != train  # validation prompts left train


def test_pinned_prompts_and_answers():
    t = get_task("reasoning-short", difficulty="medium")
    assert [(e.prompt, e.label) for e in t.make_split("test", 4, seed=7)] == [
        ("Q: 5-8*4=\nA:", "-27"), ("Q: 9-0+6=\nA:", "15"), ("Q: 9-4*3=\nA:", "-3"), ("Q: 9-5+9=\nA:", "13")]
    legacy = get_task("reasoning-short", difficulty="hard", val_fraction=0)
    assert [(e.prompt, e.label) for e in legacy.make_split("train", 4, seed=7)] == [
        ("Q: 6*13+14+15=\nA:", "107"), ("Q: 5-14-15-8=\nA:", "-32"), ("Q: 4+7+1-8=\nA:", "4"),
        ("Q: 3*9-1-12=\nA:", "14")]
    ex = t.make_split("test", 1, seed=7)[0]
    assert ex.datasource == "reasoning-short" and t.stop == "\n"
    assert t.sft_target(ex) == "-27\n" and t.score(ex, "-27\n") == 1.0 and t.score(ex, "-26\n") == 0.0


def test_split_is_deterministic_and_seed_dependent():
    t = get_task("reasoning-short")
    a = t.make_split("train", 100, seed=3)
    assert a == get_task("reasoning-short").make_split("train", 100, seed=3)
    assert [e.prompt for e in a] != [e.prompt for e in t.make_split("train", 100, seed=4)]
    # a prefix property is not promised, but a longer list must still be deterministic
    assert t.make_split("test", 50, seed=1) == t.make_split("test", 50, seed=1)


@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
def test_train_and_test_prompts_disjoint_across_seeds(difficulty):
    t = get_task("reasoning-short", difficulty=difficulty)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train = {e.prompt for s in range(3) for e in t.make_split("train", 150, seed=s)}
        test = {e.prompt for s in range(3, 5) for e in t.make_split("test", 40, seed=s)}
    assert train and test and not (train & test)


def test_unique_within_split_when_space_allows():
    t = get_task("reasoning-short", difficulty="medium")
    ex = t.make_split("test", 200, seed=0)
    assert len({e.prompt for e in ex}) == 200


def test_small_space_repeats_with_warning():
    t = get_task("reasoning-short", difficulty="easy")  # 200 prompts in all, ~20% of them test
    with pytest.warns(UserWarning, match="unique test examples"):
        ex = t.make_split("test", 100, seed=0)
    assert len(ex) == 100 and len({e.prompt for e in ex}) < 100


def test_heldout_is_every_unique_test_prompt_once():
    """Evaluation sets never repeat a prompt: the easy space's test share (44 of 200 prompts at seed 0;
    make_split("test", 64) repeats 20 of them) comes back whole, once each, whatever n above it."""
    import itertools
    t = get_task("reasoning-short", difficulty="easy")
    space = {f"Q: {a}{op}{b}=\nA:" for a, b in itertools.product(range(10), repeat=2) for op in "+-"}
    test_share = {p for p in space if t.split_of(Example(p, "", "reasoning-short")) == "test"}
    ex = t.heldout(64, seed=0)
    assert [e.prompt for e in ex] == list(dict.fromkeys(e.prompt for e in ex))  # no repeats
    assert {e.prompt for e in ex} == test_share and len(test_share) == 44
    assert t.heldout(500, seed=0) == ex
    assert len(t.heldout(10, seed=0)) == 10


@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
def test_gold_scores_one_and_wrong_scores_zero(difficulty, charset_ok):
    t = get_task("reasoning-short", difficulty=difficulty)
    for ex in t.make_split("train", 200, seed=0):
        gold = t.sft_target(ex)
        assert gold.endswith("\n")
        assert t.score(ex, gold) == 1.0
        assert t.score(ex, f"{int(ex.label) + 1}\n") == 0.0
        assert t.score(ex, "") == 0.0
        charset_ok(ex.prompt)
        charset_ok(gold)
        assert ex.prompt.startswith("Q: ") and ex.prompt.endswith("=\nA:")
        assert ex.datasource == "reasoning-short"
        if difficulty != "hard":
            assert len(ex.prompt) <= 48 and len(gold) <= 16


def test_label_matches_python_precedence():
    t = get_task("reasoning-short", difficulty="hard")
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
    t = get_task("reasoning-short")
    ex = t.make_split("train", 1, seed=0)[0]
    assert t.score(ex, f"\n{ex.label}\n") == 0.0  # the answer must be on the first line


def test_bad_knobs_raise():
    with pytest.raises(ValueError, match="difficulty"):
        get_task("reasoning-short", difficulty="extreme")
    with pytest.raises(ValueError, match="ops"):
        get_task("reasoning-short", ops="/")
    with pytest.raises(ValueError, match="n_operands"):
        get_task("reasoning-short", n_operands=1)
    with pytest.raises(ValueError, match="split"):
        get_task("reasoning-short").make_split("val", 3, seed=0)
    with pytest.raises(ValueError, match="no validation split"):
        get_task("reasoning-short", val_fraction=0).make_split("validation", 3, seed=0)
