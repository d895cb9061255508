"""Reasoning tasks: integer arithmetic with exact-match verification of the final answer.

Two tasks, both over expressions of non-negative integer operands and the operators + - * with the usual
precedence (* before + and -, otherwise left to right):

``reasoning`` (long answers, the RL task of the tables): the gold response shows its work, one reduction
per line, then the answer line and an empty line::

    prompt   "Q: 12+34*5-6*7+8=\\nSteps:\\n"
    response "12+170-6*7+8\\n12+170-42+8\\n182-42+8\\n140+8\\n148\\nanswer: 148\\n\\n"

Reduction order (`reduction_steps`): while a * is left, the leftmost * is replaced by its product;
then the leftmost operation (+ or -) is replaced by its result, until one number is left. Each line is
the whole expression after one reduction (operands - 1 lines, the last one the value). Products are
non-negative, so only the leading number of a line can be negative (``-38+3``), and a line never holds
``+-`` or ``--``. The answer line is ``answer: N`` (N an optional ``-`` and ASCII digits) and the
response ends with an empty line: the stop string is ``"\\n\\n"``. Reward (`parse_final_answer`): the
first line that starts with ``answer:`` (surrounding spaces ignored) gives the answer; 1 when it is
exactly the value, 0 when it differs, when no such line exists or when what follows ``answer:`` is not
an integer (the work lines are not checked: only the final answer is scored, as in math-RL verifiers).
Knobs: ``min_operands`` / ``max_operands`` (drawn uniformly per prompt; ``n_operands`` sets both),
``max_value`` (operands 0..max_value), ``ops`` (subset of "+-*"). Presets: easy = 4-6 operands 0..49;
medium = 4-8 operands 0..99 (gold responses about 80 characters, i.e. tokens of the character tokenizer,
on average); hard = 6-8 operands 0..99. tests/tasks/test_reasoning.py measures the lengths.

``reasoning-short`` (answers of a few tokens): prompt ``"Q: 3+4*2-1=\\nA:"``, gold response ``"10\\n"``;
the verifier parses the first response line as an int. Presets: easy = 2 operands 0..9 "+-" (about 200
distinct prompts); medium = 3 operands 0..9 "+-*"; hard = 4 operands 0..20. Its prompts and splits are
the ones this task had under the name ``reasoning`` (the split hash and the RNG streams keep that name).

Run: ``get_task("reasoning", difficulty="medium").make_split("train", 256, seed=0)``.
Stands in for the paper's math-reasoning RL data (GSM8K/DAPO-style, long worked solutions verified by
final-answer match).
"""
from __future__ import annotations

import random
import re

from trace.tasks.base import Example, Task, first_line, preset, register

SHORT_PRESETS = {
    "easy": dict(n_operands=2, max_value=9, ops="+-"),
    "medium": dict(n_operands=3, max_value=9, ops="+-*"),
    "hard": dict(n_operands=4, max_value=20, ops="+-*"),
}
PRESETS = {
    "easy": dict(min_operands=4, max_operands=6, max_value=49, ops="+-*"),
    "medium": dict(min_operands=4, max_operands=8, max_value=99, ops="+-*"),
    "hard": dict(min_operands=6, max_operands=8, max_value=99, ops="+-*"),
}
ANSWER_PREFIX = "answer:"
MAX_ANSWER_DIGITS = 40  # longer than any value the presets produce; int() of thousands of digits raises


def evaluate(operands: list[int], ops: list[str]) -> int:
    """Left-to-right with * binding tighter, written out so no eval() is ever needed."""
    terms = [operands[0]]
    signs = [1]
    for op, v in zip(ops, operands[1:], strict=True):
        if op == "*":
            terms[-1] *= v
        else:
            terms.append(v)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms, strict=True))


def render(operands: list[int], ops: list[str]) -> str:
    return str(operands[0]) + "".join(o + str(v) for o, v in zip(ops, operands[1:], strict=True))


def reduction_steps(operands: list[int], ops: list[str]) -> list[str]:
    """The expression after each reduction: the leftmost * while one is left, then the leftmost + or -.
    The last line is the value (`evaluate`)."""
    vals, ops = list(operands), list(ops)
    lines = []
    while ops:
        i = ops.index("*") if "*" in ops else 0
        a, b, op = vals[i], vals[i + 1], ops[i]
        vals[i : i + 2] = [a * b if op == "*" else a + b if op == "+" else a - b]
        del ops[i]
        lines.append(render(vals, ops))
    return lines


def parse_expr(expr: str) -> tuple[list[int], list[str]]:
    """Operands and operators of a rendered expression (non-negative operands, operators in "+-*")."""
    parts, ops = re.split(r"[-+*]", expr), re.findall(r"[-+*]", expr)
    operands = [int(p) for p in parts if p.isascii() and p.isdigit()]
    if len(operands) != len(parts) or render(operands, ops) != expr:
        raise ValueError(f"not an expression of non-negative integers and + - *: {expr!r}")
    return operands, ops


def _int_text(text: str, max_digits: int | None = None) -> int | None:
    """An optional '-' and ASCII digits (int() alone would accept '1_000', '+5' and unicode digits)."""
    body = text[1:] if text[:1] == "-" else text
    if not body or not body.isascii() or not body.isdigit():
        return None
    if max_digits is not None and len(body) > max_digits:
        return None
    return int(text)


def parse_int_answer(response: str) -> int | None:
    """reasoning-short: the first response line, stripped, as an int; None when it is not one."""
    return _int_text(first_line(response).strip())


def parse_final_answer(response: str) -> int | None:
    """reasoning: the int on the first line that starts with ``answer:`` (spaces around the line and the
    number ignored); None when there is no such line or it does not hold exactly one integer."""
    for line in response.split("\n"):
        s = line.strip()
        if s.startswith(ANSWER_PREFIX):
            return _int_text(s[len(ANSWER_PREFIX):].strip(), MAX_ANSWER_DIGITS)
    return None


def _check_ops(ops: str, max_value: int) -> None:
    if max_value < 1:
        raise ValueError("max_value must be >= 1")
    if not ops or set(ops) - set("+-*"):
        raise ValueError(f"ops must be a non-empty subset of '+-*', got {ops!r}")


@register("reasoning")
class ReasoningTask(Task):
    """Arithmetic with worked, multi-line gold responses (see the module docstring)."""

    name = "reasoning"
    stream_name = "reasoning-steps"
    stop = "\n\n"

    def __init__(
        self,
        difficulty: str = "medium",
        min_operands: int | None = None,
        max_operands: int | None = None,
        n_operands: int | None = None,
        max_value: int | None = None,
        ops: str | None = None,
        test_fraction: float = 0.2,
        val_fraction: float = 0.1,
    ):
        super().__init__(test_fraction, val_fraction)
        if n_operands is not None:
            min_operands = max_operands = n_operands
        p = preset(PRESETS, difficulty, min_operands=min_operands, max_operands=max_operands, max_value=max_value,
                   ops=ops)
        self.min_operands, self.max_operands = int(p["min_operands"]), int(p["max_operands"])
        self.max_value, self.ops = int(p["max_value"]), p["ops"]
        if not 2 <= self.min_operands <= self.max_operands:
            raise ValueError(f"need 2 <= min_operands <= max_operands, got {self.min_operands}, {self.max_operands}")
        _check_ops(self.ops, self.max_value)

    def knobs(self) -> dict:
        return dict(min_operands=self.min_operands, max_operands=self.max_operands, max_value=self.max_value,
                    ops=self.ops)

    def _generate(self, rng: random.Random) -> Example:
        k = rng.randint(self.min_operands, self.max_operands)
        operands = [rng.randint(0, self.max_value) for _ in range(k)]
        ops = [rng.choice(self.ops) for _ in range(k - 1)]
        expr = render(operands, ops)
        return Example(prompt=f"Q: {expr}=\nSteps:\n", label=str(evaluate(operands, ops)), datasource=self.name,
                       meta={"expr": expr, "steps": reduction_steps(operands, ops)})

    def _gold_response(self, example: Example) -> str:
        steps = example.meta.get("steps") or reduction_steps(*parse_expr(example.meta["expr"]))
        return "".join(line + "\n" for line in steps) + f"{ANSWER_PREFIX} {example.label}\n\n"

    def score(self, example: Example, response: str) -> float:
        got = parse_final_answer(response)
        return 1.0 if got is not None and got == int(example.label) else 0.0


@register("reasoning-short")
class ShortReasoningTask(Task):
    """Arithmetic answered with the value alone (see the module docstring)."""

    name = "reasoning-short"
    stream_name = "reasoning"

    def __init__(
        self,
        difficulty: str = "medium",
        n_operands: int | None = None,
        max_value: int | None = None,
        ops: str | None = None,
        test_fraction: float = 0.2,
        val_fraction: float = 0.1,
    ):
        super().__init__(test_fraction, val_fraction)
        p = preset(SHORT_PRESETS, difficulty, n_operands=n_operands, max_value=max_value, ops=ops)
        self.n_operands, self.max_value, self.ops = int(p["n_operands"]), int(p["max_value"]), p["ops"]
        if self.n_operands < 2:
            raise ValueError("n_operands must be >= 2")
        _check_ops(self.ops, self.max_value)

    def knobs(self) -> dict:
        return dict(n_operands=self.n_operands, max_value=self.max_value, ops=self.ops)

    def _generate(self, rng: random.Random) -> Example:
        operands = [rng.randint(0, self.max_value) for _ in range(self.n_operands)]
        ops = [rng.choice(self.ops) for _ in range(self.n_operands - 1)]
        expr = render(operands, ops)
        return Example(prompt=f"Q: {expr}=\nA:", label=str(evaluate(operands, ops)), datasource=self.name,
                       meta={"expr": expr})

    def _gold_response(self, example: Example) -> str:
        return f"{example.label}\n"

    def score(self, example: Example, response: str) -> float:
        got = parse_int_answer(response)
        return 1.0 if got is not None and got == int(example.label) else 0.0
