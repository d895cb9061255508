"""JSONL dataset loaders for real (paper-scale) task data; local files only, no hub downloads.

``load_jsonl("data/math_train.jsonl", prompt_key="question", label_key="answer")`` returns
`Example`s; a malformed line or a missing key raises `DatasetError` naming the file and line.
``save_jsonl(path, examples)`` writes the synthetic splits in the same format so a generated set
can be frozen and re-read. ``with_jsonl(task, cfg["task"])`` gives a task whose train/validation/test splits
come from the run config's ``task.train_jsonl`` / ``task.validation_jsonl`` / ``task.test_jsonl`` (keys
``task.prompt_key`` / ``task.label_key``); a split without a file stays generated. Compared against: OpenRLHF's `--input_key/--label_key` JSONL convention,
which the same files feed at cluster scale.
"""
from __future__ import annotations

import json
import os
from typing import Iterable

from trace.settings import TaskSettings
from trace.tasks.base import Example


class DatasetError(ValueError):
    pass


def load_jsonl(
    path: str | os.PathLike,
    prompt_key: str = TaskSettings.prompt_key,
    label_key: str = TaskSettings.label_key,
    datasource_key: str = "datasource",
    default_datasource: str | None = None,
    meta_keys: Iterable[str] | None = None,
) -> list[Example]:
    """Read one JSON object per line. Blank lines are skipped; everything else must parse.

    `datasource_key` may be absent from a line only when `default_datasource` is given. Other
    fields go into `meta` (all of them, or only `meta_keys` when given). Prompt and label must be
    strings; a numeric label (common in math sets) is converted with str().
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DatasetError(f"{path}: no such file")
    keep = None if meta_keys is None else set(meta_keys)
    out: list[Example] = []
    with open(path, encoding="utf-8-sig") as f:  # -sig: a leading byte-order mark is not a fault
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                # each line is parsed on its own, so colno is the column within this line
                raise DatasetError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
            for key in (prompt_key, label_key):
                if key not in row:
                    raise DatasetError(f"{where}: missing key {key!r} (has {sorted(row)})")
            if datasource_key not in row and default_datasource is None:
                raise DatasetError(f"{where}: missing key {datasource_key!r} (has {sorted(row)}); "
                                   "pass default_datasource= to fill it")
            prompt, label = row[prompt_key], row[label_key]
            if not isinstance(prompt, str):
                raise DatasetError(f"{where}: {prompt_key!r} must be a string, got {type(prompt).__name__}")
            if isinstance(label, bool) or not isinstance(label, (str, int, float)):
                raise DatasetError(f"{where}: {label_key!r} must be a string or number, "
                                   f"got {type(label).__name__}")
            datasource = row.get(datasource_key, default_datasource)
            if not isinstance(datasource, str):
                raise DatasetError(f"{where}: {datasource_key!r} must be a string")
            meta = {k: v for k, v in row.items()
                    if k not in (prompt_key, label_key, datasource_key) and (keep is None or k in keep)}
            if isinstance(row.get("meta"), dict) and (keep is None or "meta" in keep):
                meta.pop("meta")
                meta.update(row["meta"])
            out.append(Example(prompt=prompt, label=str(label), datasource=datasource, meta=meta))
    return out


def save_jsonl(path: str | os.PathLike, examples: Iterable[Example]) -> int:
    """Write examples as {"prompt", "label", "datasource", "meta"} lines; returns the count."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for ex in examples:
            f.write(json.dumps({"prompt": ex.prompt, "label": ex.label, "datasource": ex.datasource,
                                "meta": ex.meta}, ensure_ascii=True) + "\n")
            n += 1
    return n


class JsonlTask:
    """A task whose train/validation/test splits are read from JSONL files; scoring, stop string, turns and
    everything else are the wrapped task's. `make_split(split, n, seed)` returns the file's first n
    examples in file order (all of them when the file is shorter; the seed does not apply to a fixed
    file); `heldout(n, seed, split)` the same with each prompt once; a split without a file is the wrapped
    task's generated split. Files are used as given: keeping them disjoint is the data's business."""

    def __init__(self, task, train: str | None = None, test: str | None = None, prompt_key: str = TaskSettings.prompt_key,
                 label_key: str = TaskSettings.label_key, validation: str | None = None):
        self.task = task
        self.files = {"train": train, "validation": validation, "test": test}
        self.prompt_key, self.label_key = prompt_key, label_key
        self._cache: dict[str, list[Example]] = {}

    def __getattr__(self, name):
        return getattr(self.task, name)

    def load(self, split: str) -> list[Example]:
        """All examples of the split's file (read once); DatasetError names file, line and column."""
        if split not in self._cache:
            self._cache[split] = load_jsonl(self.files[split], self.prompt_key, self.label_key,
                                            default_datasource=self.task.name)
            if not self._cache[split]:
                raise DatasetError(f"{self.files[split]}: no examples")
        return self._cache[split]

    def make_split(self, split: str, n: int, seed: int, repeat: bool = True) -> list[Example]:
        if self.files.get(split) is None:
            return self.task.make_split(split, n, seed, repeat)
        return self.load(split)[:n]

    def heldout(self, n: int, seed: int, split: str = "test") -> list[Example]:
        if self.files.get(split) is None:
            return self.task.heldout(n, seed, split)
        out: dict[str, Example] = {}
        for e in self.load(split):
            out.setdefault(self.task.unique_key(e), e)
        return list(out.values())[:n]


def with_jsonl(task, task_cfg: dict):
    """`task` itself, or a JsonlTask when the config's task block names a train, validation or test JSONL file."""
    train, val, test = (task_cfg.get(f"{s}_jsonl") for s in ("train", "validation", "test"))
    if not train and not val and not test:
        return task
    return JsonlTask(task, train or None, test or None, task_cfg["prompt_key"], task_cfg["label_key"],
                     validation=val or None)
