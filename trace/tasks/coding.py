"""Coding task: write a program from input/output examples, checked by running it on hidden cases.

For tiny character-level policies the program is one Python expression in `x`:
prompt ``"f(1)=3 f(2)=5 f(3)=7\\ndef f(x): return"``, gold response ``" 2*x+1\\n"``.
The verifier builds ``def f(x): return <first response line>`` and runs it inside
`trace.tasks.sandbox` on hidden inputs (never shown in the prompt); an expression of arithmetic,
comparison and boolean operators on ``x`` and numeric constants (names the harness does not define
allowed: they raise there as here; no power, shift, string, call, attribute or subscript: `pure_arithmetic`)
is evaluated in this process instead, with the harness's exact outputs (its cost is bounded by its
length, and it can do nothing but compute or raise), because a fresh sandboxed interpreter costs
~20 ms of CPU per program and an RL batch of the coding task is mostly such expressions. Reward is all-or-nothing by
default (every hidden case must return exactly the expected int, as in pass@1 unit testing);
``partial_credit=True`` gives the fraction of hidden cases passed instead.
Run: ``t = get_task("coding", difficulty="easy"); t.score_batch(exs, responses)``.
Stands in for the paper's code-RL data (programs verified by test execution).

Splits are drawn by gold function (`function_key`, the function's outputs on 0..63), not by prompt: a test
or validation function never appears in training, under any of its shown inputs, and the held-out
standard error is clustered by function. The presets' function spaces are small (easy: 42 linear
functions, about 9 of them test), so a profile that needs many test functions raises ``coef_max``.

Knobs: ``families`` (linear, quadratic, mod, const), ``coef_max`` (coefficient range),
``n_shown`` (examples in the prompt), ``x_max`` (shown inputs from 0..x_max), ``n_hidden``.

Not adversarially robust: an expression could print extra lines or patch builtins to fake
harness output; extra output lines fail the case check, which is enough against policies that
are rewarded for working programs, and the sandbox contains anything worse.
"""
from __future__ import annotations

import ast
import builtins
import functools
import json
import random

from trace.tasks.base import Example, Task, first_line, preset, register
from trace.tasks.sandbox import run_many

PROMPT_SUFFIX = "def f(x): return"
FAMILIES = ("const", "linear", "quadratic", "mod")
MAX_EXPR_CHARS = 200

PRESETS = {
    "easy": dict(families=("linear",), coef_max=3, n_shown=3, x_max=5),
    "medium": dict(families=("linear", "mod"), coef_max=5, n_shown=3, x_max=9),
    "hard": dict(families=("linear", "quadratic", "mod"), coef_max=9, n_shown=4, x_max=9),
}


def _term(coef: int, var: str, first: bool) -> str:
    if coef == 0:
        return ""
    sign = "-" if coef < 0 else ("" if first else "+")
    mag = abs(coef)
    if not var:
        return f"{sign}{mag}"
    return f"{sign}{var}" if mag == 1 else f"{sign}{mag}*{var}"


def _poly(coefs: list[tuple[int, str]]) -> str:
    out = ""
    for c, var in coefs:
        out += _term(c, var, first=not out)
    return out or "0"


def _nonzero(rng: random.Random, m: int) -> int:
    v = rng.randint(1, m)
    return v if rng.random() < 0.5 else -v


def sample_function(rng: random.Random, family: str, coef_max: int) -> tuple[str, callable]:
    """A canonical expression string and the trusted Python function it denotes."""
    if family == "const":
        b = rng.randint(-coef_max, coef_max)
        return _poly([(b, "")]), lambda x: b
    if family == "linear":
        a, b = _nonzero(rng, coef_max), rng.randint(-coef_max, coef_max)
        return _poly([(a, "x"), (b, "")]), lambda x: a * x + b
    if family == "quadratic":
        a, b, c = rng.randint(1, coef_max), rng.randint(-coef_max, coef_max), rng.randint(-coef_max, coef_max)
        return _poly([(a, "x*x"), (b, "x"), (c, "")]), lambda x: a * x * x + b * x + c
    if family == "mod":
        a, b, m = rng.randint(1, coef_max), rng.randint(0, coef_max), rng.randint(2, coef_max + 2)
        inner = _poly([(a, "x"), (b, "")])
        expr = f"x%{m}" if inner == "x" else f"({inner})%{m}"
        return expr, lambda x: (a * x + b) % m
    raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")


def clean_expression(response: str) -> str | None:
    """The candidate expression, or None when it cannot be a valid one (checked without running)."""
    expr = first_line(response).strip()
    if not expr or len(expr) > MAX_EXPR_CHARS or not expr.isascii():
        return None
    try:
        ast.parse(expr, mode="eval")  # parsing only; nothing from the response runs in this process
    except (SyntaxError, ValueError):
        return None
    return expr


# What `score_batch` evaluates in-process: arithmetic, comparisons and boolean operators on x and numeric
# constants. No power or shift (their results' size is not bounded by the expression's length), no strings
# (repetition is not either), no calls, attributes, subscripts, lambdas, conditionals or identity / membership
# tests, so evaluating it can only compute a bounded number or raise. A name other than x is allowed when the
# harness's function cannot see it either (not a builtin, not one of the harness's globals, no dunder): it
# raises NameError there as here. An RL batch of a character-level policy is mostly such expressions, and its
# misspelt names (`2*xk+1`) were most of what reached the sandbox.
_PURE_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.Constant, ast.Name, ast.Load,
               ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.USub, ast.UAdd, ast.Invert, ast.Not,
               ast.And, ast.Or, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE)
_PURE_CONSTANTS = (int, float, complex, bool, type(None))
_HARNESS_NAMES = frozenset(dir(builtins)) | {"f", "_x", "_v"}  # what `harness`'s f(x) sees besides x


def pure_arithmetic(expr: str):
    """The compiled expression when `score_batch` may evaluate it in this process (`_PURE_NODES`, numeric
    constants, x and names the harness does not define), else None (it goes to the sandbox)."""
    tree = ast.parse(expr, mode="eval")
    for node in ast.walk(tree):
        if not isinstance(node, _PURE_NODES):
            return None
        if isinstance(node, ast.Name) and node.id != "x" and (node.id in _HARNESS_NAMES or node.id.startswith("__")):
            return None
        if isinstance(node, ast.Constant) and type(node.value) not in _PURE_CONSTANTS:
            return None
    return compile(tree, "<expression>", "eval")


def run_pure(code, inputs: list[int]) -> str:
    """What `harness` prints for a `pure_arithmetic` expression: per input the repr of an int result, T for
    any other type, E where it raises."""
    out = []
    for v in inputs:
        try:
            r = eval(code, {"__builtins__": {}}, {"x": v})
        except Exception:
            out.append("E")
        else:
            out.append(repr(r) if type(r) is int else "T")
    return "".join(line + "\n" for line in out)


KEY_INPUTS = tuple(range(64))


@functools.lru_cache(maxsize=1 << 16)
def function_key(gold: str) -> str:
    """The function a gold expression denotes, as its outputs on 0..63 (a fixed range that covers every
    shown and hidden input of the presets): expressions that differ only in form (``(2*x+6)%5`` and
    ``(2*x+1)%5``) are one function. Gold expressions are the generator's own pure arithmetic."""
    code = pure_arithmetic(gold)
    if code is None:
        raise ValueError(f"gold expression {gold!r} is not plain arithmetic on x")
    return run_pure(code, list(KEY_INPUTS)).replace("\n", ",")


def harness(expr: str, inputs: list[int]) -> str:
    return (
        f"def f(x): return {expr}\n"
        f"for _x in {inputs!r}:\n"
        "    try:\n"
        "        _v = f(_x)\n"
        "        print(repr(_v) if type(_v) is int else 'T')\n"
        "    except Exception:\n"
        "        print('E')\n"
    )


def score_by_execution(examples: list[Example], responses: list[str], parse, pure, run_in_process, make_harness,
                       timeout_s: float, partial_credit: bool) -> list[float]:
    """Scores of responses that are programs, checked on each example's hidden cases (its label's `inputs` and
    `outputs`), shared by the coding tasks. `parse(response)` gives the program text or None (score 0);
    `pure(program)` its compiled form where it may run in this process (`run_in_process(code, inputs)` prints
    what the harness would), else None, and then `make_harness(program, inputs)` is run in the sandbox. One run
    per distinct (program, hidden inputs): RL groups repeat a lot. All-or-nothing unless `partial_credit` (the
    fraction of cases passed)."""
    if len(examples) != len(responses):
        raise ValueError(f"{len(examples)} examples but {len(responses)} responses")
    jobs: dict[tuple[str, str], int] = {}
    keys: list[tuple[str, str] | None] = []
    cases = []
    for ex, resp in zip(examples, responses, strict=True):
        case = json.loads(ex.label)
        cases.append(case)
        prog = parse(resp)
        if prog is None:
            keys.append(None)
            continue
        key = (prog, json.dumps(case["inputs"]))
        jobs.setdefault(key, len(jobs))
        keys.append(key)
    stdout: list[str | None] = [None] * len(jobs)  # what the harness printed; None: killed by the sandbox
    boxed = []  # (job, program, inputs) for the sandbox
    for (prog, inp), j in jobs.items():
        code = pure(prog)
        if code is not None:
            stdout[j] = run_in_process(code, json.loads(inp))
        else:
            boxed.append((j, prog, json.loads(inp)))
    sources = [make_harness(prog, inputs) for _, prog, inputs in boxed]
    results = run_many(sources, timeout_s=timeout_s, max_output_bytes=16_000) if sources else []
    for (j, _, _), r in zip(boxed, results, strict=True):
        stdout[j] = None if r.killed_reason is not None else r.stdout
    scores = []
    for key, case in zip(keys, cases, strict=True):
        if key is None:
            scores.append(0.0)
            continue
        out = stdout[jobs[key]]
        lines = [] if out is None else out.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        want = [repr(int(v)) for v in case["outputs"]]
        if out is None or len(lines) != len(want):
            scores.append(0.0)
            continue
        passed = sum(g == w for g, w in zip(lines, want, strict=True))
        scores.append(passed / len(want) if partial_credit else float(passed == len(want)))
    return scores


@register("coding")
class CodingTask(Task):
    name = "coding"

    def __init__(
        self,
        difficulty: str = "medium",
        families: tuple[str, ...] | list[str] | str | None = None,
        coef_max: int | None = None,
        n_shown: int | None = None,
        x_max: int | None = None,
        n_hidden: int = 5,
        hidden_max: int = 20,
        partial_credit: bool = False,
        timeout_s: float = 2.0,
        test_fraction: float = 0.2,
        val_fraction: float = 0.1,
    ):
        super().__init__(test_fraction, val_fraction)
        p = preset(PRESETS, difficulty, families=families, coef_max=coef_max, n_shown=n_shown, x_max=x_max)
        fams = p["families"]
        self.families = (fams,) if isinstance(fams, str) else tuple(fams)
        for fam in self.families:
            if fam not in FAMILIES:
                raise ValueError(f"unknown family {fam!r}; known: {FAMILIES}")
        self.coef_max, self.n_shown, self.x_max = int(p["coef_max"]), int(p["n_shown"]), int(p["x_max"])
        self.n_hidden = int(n_hidden)
        self.hidden_max = int(hidden_max)
        self.partial_credit = bool(partial_credit)
        self.timeout_s = float(timeout_s)
        if self.n_shown < 1 or self.n_shown > self.x_max + 1:
            raise ValueError(f"n_shown must be in 1..x_max+1 ({self.x_max + 1}), got {self.n_shown}")
        if self.n_hidden < 1 or self.hidden_max + 1 - self.n_shown < self.n_hidden:
            raise ValueError("need n_hidden >= 1 and enough unshown inputs in 0..hidden_max")
        if self.coef_max < 1:
            raise ValueError("coef_max must be >= 1")

    def knobs(self) -> dict:
        return dict(families="+".join(self.families), coef_max=self.coef_max, n_shown=self.n_shown,
                    x_max=self.x_max, n_hidden=self.n_hidden, hidden_max=self.hidden_max)

    def partition_key(self, example: Example) -> str:
        """The gold function (`function_key`): every prompt of one function, whatever inputs it shows, is in
        one split, so no test function is ever seen in training."""
        return function_key(example.meta["gold"] if "gold" in example.meta else json.loads(example.label)["gold"])

    def _generate(self, rng: random.Random) -> Example:
        family = rng.choice(self.families)
        expr, fn = sample_function(rng, family, self.coef_max)
        shown = sorted(rng.sample(range(self.x_max + 1), self.n_shown))
        hidden = sorted(rng.sample([x for x in range(self.hidden_max + 1) if x not in shown], self.n_hidden))
        prompt = " ".join(f"f({x})={fn(x)}" for x in shown) + "\n" + PROMPT_SUFFIX
        label = json.dumps({"inputs": hidden, "outputs": [fn(x) for x in hidden], "gold": expr},
                           separators=(",", ":"))
        return Example(prompt=prompt, label=label, datasource=self.name,
                       meta={"family": family, "gold": expr, "shown": shown})

    def _gold_response(self, example: Example) -> str:
        return " " + json.loads(example.label)["gold"] + "\n"

    def score(self, example: Example, response: str) -> float:
        return self.score_batch([example], [response])[0]

    def score_batch(self, examples: list[Example], responses: list[str]) -> list[float]:
        """One evaluation per distinct (expression, hidden inputs), RL groups repeat a lot: in-process for
        integer arithmetic on x (`pure_arithmetic`), else one sandbox process (`score_by_execution`)."""
        return score_by_execution(examples, responses, clean_expression, pure_arithmetic, run_pure, harness,
                                  self.timeout_s, self.partial_credit)
