"""program (function bodies from a spec in words): the format, gold lengths with the project's tokenizer and the
context they need, scoring (gold, equivalent, wrong, truncated, garbage), what runs in-process and that it prints
what the sandbox prints, splits by gold function and the number of distinct held-out functions."""
import json
import os
import random
import statistics
import uuid
import warnings

import pytest

import trace.tasks.coding as coding  # the shared execution scorer, whose sandbox calls are watched
import trace.tasks.program as program
from trace.models.registry import build_config
from trace.models.tokenizer import build_tokenizer
from trace.tasks import Example, get_task
from trace.tasks.base import SPLITS
from trace.tasks.sandbox import run_many

pytestmark = pytest.mark.usefixtures("allow_weak_sandbox")


def make_example(gold=" y=x*3\n y=y+4\n if y%2==0: y=y//2\n y=y%7\n return y\n", hidden=(0, 3, 8, 15, 42, 77)):
    fn = program.run_pure(program.pure_program(gold), list(hidden)).split()
    label = json.dumps({"inputs": list(hidden), "outputs": [int(v) for v in fn], "gold": gold})
    return Example(prompt="steps: times 3, plus 4, if even halve, mod 7\n" + program.HEADER, label=label,
                   datasource="program")


def test_worked_example():
    assert program.render([("times", 3, 1), ("plus", 4, 1), ("even", 2, 1), ("mod", 7, 1)]) == (
        "steps: times 3, plus 4, if even halve, mod 7", " y=x*3\n y=y+4\n if y%2==0: y=y//2\n y=y%7\n return y\n")
    t = get_task("program")
    ex = t.make_split("train", 1, seed=1)[0]
    assert ex.prompt == "steps: times 3, if over 25 minus 6, plus x, plus x, div 4\ndef f(x):\n"
    assert t.sft_target(ex) == " y=x*3\n if y>25: y=y-6\n y=y+x\n y=y+x\n y=y//4\n return y\n\n"
    assert t.stop == "\n\n" and ex.datasource == "program" and t.val_fraction == 0.1
    assert t.score(make_example(), " y=x*3\n y=y+4\n if y%2==0: y=y//2\n y=y%7\n return y\n\n") == 1.0


TOKENIZER = build_tokenizer()


@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
def test_gold_lengths_charset_and_context(difficulty, charset_ok):
    """Every gold response 30+ tokens of the project's tokenizer (one token a character) over 2,000 examples;
    means of about 41 (easy), 57 (medium) and 71 (hard); prompt + gold fits the tiny flavors' context."""
    t = get_task("program", difficulty=difficulty)
    exs = t.make_split("train", 2000, seed=0)
    golds = [t.sft_target(e) for e in exs]
    lengths = [len(g) for g in golds]
    assert [len(TOKENIZER(g, add_special_tokens=False)["input_ids"]) for g in golds[:100]] == lengths[:100]
    assert min(lengths) >= program.MIN_GOLD_CHARS
    lo, hi = {"easy": (38, 46), "medium": (50, 64), "hard": (64, 80)}[difficulty]
    assert lo <= statistics.mean(lengths) <= hi, statistics.mean(lengths)
    context = min(build_config(f"{fam}-tiny").max_position_embeddings
                  for fam in ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe"))
    assert max(1 + len(e.prompt) + len(g) for e, g in zip(exs, golds, strict=True)) <= context
    for e, g in zip(exs[:200], golds[:200], strict=True):
        charset_ok(e.prompt)
        charset_ok(g)
        assert e.prompt.startswith("steps: ") and e.prompt.endswith("\ndef f(x):\n")
        assert g.endswith(t.stop) and g.count(t.stop) == 1 and g.startswith(" y=x")
        assert g.count("\n") == e.meta["n_steps"] + 2  # one line a step, the return, the empty line
        case = json.loads(e.label)
        assert len(case["inputs"]) == 8 and all(0 <= v <= 99 for v in case["inputs"])


@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
def test_gold_scores_one_and_truncated_or_wrong_score_zero(difficulty, monkeypatch):
    calls = []
    monkeypatch.setattr(coding, "run_many", lambda *a, **k: calls.append(a) or [])
    t = get_task("program", difficulty=difficulty)
    exs = t.make_split("test", 60, seed=0)
    golds = [t.sft_target(e) for e in exs]
    assert t.score_batch(exs, golds) == [1.0] * len(exs)
    for e, g in zip(exs[:20], golds[:20], strict=True):
        # every cut before the returned name is read: no return (None: T), or not a program
        cuts = [g[:i] for i in range(len(g) - 2)]
        assert t.score_batch([e] * len(cuts), cuts) == [0.0] * len(cuts)
        assert t.score(e, g[:-2]) == 1.0  # the whole program without the stop string still is the program
        assert t.score(e, g.replace(" return y", " return y+1")) == 0.0
        assert t.score(e, g.replace(" return y", " return x")) == 0.0
        assert t.score(e, g.split("\n", 1)[1]) == 0.0  # the first step left out: y is read before it is set
    assert calls == []  # all plain statements: nothing reached the sandbox


def test_a_left_out_step_or_changed_constant_fails():
    t = get_task("program")
    ex = make_example()
    wrong = [" y=x*3\n y=y+4\n y=y%7\n return y\n\n",           # the halving left out
             " y=x*3\n y=y+5\n if y%2==0: y=y//2\n y=y%7\n return y\n\n",
             " y=x*3\n y=y+4\n if y%2==1: y=y//2\n y=y%7\n return y\n\n",
             "return y\n\n", "", "zz\n", " y=x*3\n\n y=y+4\n return y\n\n"]
    assert t.score_batch([ex] * len(wrong), wrong) == [0.0] * len(wrong)


def test_equivalent_programs_score_one():
    t = get_task("program")
    ex = make_example()
    good = [" y=x*3\n y=y+4\n if y%2==0: y=y//2\n y=y%7\n return y\n\n",
            "  y = 3*x + 4\n  if y % 2 == 0:\n    y = y // 2\n  return y % 7\n\n",
            " y=x*3+4\n y=y//2 if y%2==0 else y\n return y%7\n\n",
            " z=x*3\n z+=4\n if not z%2: z//=2\n return z%7\n\n",
            " y=x*3\n y=y+4\n if y%2==0: y=y//2\n y=y%7\n return y\n\nrubbish after the stop"]
    assert t.score_batch([ex] * len(good), good) == [1.0] * len(good)
    assert all(program.pure_program(program.parse_body(g)) is not None for g in good)


def test_partial_credit_knob():
    ex = make_example(gold=" y=x+0\n return y\n", hidden=(1, 2, 3, 4))
    resp = [" if x<3: return x\n return 0\n\n"]
    assert get_task("program").score_batch([ex], resp) == [0.0]
    assert get_task("program", partial_credit=True).score_batch([ex], resp) == [0.5]


@pytest.mark.parametrize("body", [
    " return __import__('os').getpid()\n", " y=abs(x)\n return y\n", " while True: pass\n",
    " for i in range(9): x=x+1\n return x\n", " y=x\n y=y*y\n return y\n", " y=x\n y*=y\n return y\n",
    " y=x**2\n return y\n", " y=x<<3\n return y\n", " y=x.real\n return y\n", " y=[x][0]\n return y\n",
    " y=(lambda: x)()\n return y\n", " y='a'*x\n return y\n", " y=x/2\n return y\n", " y=x*2.0\n return y\n",
    " y=f\n return y\n", " y=_x\n return y\n", " y=__name__\n return y\n", " print(x)\n return x\n",
    " import os\n return x\n", " global y\n y=x\n return y\n", " y=x*(x+1)\n return y\n",
    " def g(): return x\n return x\n", " return x\nprint(1)\n", " y=x if x is 1 else 0\n return y\n",
    " y=x in (1,)\n return y\n", " y=None\n return y\n", " assert x\n return x\n", " y=x\n del y\n return x\n",
    " try:\n  y=1\n except: y=2\n return y\n", " with x: pass\n return x\n", " y=(x:=3)\n return y\n",
    " y=[1,2]\n return x\n", " y=x@x\n return y\n", " y=True\n return y\n", " y=x\n y.a=1\n return y\n",
    " '''doc'''\n return x\n", " x\n f\n return x\n",
])
def test_what_could_be_unbounded_or_see_the_harness_goes_to_the_sandbox(body):
    assert program.parse_body(body) is not None, body
    assert program.pure_program(body) is None


def test_in_process_outputs_are_the_sandboxes():
    """Every kind of body the verifier runs in-process prints, line for line, what the harness prints in the
    sandbox: ints, T for other types (bools, None from a missing return), E where it raises (division or modulo
    by zero, a name the harness does not define, a local read before it is set); random step programs too."""
    bodies = [" y=x*3\n y=y+4\n if y%2==0: y=y//2\n y=y%7\n return y\n", " y=x//0\n return y\n",
              " y=x%(x-4)\n return y\n", " return x>3\n", " y=x\n", " return yy\n", " y=y+1\n return y\n",
              " if x>3: z=1\n return z\n", " y=-x%4\n return ~y\n", " return x and 7\n", " return not x\n",
              " y=x*99999999999999999999*99999999\n y=y*7 if y else -1\n return y\n",
              " if x>1:\n  if x<5: return 1\n  else: return -x\n elif x==0: return 0\n return x or 2\n",
              " a=b=x\n a+=2\n b*=-3\n b-=a\n b%=5\n b//=1\n return a*-1+b\n", " pass\n return 1<x<5\n",
              " y=x\n return\n", " return 1 if x else yy\n", " return x+-+-x\n", " y=x\n retur\n",
              " x\n y\n return x\n"]
    rng = random.Random(0)
    t = get_task("program", difficulty="hard")
    for _ in range(20):
        bodies.append(program.render(t._steps(rng))[1])
    inputs = [0, 1, 2, 4, 7, 50, 99, -3]
    for b in bodies:
        assert program.parse_body(b) == b and program.pure_program(b) is not None, b
    boxed = run_many([program.harness(b, inputs) for b in bodies], timeout_s=5.0)
    for b, r in zip(bodies, boxed, strict=True):
        assert r.killed_reason is None, (b, r)
        assert program.run_pure(program.pure_program(b), inputs) == r.stdout, b


def test_plain_statements_are_scored_in_process_as_the_sandbox_scores_them(monkeypatch):
    """Random mutations of a gold body, scored with partial credit in-process and with everything sent to the
    sandbox: the same scores, and some pass all, none and part of the hidden inputs."""
    rng = random.Random(1)
    t = get_task("program", partial_credit=True)
    ex = make_example(hidden=(0, 1, 5, 8, 13, 42, 77, 98))
    base = " y=x*3\n y=y+4\n if y%2==0: y=y//2\n y=y%7\n return y\n"
    resps = [base + "\n", " y=x\n return y//0\n\n"]
    for _ in range(30):
        lines = base.split("\n")[:-2]
        i = rng.randrange(len(lines))
        lines[i] = lines[i].replace(rng.choice("3427"), str(rng.randint(1, 9)), 1)
        if rng.random() < 0.3:
            del lines[rng.randrange(len(lines))]
        resps.append("\n".join(lines) + "\n return y\n\n")
    calls = []
    real = coding.run_many
    monkeypatch.setattr(coding, "run_many", lambda s, **k: calls.append(len(s)) or real(s, **k))
    fast = t.score_batch([ex] * len(resps), resps)
    assert calls == []
    monkeypatch.setattr(program, "pure_program", lambda body: None)
    boxed = t.score_batch([ex] * len(resps), resps)
    assert calls == [len({program.parse_body(r) for r in resps})]
    assert fast == boxed
    assert fast[0] == 1.0 and fast[1] == 0.0 and any(0 < s < 1 for s in fast)


def test_unparsable_responses_never_reach_the_sandbox_and_duplicates_run_once(monkeypatch):
    seen = []
    real = coding.run_many
    monkeypatch.setattr(coding, "run_many", lambda s, **k: seen.append(len(s)) or real(s, **k))
    t = get_task("program")
    ex = make_example()
    bad = ["", "\n\n", "y=x\n return y\n\n", " y=x*\n return y\n\n", " y=(x\n\n", " " + "y=y+1\n " * 200 + "\n\n",
           " y=x\n  return y\n\n", " y=\u00e9\n\n"]
    assert t.score_batch([ex] * len(bad), bad) == [0.0] * len(bad)
    assert seen == []
    boxed = [" y=abs(x*3+4)\n if y%2==0: y=y//2\n return y%7\n\n"] * 3 + [" return abs(x)\n\n"] * 2
    assert t.score_batch([ex] * 5, boxed) == [1.0] * 3 + [0.0] * 2
    assert seen == [2]


def test_hostile_bodies_score_zero_and_do_no_harm():
    target = f"/tmp/pwned_program_{uuid.uuid4().hex}"
    t = get_task("program", timeout_s=0.5)
    ex = make_example()
    hostile = [
        f" __import__('os').system('touch {target}')\n return x\n\n",
        f" open({target!r}, 'w').write('x')\n return x\n\n",
        " while True: pass\n\n",
        " y=x\n for i in range(99): y=y*y\n return y\n\n",  # a value of 2**99 digits: the time limit stops it
        " print('1')\n y=x*3+4\n if y%2==0: y=y//2\n return y%7\n\n",  # extra output lines are not passes
    ]
    assert t.score_batch([ex] * len(hostile), hostile) == [0.0] * len(hostile)
    assert not os.path.exists(target)


def _draw(task, split, seeds, n):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [e for s in seeds for e in task.make_split(split, n, seed=s)]


@pytest.mark.parametrize("difficulty", ["easy", "medium"])
def test_test_functions_never_in_train(difficulty):
    t = get_task("program", difficulty=difficulty)
    fn = {s: {t.partition_key(e) for e in _draw(t, s, range(3), 200)} for s in SPLITS}
    assert all(fn.values())
    assert not fn["test"] & fn["train"] and not fn["validation"] & fn["train"] and not fn["test"] & fn["validation"]
    # the key is the function, not the spec: plus 3, plus 4 is plus 7
    a, b = program.render([("plus", 3, 1), ("plus", 4, 1), ("mod", 5, 1)])[1], program.render(
        [("plus", 7, 1), ("mod", 5, 1)])[1]
    assert program.function_key(a) == program.function_key(b) != program.function_key(a.replace("%5", "%6"))
    # the key covers every hidden input, and the label's outputs are the gold body's
    for e in _draw(t, "test", [0], 50):
        case = json.loads(e.label)
        key = program.function_key(case["gold"]).split(",")
        assert [int(key[v]) for v in case["inputs"]] == case["outputs"]
        assert t.cluster_key(e) == t.partition_key(e)
        assert len(set(key[:-1])) >= program.MIN_DISTINCT and key[:-1] != [str(v) for v in program.KEY_INPUTS]


def test_split_determinism_and_many_held_out_functions():
    """small-v2's setting (medium, n_test 256): 200+ distinct test and validation functions."""
    t = get_task("program", difficulty="medium")
    assert t.make_split("train", 60, seed=1) == t.make_split("train", 60, seed=1)
    assert t.make_split("train", 60, seed=1) != t.make_split("train", 60, seed=2)
    for split in ("test", "validation"):
        held = t.heldout(256, seed=0, split=split)
        assert len(held) == 256 and {t.split_of(e) for e in held} == {split}
        assert len({t.cluster_key(e) for e in held}) >= 200


def test_reward_func_routes_program_prompts():
    from trace.tasks.reward_func import infer_task, reward_func

    t = get_task("program", difficulty="easy")
    exs = t.make_split("test", 3, seed=0)
    assert {infer_task(e.prompt) for e in exs} == {"program"}
    qs = [e.prompt + r for e in exs for r in (t.sft_target(e), "zz\n")]
    out = reward_func(qs, [e.prompt for e in exs for _ in "ab"], [e.label for e in exs for _ in "ab"])
    assert out["scores"].tolist() == [1.0, 0.0] * 3 and out["extra_logs"]["correct_program"].sum().item() == 3


def test_bad_knobs():
    with pytest.raises(ValueError, match="kinds"):
        get_task("program", kinds=("square",))
    with pytest.raises(ValueError, match="first step"):
        get_task("program", kinds=("mod", "even"))
    with pytest.raises(ValueError, match="min_steps"):
        get_task("program", min_steps=2)
    with pytest.raises(ValueError, match="hidden_max"):
        get_task("program", hidden_max=150)
