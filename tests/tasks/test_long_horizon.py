"""Guess-the-number environment: env dynamics, gold binary-search transcripts with masks, replay scoring."""
import json
import warnings

import pytest

from trace.tasks import Example, get_task
from trace.tasks.long_horizon import GuessNumberEnv, binary_search_policy, bisection_guesses, run_episode


def example(secret=11, lo=3, hi=17, turns=5):
    label = json.dumps({"secret": secret, "lo": lo, "hi": hi, "max_turns": turns})
    return Example(prompt=f"Guess n in {lo}..{hi}, {turns} tries\n>", label=label, datasource="long_horizon")


def test_env_dynamics():
    env = GuessNumberEnv()
    ex = example()
    assert env.reset(ex) == ex.prompt
    assert env.step("10\n") == ("higher\n>", 0.0, False)
    assert env.step("14\n") == ("lower\n>", 0.0, False)
    assert env.step("foo\n") == ("invalid\n>", 0.0, False)  # costs a turn
    assert env.turns_used == 3
    assert env.step(" 11\n") == ("correct\n", 1.0, True)
    with pytest.raises(RuntimeError, match="over"):
        env.step("11\n")


def test_env_loses_after_max_turns_and_needs_reset():
    with pytest.raises(RuntimeError, match="reset"):
        GuessNumberEnv().step("1\n")
    env = GuessNumberEnv()
    env.reset(example(turns=2))
    assert env.step("3\n")[2] is False
    assert env.step("4\n") == ("lost\n", 0.0, True)


def test_shaped_reward():
    env = GuessNumberEnv(shaping=0.5)
    env.reset(example(secret=10, turns=5))
    assert env.step("10\n") == ("correct\n", 1.0, True)
    env.reset(example(secret=10, turns=5))
    for g in ("3", "4", "5", "6"):
        env.step(g + "\n")
    assert env.step("10\n") == ("correct\n", 0.5, True)


@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
def test_gold_transcript_wins_and_mask_marks_policy_chars(difficulty, charset_ok):
    t = get_task("long_horizon", difficulty=difficulty)
    assert t.gold_solvable
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exs = t.make_split("train", 120, seed=0)
    for ex in exs:
        text, mask = t.sft_target_and_mask(ex)
        assert text == t.sft_target(ex) and len(mask) == len(text)
        assert text.endswith("correct\n")
        assert t.score(ex, text) == 1.0
        charset_ok(ex.prompt)
        charset_ok(text)
        policy = "".join(c for c, m in zip(text, mask, strict=False) if m)
        env_text = "".join(c for c, m in zip(text, mask, strict=False) if not m)
        guesses = policy.split("\n")[:-1]
        assert all(g.isdigit() for g in guesses) and policy.endswith("\n")
        assert len(guesses) <= t.max_turns
        assert set(env_text.replace("\n", " ").replace(">", " ").split()) <= {"higher", "lower", "correct"}
        assert int(guesses[-1]) == json.loads(ex.label)["secret"]


def test_split_disjoint_by_range_and_deterministic():
    t = get_task("long_horizon")
    assert t.make_split("test", 30, seed=4) == t.make_split("test", 30, seed=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train = {e.prompt for s in range(3) for e in t.make_split("train", 200, seed=s)}
        test = {e.prompt for s in range(2) for e in t.make_split("test", 50, seed=s)}
    assert train and test and not train & test
    ex = t.make_split("test", 50, seed=0)
    assert len({(e.prompt, e.label) for e in ex}) == 50


def test_replay_score_rejects_bad_transcripts():
    t = get_task("long_horizon")
    ex = example(secret=11)
    gold, _ = t.gold_transcript(ex)
    assert gold == "10\nhigher\n>14\nlower\n>12\nlower\n>11\ncorrect\n"
    assert t.score(ex, gold) == 1.0
    assert t.score(ex, gold[: -len("correct\n")]) == 1.0  # final observation cut by the budget
    assert t.score(ex, "10\nhigher\n>14\n") == 0.0  # unfinished
    assert t.score(ex, "5\ncorrect\n") == 0.0  # wrong guess, forged feedback continues as next action
    assert t.score(ex, "10\nlower\n>11\ncorrect\n") == 0.0  # forged feedback
    assert t.score(ex, "3\nhigher\n>4\nhigher\n>5\nhigher\n>6\nhigher\n>7\nlost\n") == 0.0
    assert t.score(ex, "") == 0.0


def test_run_episode_cuts_actions_like_the_engine():
    ex = example(secret=5, lo=3, hi=17, turns=3)
    text, mask, reward = run_episode(ex, lambda ctx: "99999999999999999999999")  # never emits the stop
    assert reward == 0.0 and text.endswith("lost\n")
    assert mask.count(True) == 3 * 16
    ex4 = example(secret=5, lo=3, hi=17, turns=4)  # 15 numbers need ceil(log2(16)) = 4 guesses
    assert run_episode(ex4, binary_search_policy(ex4))[2] == 1.0
    assert run_episode(ex, binary_search_policy(ex))[2] == 0.0  # 3 turns are not always enough


def test_bisection_guesses_count_the_gold_policys_turns():
    # every secret of a few ranges, widths 1 to 15: the gold policy, given turns to spare, wins in exactly
    # bisection_guesses turns (the transcript has one guess line and one feedback line per turn)
    for lo, hi in [(3, 3), (0, 6), (10, 16), (40, 54), (5, 12)]:
        for secret in range(lo, hi + 1):
            ex = example(secret=secret, lo=lo, hi=hi, turns=8)
            text, _, reward = run_episode(ex, binary_search_policy(ex))
            assert reward == 1.0
            assert bisection_guesses(ex) == text.count("\n") // 2
    assert bisection_guesses(example(secret=3, lo=0, hi=6)) == 1  # the midpoint
    assert bisection_guesses(example(secret=0, lo=0, hi=6)) == 3


def test_bad_knobs():
    with pytest.raises(ValueError, match="shaping"):
        get_task("long_horizon", shaping=1.5)
    with pytest.raises(ValueError, match="width"):
        get_task("long_horizon", width=1)
    assert not get_task("long_horizon", width=31, max_turns=3).gold_solvable
