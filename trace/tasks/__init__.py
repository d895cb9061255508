"""Synthetic verifiable tasks (reasoning with worked answers, reasoning-short, coding, program: function bodies,
long-horizon), their verifiers, the code sandbox, JSONL loaders and an OpenRLHF-style reward function. Every task
has train, validation and test splits (trace/tasks/base.py). See DESIGN.md sections 4 and 7.

``from trace.tasks import get_task; t = get_task("reasoning", difficulty="easy")``.
"""
from trace.tasks import coding, long_horizon, program, reasoning  # noqa: F401  (@register fills the registry)
from trace.tasks.base import _REGISTRY, CHARSET, Example, Task, check_charset


def task_names() -> list[str]:
    return sorted(_REGISTRY)


def get_task(name: str, **knobs) -> Task:
    """Build a task by name ("reasoning", "reasoning-short", "coding", "program", "long_horizon"; a ":..." or "/..."
    suffix is ignored) with difficulty knobs (and ``test_fraction`` / ``val_fraction``)."""
    base = name.split(":", 1)[0].split("/", 1)[0]
    if base not in _REGISTRY:
        raise KeyError(f"unknown task {name!r}; known: {sorted(_REGISTRY)}")
    return _REGISTRY[base](**knobs)


__all__ = ["CHARSET", "Example", "Task", "check_charset", "get_task", "task_names"]
