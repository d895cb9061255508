"""Synthetic verifiable tasks (reasoning with worked answers, reasoning-short, coding, program: function bodies,
long-horizon), their verifiers, the code sandbox, JSONL loaders and an OpenRLHF-style reward function. Every task
has train, validation and test splits (trace/tasks/base.py). See DESIGN.md sections 4 and 7.

``from trace.tasks import get_task; t = get_task("reasoning", difficulty="easy")``.
"""
from trace.tasks import coding, long_horizon, program, reasoning  # noqa: F401  (@register fills the registry)
from trace.tasks.base import CHARSET, Example, Task, check_charset, get_task, task_names

__all__ = ["CHARSET", "Example", "Task", "check_charset", "get_task", "task_names"]
