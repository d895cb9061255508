"""Long-horizon task: a multi-turn guess-the-number environment with higher/lower feedback.

Transcript (policy text in [], environment text plain; the prompt is the first line plus ">"):

    Guess n in 3..17, 5 tries
    >[10\\n]higher
    >[14\\n]lower
    >[12\\n]correct

The rollout engine generates until the stop string "\\n", calls `GuessNumberEnv.step(action)`,
appends the returned observation (masked out of the loss) and continues until `done`.
`gold_transcript` gives the binary-search policy's full transcript plus a per-character mask
(True = policy/trainable, False = environment) for the supervised warm start.
Run: ``t = get_task("long_horizon", difficulty="easy"); env = t.make_env(ex); env.reset(ex)``.
Stands in for the paper's agentic multi-turn tasks, where environment tokens are also masked.

Reward: 1 when the number is found within ``max_turns`` else 0. With ``shaping > 0`` a win is
worth ``1 - shaping * (turns_used - 1) / (max_turns - 1)`` (fewer guesses, more reward), still in
[1 - shaping, 1]; default shaping 0, i.e. plain success. An unparsable guess costs a turn and gets
"invalid". Knobs: ``width`` (range size), ``max_turns``, ``offset_max`` (ranges start at
0..offset_max; test ranges are disjoint from train ranges because the prompt is the split key).

Splits and clusters: the prompt (the range and the tries) is the partition key and the cluster key; a
prompt's examples differ only in the secret, so held-out accuracy's standard error is clustered by prompt.
The presets keep every number at <= 2 digits, so they hold at most 100 - width + 1 distinct prompts (about a
fifth of them test); ``offset_max`` up to 999 - width allows three digits (e.g. easy with offset_max 992:
993 prompts, about 200 of them test, each guess at most "999\n", 4 tokens).
"""
from __future__ import annotations

import json
import math
import random
from typing import Callable

from trace.tasks.base import Example, Task, first_line, preset, register

PRESETS = {
    "easy": dict(width=7, max_turns=4, offset_max=40),
    "medium": dict(width=15, max_turns=5, offset_max=60),
    "hard": dict(width=31, max_turns=6, offset_max=68),  # keeps every number at <= 2 digits
}
TURN_PREFIX = ">"


def parse_label(example: Example) -> dict:
    d = json.loads(example.label)
    for k in ("secret", "lo", "hi", "max_turns"):
        if k not in d:
            raise ValueError(f"long_horizon label lacks {k!r}: {example.label!r}")
    return d


def _parse_guess(action_text: str) -> int | None:
    text = first_line(action_text).strip()
    body = text[1:] if text[:1] == "-" else text
    if not body or len(body) > 6 or not body.isascii() or not body.isdigit():
        return None
    return int(text)


class GuessNumberEnv:
    """One episode at a time; `reset` must be called before `step`."""

    def __init__(self, shaping: float = 0.0):
        if not 0.0 <= shaping < 1.0:
            raise ValueError(f"shaping must be in [0, 1), got {shaping}")
        self.shaping = shaping
        self._state: dict | None = None

    def reset(self, example: Example) -> str:
        d = parse_label(example)
        self._state = dict(d, turns=0, done=False)
        return example.prompt

    @property
    def turns_used(self) -> int:
        return 0 if self._state is None else self._state["turns"]

    def step(self, action_text: str) -> tuple[str, float, bool]:
        s = self._state
        if s is None:
            raise RuntimeError("call reset(example) before step()")
        if s["done"]:
            raise RuntimeError("episode is over; call reset(example)")
        s["turns"] += 1
        guess = _parse_guess(action_text)
        last = s["turns"] >= s["max_turns"]
        if guess is not None and guess == s["secret"]:
            s["done"] = True
            span = max(1, s["max_turns"] - 1)
            return "correct\n", 1.0 - self.shaping * (s["turns"] - 1) / span, True
        if last:
            s["done"] = True
            return "lost\n", 0.0, True
        if guess is None:
            word = "invalid"
        else:
            word = "higher" if s["secret"] > guess else "lower"
        return f"{word}\n{TURN_PREFIX}", 0.0, False


def run_episode(example: Example, policy: Callable[[str], str], shaping: float = 0.0,
                max_action_chars: int = 16) -> tuple[str, list[bool], float]:
    """Play one episode. `policy(context) -> action text` sees prompt + transcript so far.

    Returns (transcript after the prompt, trainable mask per character, reward). Actions are cut
    at the first newline (the stop string) or `max_action_chars`, as the rollout engine would.
    """
    env = GuessNumberEnv(shaping)
    context = env.reset(example)
    text, mask = "", []
    reward, done = 0.0, False
    while not done:
        action = policy(context + text)
        cut = action.find("\n")
        action = action[: cut + 1] if cut >= 0 else action[:max_action_chars]
        obs, reward, done = env.step(action)
        text += action + obs
        mask += [True] * len(action) + [False] * len(obs)
    return text, mask, reward


def bisection_guesses(example: Example) -> int:
    """Guesses the gold policy (bisection, below) needs to find the secret: 1 for the midpoint, up to
    ceil(log2(width + 1)) at the edges. A difficulty label for per-prompt breakdowns (analysis/compare.py)."""
    d = parse_label(example)
    lo, hi, n = d["lo"], d["hi"], 1
    while (g := (lo + hi) // 2) != d["secret"]:
        lo, hi, n = (g + 1, hi, n + 1) if g < d["secret"] else (lo, g - 1, n + 1)
    return n


def binary_search_policy(example: Example) -> Callable[[str], str]:
    """The gold policy: guess the midpoint of the interval consistent with the feedback so far."""
    d = parse_label(example)

    def policy(context: str) -> str:
        lo, hi = d["lo"], d["hi"]
        lines = context[len(example.prompt):].split("\n")
        for guess_line, feedback in zip(lines[0::2], lines[1::2], strict=False):
            g = _parse_guess(guess_line.lstrip(TURN_PREFIX))
            fb = feedback.lstrip(TURN_PREFIX)
            if g is None:
                continue
            if fb.startswith("higher"):
                lo = max(lo, g + 1)
            elif fb.startswith("lower"):
                hi = min(hi, g - 1)
        return f"{(lo + hi) // 2}\n"

    return policy


@register("long_horizon")
class LongHorizonTask(Task):
    name = "long_horizon"
    multi_turn = True

    def __init__(
        self,
        difficulty: str = "medium",
        width: int | None = None,
        max_turns: int | None = None,
        offset_max: int | None = None,
        shaping: float = 0.0,
        test_fraction: float = 0.2,
        val_fraction: float = 0.1,
    ):
        super().__init__(test_fraction, val_fraction)
        p = preset(PRESETS, difficulty, width=width, max_turns=max_turns, offset_max=offset_max)
        self.width, self.max_turns, self.offset_max = int(p["width"]), int(p["max_turns"]), int(p["offset_max"])
        self.shaping = float(shaping)
        if self.width < 2:
            raise ValueError("width must be >= 2")
        if self.max_turns < 1:
            raise ValueError("max_turns must be >= 1")
        if self.offset_max < 0:
            raise ValueError("offset_max must be >= 0")
        GuessNumberEnv(self.shaping)  # validates shaping

    @property
    def gold_solvable(self) -> bool:
        """Whether binary search always wins within max_turns (it needs ceil(log2(width+1)))."""
        return self.max_turns >= math.ceil(math.log2(self.width + 1))

    def knobs(self) -> dict:
        return dict(width=self.width, max_turns=self.max_turns, offset_max=self.offset_max)

    def unique_key(self, example: Example) -> str:
        return example.prompt + "|" + example.label

    def _generate(self, rng: random.Random) -> Example:
        lo = rng.randint(0, self.offset_max)
        hi = lo + self.width - 1
        secret = rng.randint(lo, hi)
        prompt = f"Guess n in {lo}..{hi}, {self.max_turns} tries\n{TURN_PREFIX}"
        label = json.dumps({"secret": secret, "lo": lo, "hi": hi, "max_turns": self.max_turns},
                           separators=(",", ":"))
        return Example(prompt=prompt, label=label, datasource=self.name,
                       meta={"lo": lo, "hi": hi, "max_turns": self.max_turns})

    def make_env(self, example: Example | None = None) -> GuessNumberEnv:
        env = GuessNumberEnv(self.shaping)
        if example is not None:
            env.reset(example)
        return env

    def gold_transcript(self, example: Example) -> tuple[str, list[bool]]:
        text, mask, _ = run_episode(example, binary_search_policy(example), self.shaping)
        return text, mask

    def _gold_response(self, example: Example) -> str:
        return self.gold_transcript(example)[0]

    def sft_target_and_mask(self, example: Example) -> tuple[str, list[bool]]:
        return self.gold_transcript(example)

    def score(self, example: Example, response: str) -> float:
        """Replay the actions in a finished transcript (prompt excluded) through a fresh env.

        The environment text in `response` must be exactly what the env says, so a transcript
        that skips or forges feedback scores 0; so does an unfinished episode.
        """
        env = GuessNumberEnv(self.shaping)
        env.reset(example)
        pos = 0
        while True:
            nl = response.find("\n", pos)
            if nl < 0:
                return 0.0
            obs, reward, done = env.step(response[pos : nl + 1])
            pos = nl + 1
            if done:
                # the final observation may be cut by the generation budget; the outcome stands
                return reward
            if response[pos : pos + len(obs)] != obs:
                return 0.0
            pos += len(obs)
