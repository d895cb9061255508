"""Reasoning task: multi-step integer arithmetic with exact-match verification.

Prompt ``"Q: 3+4*2-1=\\nA:"``, gold response ``"10\\n"`` (usual precedence: * before + and -).
Run: ``get_task("reasoning", difficulty="easy").make_split("train", 256, seed=0)``.
Stands in for the paper's math-reasoning RL data (GSM8K/DAPO-style, verified by final-answer
match); the verifier here is the same kind: parse the first response line as an int, exact match.

Difficulty knobs: ``n_operands`` (steps + 1), ``max_value`` (operands drawn from 0..max_value),
``ops`` (subset of "+-*"). Presets: easy = 2 operands 0..9 "+-" (about 200 distinct prompts, a
tiny model learns most of it after SFT); medium = 3 operands 0..9 "+-*"; hard = 4 operands 0..20.
"""
from __future__ import annotations

import random

from trace.tasks.base import Example, Task, first_line, register

PRESETS = {
    "easy": dict(n_operands=2, max_value=9, ops="+-"),
    "medium": dict(n_operands=3, max_value=9, ops="+-*"),
    "hard": dict(n_operands=4, max_value=20, ops="+-*"),
}


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


def parse_int_answer(response: str) -> int | None:
    text = first_line(response).strip()
    # int() accepts "1_000" and unicode digits; the answer format is plain ASCII digits only.
    body = text[1:] if text[:1] == "-" else text
    if not body or not body.isascii() or not body.isdigit():
        return None
    return int(text)


@register("reasoning")
class ReasoningTask(Task):
    name = "reasoning"

    def __init__(
        self,
        difficulty: str = "medium",
        n_operands: int | None = None,
        max_value: int | None = None,
        ops: str | None = None,
        test_fraction: float = 0.2,
    ):
        super().__init__(test_fraction)
        if difficulty not in PRESETS:
            raise ValueError(f"difficulty must be one of {sorted(PRESETS)}, got {difficulty!r}")
        p = PRESETS[difficulty]
        self.n_operands = int(n_operands if n_operands is not None else p["n_operands"])
        self.max_value = int(max_value if max_value is not None else p["max_value"])
        self.ops = ops if ops is not None else p["ops"]
        if self.n_operands < 2:
            raise ValueError("n_operands must be >= 2")
        if self.max_value < 1:
            raise ValueError("max_value must be >= 1")
        if not self.ops or set(self.ops) - set("+-*"):
            raise ValueError(f"ops must be a non-empty subset of '+-*', got {self.ops!r}")

    def knobs(self) -> dict:
        return dict(n_operands=self.n_operands, max_value=self.max_value, ops=self.ops)

    def _generate(self, rng: random.Random) -> Example:
        operands = [rng.randint(0, self.max_value) for _ in range(self.n_operands)]
        ops = [rng.choice(self.ops) for _ in range(self.n_operands - 1)]
        expr = str(operands[0]) + "".join(o + str(v) for o, v in zip(ops, operands[1:], strict=True))
        answer = evaluate(operands, ops)
        return Example(
            prompt=f"Q: {expr}=\nA:",
            label=str(answer),
            datasource=self.name,
            meta={"expr": expr},
        )

    def _gold_response(self, example: Example) -> str:
        return f"{example.label}\n"

    def score(self, example: Example, response: str) -> float:
        got = parse_int_answer(response)
        return 1.0 if got is not None and got == int(example.label) else 0.0
