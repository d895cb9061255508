"""Program task: write a multi-statement function body from a step-by-step spec, checked on hidden inputs.

The long coding task (gold responses of 30+ tokens of the character tokenizer). The prompt names the steps in
words, then the function header; the gold response is the body, one statement per step, then ``return y`` and
an empty line (the stop string is ``"\\n\\n"``)::

    prompt   "steps: times 3, plus 4, if even halve, mod 7\\ndef f(x):\\n"
    response " y=x*3\\n y=y+4\\n if y%2==0: y=y//2\\n y=y%7\\n return y\\n\\n"

Steps (`KINDS`, word -> statement; the first step reads x, the others y): ``times c`` (y=y*c), ``plus c``,
``minus c``, ``div c`` (y=y//c), ``mod m``, ``if even halve`` (if y%2==0: y=y//2), ``if odd plus c``
(if y%2==1: y=y+c), ``if over t minus c`` (if y>t: y=y-c), ``if under t plus c`` (if y<t: y=y+c) and
``plus x`` (y=y+x). The first step is times, plus or minus. A spec whose function takes fewer than 3 values on
0..99 or is the identity there (``minus 3, plus 3``) is drawn again: a body that ignores the spec
(``return 0``, ``return x``) must not pass. Every gold response is
30+ characters (asserted); tests/tasks/test_program.py measures the presets' lengths.

Verifier: ``def f(x):`` + the response up to the first empty line is run on ``n_hidden`` inputs from
0..hidden_max (the prompt shows none); reward is all-or-nothing by default (every hidden input must return
exactly the expected int), ``partial_credit=True`` gives the fraction passed. A body of plain statements
(`pure_program`: assignments to plain names, if statements, return, pass and expression statements (a cut
``retur`` is one); + - * // %, unary minus,
comparisons, boolean operators and conditional expressions on names and int constants; every multiplication
with a constant operand, so a value's size is bounded by the response's length; no calls, attributes,
subscripts, loops, power, shift, strings or lambdas; names the harness defines go to the sandbox) is run in
this process with empty builtins, printing what the sandbox's harness prints (`run_pure`): a name the harness
does not define raises NameError here as there. Anything else runs in `trace.tasks.sandbox`, as in
trace/tasks/coding.py.

Splits are drawn by gold function (`function_key`: the gold body's outputs on 0..99, which covers every hidden
input), not by prompt: two specs that denote one function are in one split, so no test or validation function
is trained on under any spec; the held-out standard error is clustered by function.

Knobs: ``min_steps`` / ``max_steps`` (drawn uniformly per prompt), ``kinds`` (subset of `KINDS`),
``const_max`` (constants 1..const_max; times, div and mod from 2 and 3), ``threshold_max`` (the t of the
over / under steps, 1..threshold_max), ``n_hidden``, ``hidden_max``. Presets: easy = 3-4 steps of times, plus,
minus, mod and if-even-halve, constants up to 9 (gold 32-52 characters); medium = 4-5 steps of every kind,
constants up to 9, thresholds up to 50 (gold ~57 on average); hard = 5-6 steps, constants up to 19,
thresholds up to 99.
A tiny SFT base learns the translation almost exactly on functions it never saw (qwen3_moe-tiny, 400 steps: 0.89
of 64 test functions greedy); at temperature 1 its accuracy is set mostly by SFT label smoothing (DESIGN.md §4).
Run: ``t = get_task("program", difficulty="medium"); t.score_batch(exs, responses)``.
Stands in for the paper's code-RL data with long generations (whole function bodies verified by tests).
"""
from __future__ import annotations

import ast
import builtins
import functools
import json
import random

from trace.tasks.base import Example, Task, preset, register
from trace.tasks.coding import score_by_execution

HEADER = "def f(x):\n"
MIN_GOLD_CHARS = 30
MAX_BODY_CHARS = 600  # longer than any gold body; bounds the size of the ints a pure body can make
KEY_INPUTS = tuple(range(100))  # function_key's inputs: every hidden input is in 0..hidden_max <= 99
MIN_DISTINCT = 3  # a gold function takes at least this many values on KEY_INPUTS

# kind -> (words, statement); c: a constant, t: a threshold, v: the variable read (x in the first step)
KINDS = {
    "times": ("times {c}", "y={v}*{c}"),
    "plus": ("plus {c}", "y={v}+{c}"),
    "minus": ("minus {c}", "y={v}-{c}"),
    "div": ("div {c}", "y=y//{c}"),
    "mod": ("mod {c}", "y=y%{c}"),
    "even": ("if even halve", "if y%2==0: y=y//2"),
    "odd": ("if odd plus {c}", "if y%2==1: y=y+{c}"),
    "over": ("if over {t} minus {c}", "if y>{t}: y=y-{c}"),
    "under": ("if under {t} plus {c}", "if y<{t}: y=y+{c}"),
    "plusx": ("plus x", "y=y+x"),
}
FIRST_KINDS = ("times", "plus", "minus")
CONST_MIN = {"times": 2, "div": 2, "mod": 3}  # times 1, div 1, mod 1 and mod 2 say (almost) nothing

PRESETS = {
    "easy": dict(min_steps=3, max_steps=4, kinds=("times", "plus", "minus", "mod", "even"), const_max=9,
                 threshold_max=50),
    "medium": dict(min_steps=4, max_steps=5, kinds=tuple(KINDS), const_max=9, threshold_max=50),
    "hard": dict(min_steps=5, max_steps=6, kinds=tuple(KINDS), const_max=19, threshold_max=99),
}


def _apply(kind: str, y: int, c: int, t: int, x: int) -> int:
    """The trusted meaning of one step (Python's floor division and modulo, as in the statement)."""
    if kind == "times":
        return y * c
    if kind == "plus":
        return y + c
    if kind == "minus":
        return y - c
    if kind == "div":
        return y // c
    if kind == "mod":
        return y % c
    if kind == "even":
        return y // 2 if y % 2 == 0 else y
    if kind == "odd":
        return y + c if y % 2 == 1 else y
    if kind == "over":
        return y - c if y > t else y
    if kind == "under":
        return y + c if y < t else y
    if kind == "plusx":
        return y + x
    raise ValueError(f"unknown step kind {kind!r}; known: {sorted(KINDS)}")


def run_steps(steps: list[tuple[str, int, int]], x: int) -> int:
    y = x
    for kind, c, t in steps:
        y = _apply(kind, y, c, t, x)
    return y


def render(steps: list[tuple[str, int, int]]) -> tuple[str, str]:
    """The spec line and the gold body (one statement per step, then ``return y``, each indented one space)."""
    words, lines = [], []
    for i, (kind, c, t) in enumerate(steps):
        w, s = KINDS[kind]
        words.append(w.format(c=c, t=t))
        lines.append(" " + s.format(c=c, t=t, v="x" if i == 0 else "y"))
    return "steps: " + ", ".join(words), "".join(line + "\n" for line in lines) + " return y\n"


# What `score_batch` runs in this process: a function body of the statements and expression nodes below on
# plain names and int constants. Without loops or calls each statement runs at most once, and with a constant
# operand in every multiplication no value grows faster than the body's length allows (y=y*y repeated would
# square it per statement), so running it can only compute a bounded number or raise. Names the harness's f
# could see (builtins, the harness's globals, dunders) go to the sandbox; any other unassigned name raises
# NameError (or UnboundLocalError) here as there.
_PURE_STMTS = (ast.Assign, ast.AugAssign, ast.If, ast.Return, ast.Pass, ast.Expr)
_PURE_EXPRS = (ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.IfExp, ast.Constant, ast.Name, ast.Load,
               ast.Store, ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod, ast.USub, ast.UAdd, ast.Invert,
               ast.Not, ast.And, ast.Or, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE)
_HARNESS_NAMES = frozenset(dir(builtins)) | {"f", "_x", "_v"}  # what `harness`'s f(x) sees besides its locals


def _int_constant(node) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        node = node.operand
    return isinstance(node, ast.Constant) and type(node.value) is int


def _pure_node(node) -> bool:
    if isinstance(node, ast.Assign):
        return all(isinstance(t, ast.Name) for t in node.targets)
    if isinstance(node, ast.AugAssign):
        return isinstance(node.target, ast.Name) and (not isinstance(node.op, ast.Mult) or _int_constant(node.value))
    if isinstance(node, _PURE_STMTS):
        return True
    if not isinstance(node, _PURE_EXPRS):
        return False
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return _int_constant(node.left) or _int_constant(node.right)
    if isinstance(node, ast.Name):
        return node.id not in _HARNESS_NAMES and not node.id.startswith("__")
    if isinstance(node, ast.Constant):
        return type(node.value) is int
    return True


def parse_body(response: str) -> str | None:
    """The body the response writes (up to its first empty line, newline-terminated), or None when
    ``def f(x):`` + it is not a Python program (checked by parsing only; nothing of it runs here)."""
    body = response.split("\n\n", 1)[0]
    if not body.strip() or len(body) > MAX_BODY_CHARS or not body.isascii():
        return None
    body = body if body.endswith("\n") else body + "\n"
    try:
        ast.parse(HEADER + body)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    return body


def pure_program(body: str):
    """The compiled module defining f when `score_batch` may run it in this process (one function f(x) whose
    body holds only the nodes above), else None (it goes to the sandbox)."""
    tree = ast.parse(HEADER + body)
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef):
        return None  # top-level statements after the body: the harness runs them
    fn = tree.body[0]
    for stmt in fn.body:
        if not all(_pure_node(node) for node in ast.walk(stmt)):
            return None
    try:
        return compile(tree, "<program>", "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # what the compiler refuses the sandbox reports
        return None


def run_pure(code, inputs: list[int]) -> str:
    """What `harness` prints for a `pure_program` body: per input the repr of an int result, T for any other
    type, E where it raises."""
    scope = {"__builtins__": {}}
    exec(code, scope)  # defines f only: the module is one def statement
    f = scope["f"]
    out = []
    for v in inputs:
        try:
            r = f(v)
            out.append(repr(r) if type(r) is int else "T")
        except Exception:
            out.append("E")
    return "".join(line + "\n" for line in out)


@functools.lru_cache(maxsize=1 << 16)
def function_key(gold: str) -> str:
    """The function a gold body denotes, as its outputs on 0..99 (covering every hidden input): specs that
    differ only in form (``plus 3, plus 4`` and ``plus 7``) are one function. Gold bodies are the generator's
    own pure statements."""
    code = pure_program(gold)
    if code is None:
        raise ValueError(f"gold body {gold!r} is not made of plain statements")
    return run_pure(code, list(KEY_INPUTS)).replace("\n", ",")


def harness(body: str, inputs: list[int]) -> str:
    return (
        HEADER + body
        + f"for _x in {inputs!r}:\n"
        "    try:\n"
        "        _v = f(_x)\n"
        "        print(repr(_v) if type(_v) is int else 'T')\n"
        "    except Exception:\n"
        "        print('E')\n"
    )


@register("program")
class ProgramTask(Task):
    """Multi-statement function bodies from a spec in words (see the module docstring)."""

    name = "program"
    stop = "\n\n"

    def __init__(
        self,
        difficulty: str = "medium",
        min_steps: int | None = None,
        max_steps: int | None = None,
        kinds: tuple[str, ...] | list[str] | str | None = None,
        const_max: int | None = None,
        threshold_max: int | None = None,
        n_hidden: int = 8,
        hidden_max: int = 99,
        partial_credit: bool = False,
        timeout_s: float = 2.0,
        test_fraction: float = 0.2,
        val_fraction: float = 0.1,
    ):
        super().__init__(test_fraction, val_fraction)
        p = preset(PRESETS, difficulty, min_steps=min_steps, max_steps=max_steps, kinds=kinds, const_max=const_max,
                   threshold_max=threshold_max)
        self.min_steps, self.max_steps = int(p["min_steps"]), int(p["max_steps"])
        k = p["kinds"]
        self.kinds = tuple(k.split("+")) if isinstance(k, str) else tuple(k)
        self.const_max, self.threshold_max = int(p["const_max"]), int(p["threshold_max"])
        self.n_hidden, self.hidden_max = int(n_hidden), int(hidden_max)
        self.partial_credit = bool(partial_credit)
        self.timeout_s = float(timeout_s)
        if unknown := [k for k in self.kinds if k not in KINDS]:
            raise ValueError(f"unknown step kinds {unknown}; known: {sorted(KINDS)}")
        if not set(self.kinds) & set(FIRST_KINDS):
            raise ValueError(f"kinds must include one of {FIRST_KINDS} (the first step)")
        if not 3 <= self.min_steps <= self.max_steps:
            raise ValueError(f"need 3 <= min_steps <= max_steps, got {self.min_steps}, {self.max_steps}")
        if self.const_max < 3 or self.threshold_max < 1:
            raise ValueError("need const_max >= 3 and threshold_max >= 1")
        if not 1 <= self.n_hidden <= self.hidden_max + 1 or not 0 <= self.hidden_max <= KEY_INPUTS[-1]:
            raise ValueError(f"need 1 <= n_hidden <= hidden_max + 1 and hidden_max <= {KEY_INPUTS[-1]}")

    def knobs(self) -> dict:
        return dict(min_steps=self.min_steps, max_steps=self.max_steps, kinds="+".join(self.kinds),
                    const_max=self.const_max, threshold_max=self.threshold_max, n_hidden=self.n_hidden,
                    hidden_max=self.hidden_max)

    def partition_key(self, example: Example) -> str:
        """The gold function (`function_key`): every spec of one function is in one split, so no test function
        is ever trained on."""
        return function_key(example.meta["gold"] if "gold" in example.meta else json.loads(example.label)["gold"])

    def _steps(self, rng: random.Random) -> list[tuple[str, int, int]]:
        steps = []
        first = [k for k in self.kinds if k in FIRST_KINDS]
        for i in range(rng.randint(self.min_steps, self.max_steps)):
            kind = rng.choice(first if i == 0 else self.kinds)
            c = rng.randint(CONST_MIN.get(kind, 1), self.const_max)
            t = rng.randint(1, self.threshold_max)
            steps.append((kind, c, t))
        return steps

    def _generate(self, rng: random.Random) -> Example:
        while True:  # draw again while the function is (nearly) constant or the identity on KEY_INPUTS
            steps = self._steps(rng)
            out = [run_steps(steps, x) for x in KEY_INPUTS]
            if len(set(out)) >= MIN_DISTINCT and out != list(KEY_INPUTS):
                break
        spec, gold = render(steps)
        assert len(gold) + 1 >= MIN_GOLD_CHARS, gold  # the response is the body and the stop's second newline
        hidden = sorted(rng.sample(range(self.hidden_max + 1), self.n_hidden))
        label = json.dumps({"inputs": hidden, "outputs": [run_steps(steps, x) for x in hidden], "gold": gold},
                           separators=(",", ":"))
        return Example(prompt=spec + "\n" + HEADER, label=label, datasource=self.name,
                       meta={"gold": gold, "n_steps": len(steps)})

    def _gold_response(self, example: Example) -> str:
        return json.loads(example.label)["gold"] + "\n"

    def score(self, example: Example, response: str) -> float:
        return self.score_batch([example], [response])[0]

    def score_batch(self, examples: list[Example], responses: list[str]) -> list[float]:
        """One run per distinct (body, hidden inputs), RL groups repeat a lot: in-process for plain statements
        (`pure_program`), else one sandbox process (`trace.tasks.coding.score_by_execution`)."""
        return score_by_execution(examples, responses, parse_body, pure_program, run_pure, harness, self.timeout_s,
                                  self.partial_credit)
