"""Task interface shared by the synthetic RL tasks (reasoning, coding, long-horizon).

A task turns a seed into a fixed list of `Example`s, scores a policy response with a verifier
(reward in [0, 1], 1 = correct) and gives the gold response used for the supervised warm start.
Usage: ``get_task("reasoning", difficulty="easy").make_split("train", 512, seed=0)``.
Compared against: the paper's real datasets (math, code, agent tasks), which are loaded through
`trace.tasks.datasets.load_jsonl` at paper scale; these generators stand in for them on CPU.

Splits: train, validation and test, disjoint whatever the seed. Every example is assigned to one split by a
stable hash h in [0, 1) of (task name, partition key): test when h < test_fraction, validation when
test_fraction <= h < test_fraction + val_fraction, train otherwise. So a test (or validation) prompt can never be
drawn for any train seed, the test split does not depend on val_fraction, and val_fraction=0 gives the train
split a task had before it had a validation split. The validation split is for choices of configuration only
(`eval.split: validation`); tables report the test split. The partition key is the unit a split is drawn by
(the prompt; coding: the gold function), and `cluster_key`, the unit a standard error is clustered by, is the
same unit (long-horizon: the prompt, shared by the secrets drawn for it).
"""
from __future__ import annotations

import hashlib
import random
import warnings
from dataclasses import dataclass, field
from typing import Callable, ClassVar

# The tokenizer of the tiny models knows printable ASCII plus newline and nothing else.
CHARSET = frozenset(chr(c) for c in range(32, 127)) | {"\n"}
SPLITS = ("train", "validation", "test")
EVAL_SPLITS = ("test", "validation")


def check_charset(text: str, what: str = "text") -> str:
    """Return `text` unchanged, or raise naming the first character the tokenizer cannot encode."""
    for i, ch in enumerate(text):
        if ch not in CHARSET:
            raise ValueError(f"{what} has character {ch!r} at {i} outside printable ASCII + newline")
    return text


@dataclass
class Example:
    prompt: str
    label: str
    datasource: str
    meta: dict = field(default_factory=dict)


def stable_fraction(*parts: str) -> float:
    """A hash in [0, 1) that is identical across processes and Python versions (unlike hash())."""
    h = hashlib.blake2b("\x1f".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0**64


class Task:
    """Base class. Subclasses implement `_generate`, `score` and `_gold_response`."""

    name: ClassVar[str] = "task"
    # the name in the split hash and the RNG stream name (`name` when None): a task renamed keeps its splits
    stream_name: ClassVar[str | None] = None
    stop: ClassVar[str] = "\n"
    multi_turn: ClassVar[bool] = False

    def __init__(self, test_fraction: float = 0.2, val_fraction: float = 0.1):
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
        if not 0.0 <= val_fraction < 1.0 - test_fraction:
            raise ValueError(f"val_fraction must be in [0, 1 - test_fraction), got {val_fraction}")
        self.test_fraction = test_fraction
        self.val_fraction = val_fraction

    # -- to implement -------------------------------------------------------------------------
    def _generate(self, rng: random.Random) -> Example:
        raise NotImplementedError

    def _gold_response(self, example: Example) -> str:
        raise NotImplementedError

    def score(self, example: Example, response: str) -> float:
        raise NotImplementedError

    def knobs(self) -> dict:
        """The settings that change which examples are generated (part of the RNG stream name)."""
        return {}

    # -- shared -------------------------------------------------------------------------------
    @property
    def hash_name(self) -> str:
        return self.stream_name or self.name

    def partition_key(self, example: Example) -> str:
        """The unit a split is drawn by: examples with one key are all in one split."""
        return example.prompt

    def cluster_key(self, example: Example) -> str:
        """The unit held-out accuracy's standard error is clustered by (trace/episode.py): the partition key,
        since that is what the test split samples independently."""
        return self.partition_key(example)

    def unique_key(self, example: Example) -> str:
        return example.prompt

    def split_of(self, example: Example) -> str:
        frac = stable_fraction(self.hash_name, self.partition_key(example))
        if frac < self.test_fraction:
            return "test"
        return "validation" if frac < self.test_fraction + self.val_fraction else "train"

    def make_split(self, split: str, n: int, seed: int, repeat: bool = True) -> list[Example]:
        """`n` examples of `split`; same (knobs, split, n, seed, repeat) -> identical list.

        Examples are unique within the split while the split's share of the prompt space lasts. A
        space too small for `n` (easy knobs) is topped up with repeats and a warning when `repeat`
        (training: a smaller-than-asked set would silently change batch sizes downstream), and is
        returned as it is, all of its unique examples, when not (evaluation: a repeated prompt would
        count its verdict twice and shrink the standard error it seems to have).
        """
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if split == "validation" and self.val_fraction == 0:
            raise ValueError(f"{self.name}: no validation split (val_fraction=0)")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        knob_text = ",".join(f"{k}={v}" for k, v in sorted(self.knobs().items()))
        rng = random.Random(f"{self.hash_name}|{knob_text}|{split}|{seed}")
        out: list[Example] = []
        seen: set[str] = set()
        pool: list[Example] = []
        misses = 0
        max_misses = 2000 + 50 * n
        while len(out) < n and misses < max_misses:
            ex = self._generate(rng)
            if self.split_of(ex) != split:
                misses += 1
                continue
            pool.append(ex)
            key = self.unique_key(ex)
            if key in seen:
                misses += 1
                continue
            seen.add(key)
            out.append(ex)
            misses = 0
        if len(out) < n and repeat:
            if not pool:
                raise ValueError(f"{self.name}: no {split} examples exist for knobs {knob_text}")
            warnings.warn(
                f"{self.name}: only {len(out)} unique {split} examples for knobs {knob_text}; "
                f"repeating to reach {n}",
                stacklevel=2,
            )
            while len(out) < n:
                out.append(pool[rng.randrange(len(pool))])
        if not out and n > 0:
            raise ValueError(f"{self.name}: no {split} examples exist for knobs {knob_text}")
        return out

    def heldout(self, n: int, seed: int, split: str = "test") -> list[Example]:
        """At most `n` unique examples of `split` ("test", or "validation" for choices of configuration; every
        unique one when the space holds fewer)."""
        if split not in EVAL_SPLITS:
            raise ValueError(f"held-out split must be one of {EVAL_SPLITS}, got {split!r}")
        return self.make_split(split, n, seed, repeat=False)

    def sft_target(self, example: Example) -> str:
        """Gold response text (everything after the prompt), ending with the stop string."""
        target = self._gold_response(example)
        assert target.endswith(self.stop), target
        return target

    def sft_target_and_mask(self, example: Example) -> tuple[str, list[bool]]:
        """Gold response plus a per-character trainable mask (all True for single-turn tasks)."""
        target = self.sft_target(example)
        return target, [True] * len(target)

    def score_batch(self, examples: list[Example], responses: list[str]) -> list[float]:
        if len(examples) != len(responses):
            raise ValueError(f"{len(examples)} examples but {len(responses)} responses")
        return [self.score(e, r) for e, r in zip(examples, responses, strict=True)]


def preset(presets: dict[str, dict], difficulty: str, **given) -> dict:
    """The knobs of `presets[difficulty]` with each of `given` that is not None in its place (a task's constructor
    arguments override its difficulty preset one by one)."""
    if difficulty not in presets:
        raise ValueError(f"difficulty must be one of {sorted(presets)}, got {difficulty!r}")
    return {**presets[difficulty], **{k: v for k, v in given.items() if v is not None}}


def first_line(response: str) -> str:
    return response.split("\n", 1)[0]


_REGISTRY: dict[str, Callable[..., Task]] = {}


def register(name: str):
    def deco(cls):
        _REGISTRY[name] = cls
        return cls

    return deco


def task_names() -> list[str]:
    """The registered tasks (trace/tasks/__init__.py imports the task modules, whose @register fills the registry)."""
    return sorted(_REGISTRY)


def get_task(name: str, **knobs) -> Task:
    """Build a task by name ("reasoning", "reasoning-short", "coding", "program", "long_horizon"; a ":..." or "/..."
    suffix is ignored) with difficulty knobs (and ``test_fraction`` / ``val_fraction``)."""
    base = name.split(":", 1)[0].split("/", 1)[0]
    if base not in _REGISTRY:
        raise KeyError(f"unknown task {name!r}; known: {sorted(_REGISTRY)}")
    return _REGISTRY[base](**knobs)
