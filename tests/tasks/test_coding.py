"""Coding task: examples, hidden cases, sandboxed verification (gold passes, wrong and hostile fail)."""
import json
import os
import time
import uuid
import warnings

import pytest

import trace.tasks.coding as coding
from trace.tasks import Example, get_task
from trace.tasks.sandbox import run_many

pytestmark = pytest.mark.usefixtures("allow_weak_sandbox")


def make_example(gold="2*x+1", fn=lambda x: 2 * x + 1, hidden=(4, 7, 11, 13, 20)):
    label = json.dumps({"inputs": list(hidden), "outputs": [fn(x) for x in hidden], "gold": gold})
    return Example(prompt="f(1)=3 f(2)=5 f(3)=7\ndef f(x): return", label=label, datasource="coding")


@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
def test_gold_passes_hidden_cases(difficulty, charset_ok):
    t = get_task("coding", difficulty=difficulty)
    exs = t.make_split("train", 40, seed=0)
    gold = [t.sft_target(e) for e in exs]
    assert t.score_batch(exs, gold) == [1.0] * len(exs)
    for e, g in zip(exs, gold, strict=False):
        charset_ok(e.prompt)
        charset_ok(g)
        assert e.prompt.endswith("\ndef f(x): return") and g.startswith(" ") and g.endswith("\n")
        case = json.loads(e.label)
        assert not set(case["inputs"]) & set(e.meta["shown"])  # hidden cases are really hidden
        if difficulty == "easy":
            assert len(e.prompt) <= 48 and len(g) <= 16


def test_all_families_gold_pass():
    t = get_task("coding", families=("const", "linear", "quadratic", "mod"), coef_max=4, n_shown=3)
    exs = t.make_split("test", 40, seed=2)
    assert {e.meta["family"] for e in exs} == {"const", "linear", "quadratic", "mod"}
    assert t.score_batch(exs, [t.sft_target(e) for e in exs]) == [1.0] * 40


def test_split_determinism_and_disjointness():
    t = get_task("coding", difficulty="easy")
    assert t.make_split("train", 60, seed=1) == t.make_split("train", 60, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train = {e.prompt for s in range(3) for e in t.make_split("train", 200, seed=s)}
        test = {e.prompt for s in range(2) for e in t.make_split("test", 60, seed=s)}
    assert not train & test


def test_equivalent_program_scores_one_and_wrong_zero():
    t = get_task("coding")
    ex = make_example()
    got = t.score_batch([ex] * 6, [" x+x+1\n", " 1+2*x  \nrubbish", " 2*x\n", " 3\n", " 2*x+1.0\n", " x > 0\n"])
    # floats and bools are not ints: exact int results are required
    assert got == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_partial_credit_knob():
    ex = make_example(gold="x", fn=lambda x: x, hidden=(1, 2, 3, 4))
    resp = [" x if x < 3 else 0\n"]
    assert get_task("coding").score_batch([ex], resp) == [0.0]
    assert get_task("coding", partial_credit=True).score_batch([ex], resp) == [0.5]


def test_unparsable_responses_never_reach_the_sandbox(monkeypatch):
    calls = []
    monkeypatch.setattr(coding, "run_many", lambda *a, **k: calls.append(a) or [])
    t = get_task("coding")
    ex = make_example()
    assert t.score_batch([ex] * 4, ["", " 2*x+\n", " )(\n", " " + "x+" * 200 + "1\n"]) == [0.0] * 4
    assert calls == []


def test_duplicate_responses_run_once(monkeypatch):
    seen = []
    real = coding.run_many

    def spy(sources, **kw):
        seen.append(len(sources))
        return real(sources, **kw)

    monkeypatch.setattr(coding, "run_many", spy)
    t = get_task("coding")
    ex = make_example()
    # not integer arithmetic alone (a call), so they go to the sandbox
    assert t.score_batch([ex] * 5, [" abs(2*x+1)\n"] * 3 + [" abs(x)\n"] * 2) == [1.0] * 3 + [0.0] * 2
    assert seen == [2]


def test_integer_arithmetic_is_scored_in_process_as_the_sandbox_scores_it(monkeypatch):
    """Expressions of + - * // % on x and int constants skip the sandbox, with the harness's exact outputs:
    the same scores (partial credit, so every hidden case counts) as with everything sent to the sandbox,
    division by zero and negative operands included."""
    import random

    rng = random.Random(0)
    ops = ["+", "-", "*", "//", "%"]
    exprs = [" 2*x+1", " x//0", " (x-7)%3", " -x%4", " x*x*x*x*x*x*x*x", " +x-(-3)", " 10//(x-11)",
             " 7%(x%3)", " 99999999999999999999*x*x", " x"]
    for _ in range(40):
        e = "x"
        for _ in range(rng.randint(1, 4)):
            e = f"({e}){rng.choice(ops)}{rng.choice(['x', str(rng.randint(-9, 9))])}"
        exprs.append(" " + e)
    ex = make_example(hidden=(0, 4, 7, 11, 13, 20))
    t = get_task("coding", partial_credit=True)
    calls = []
    real = coding.run_many
    monkeypatch.setattr(coding, "run_many", lambda s, **k: calls.append(len(s)) or real(s, **k))
    fast = t.score_batch([ex] * len(exprs), [e + "\n" for e in exprs])
    assert calls == []  # none reached the sandbox
    monkeypatch.setattr(coding, "pure_arithmetic", lambda expr: None)
    boxed = t.score_batch([ex] * len(exprs), [e + "\n" for e in exprs])
    assert calls == [len(set(exprs))]
    assert fast == boxed
    assert fast[0] == 1.0 and fast[1] == 0.0 and any(0 < s < 1 for s in fast)  # all, none and some cases pass


@pytest.mark.parametrize("expr", ["2**x", "x<<3", "x>>1", "abs(x)", "x if x else 1", "x.real", "[x][0]",
                                  "(lambda: x)()", "'a'*x", "x is 1", "x in (1,)", "x@x", "abs", "_x+1", "f",
                                  "__debug__+x", "__name__", "x*print"])
def test_what_could_be_unbounded_or_see_the_harness_goes_to_the_sandbox(expr):
    assert coding.pure_arithmetic(expr) is None


def test_in_process_outputs_are_the_sandboxes():
    """Every kind of expression the verifier evaluates in-process prints, line for line, what the harness
    prints in the sandbox: ints, T for other types (floats, bools, complex, None), E where it raises
    (division by zero, a name the harness does not define, a type error); a chained comparison that stops
    before an undefined name does not raise, in either."""
    exprs = ["2*x+1", "x//0", "x/2", "x/0", "1.5*x", "True+x", "x>1", "1<0<y", "1<2<y", "not x", "~x",
             "x or 2.5", "x and yy", "-x%4", "2*xk+1", "yy", "-None", "1j*x", "1j//x", "x==3.0", "None<x",
             "99999999999999999999*x*x", "(x-7)%3.5", "x!=x"]
    inputs = [0, 1, 4, 7, -3]
    for e in exprs:
        assert coding.pure_arithmetic(e) is not None, e
    boxed = run_many([coding.harness(e, inputs) for e in exprs], timeout_s=5.0)
    for e, r in zip(exprs, boxed, strict=True):
        assert r.killed_reason is None, (e, r)
        assert coding.run_pure(coding.pure_arithmetic(e), inputs) == r.stdout, e


def test_hostile_expressions_score_zero_and_do_no_harm():
    target = f"/tmp/pwned_coding_{uuid.uuid4().hex}"
    t = get_task("coding", timeout_s=0.5)
    ex = make_example()
    hostile = [
        f" __import__('os').system('touch {target}')\n",
        f" open({target!r}, 'w').write('x')\n",
        " [0 for _ in iter(int, 1)]\n",  # infinite
        " print('9') or 2*x+1\n",  # extra output lines must not count as passes
        " __import__('socket').socket()\n",
        " (2*x+1) * 10**10**10\n",
    ]
    t0 = time.monotonic()
    assert t.score_batch([ex] * len(hostile), hostile) == [0.0] * len(hostile)
    assert time.monotonic() - t0 < 5.0
    assert not os.path.exists(target)


def test_bad_knobs():
    with pytest.raises(ValueError, match="family"):
        get_task("coding", families=("cubic",))
    with pytest.raises(ValueError, match="n_shown"):
        get_task("coding", n_shown=20, x_max=5)
