"""Rule-based reward function in OpenRLHF's python-file convention, routed to our verifiers.

Cluster runs pass this file as ``--remote_rm_url trace/tasks/reward_func.py`` (with
``--label_key label``); OpenRLHF imports it and calls ``reward_func(queries, prompts, labels,
**kwargs)`` where queries are prompt+response strings. Recent OpenRLHF expects a dict with
"rewards" (for advantages), "scores" (0-1, for dynamic filtering) and "extra_logs" (logged
tensors) -- see OpenRLHF/OpenRLHF examples/python/reward_func.py (checked at commit 2cedb6ab);
older versions took a bare tensor, which is `result["rewards"]` here.
The in-process RL trainer calls the same function, so both paths score identically.

Routing: by ``datasources`` (kwarg, one per sample, e.g. "coding" or "coding/easy") when given,
otherwise by the prompt's shape (``Q: ...=\nSteps:\n`` reasoning, ``Q: ...=\nA:`` reasoning-short, ``steps: ...``
program).
Extra logs: accuracy, response_chars and ``correct_<task>`` per task (``-`` written ``_``:
``correct_reasoning_short``), a fixed key set. Knobs that change scoring (coding partial_credit, long-horizon
shaping) come from ``task_knobs={"coding": {...}}``.
"""
from __future__ import annotations

import torch

from trace.config import TASK_NAMES
from trace.tasks import Example, get_task

_TASK_CACHE: dict[tuple, object] = {}


def infer_task(prompt: str) -> str:
    if prompt.startswith("Q: ") and prompt.endswith("=\nSteps:\n"):
        return "reasoning"
    if prompt.startswith("Q: ") and prompt.endswith("\nA:"):
        return "reasoning-short"
    if prompt.endswith("def f(x): return"):
        return "coding"
    if prompt.startswith("steps: ") and prompt.endswith("\ndef f(x):\n"):
        return "program"
    if prompt.startswith("Guess n in "):
        return "long_horizon"
    raise ValueError(f"cannot tell which task prompt {prompt[:60]!r} belongs to; pass datasources=")


def split_response(query: str, prompt: str) -> str:
    """The response part of prompt+response; a chat template may wrap the prompt, so search for it."""
    if query.startswith(prompt):
        return query[len(prompt):]
    at = query.rfind(prompt)
    return query[at + len(prompt):] if at >= 0 else query


def _task(name: str, knobs: dict):
    key = (name, tuple(sorted(knobs.items())))
    if key not in _TASK_CACHE:
        _TASK_CACHE[key] = get_task(name, **knobs)
    return _TASK_CACHE[key]


def reward_func(queries, prompts, labels, datasources=None, task_knobs=None, **kwargs):
    if not (len(queries) == len(prompts) == len(labels)):
        raise ValueError(f"length mismatch: {len(queries)} queries, {len(prompts)} prompts, {len(labels)} labels")
    if datasources is not None and len(datasources) != len(queries):
        raise ValueError(f"{len(datasources)} datasources for {len(queries)} queries")
    task_knobs = task_knobs or {}
    groups: dict[str, list[int]] = {}
    names = []
    for i, prompt in enumerate(prompts):
        src = datasources[i] if datasources is not None else infer_task(prompt)
        name = src.split(":", 1)[0].split("/", 1)[0]
        names.append(name)
        groups.setdefault(name, []).append(i)
    scores = [0.0] * len(queries)
    for name, idx in groups.items():
        task = _task(name, task_knobs.get(name, {}))
        exs = [Example(prompt=prompts[i], label=str(labels[i]), datasource=name) for i in idx]
        resp = [split_response(queries[i], prompts[i]) for i in idx]
        for i, s in zip(idx, task.score_batch(exs, resp), strict=True):
            scores[i] = float(s)
    score_t = torch.tensor(scores, dtype=torch.float32)
    lengths = torch.tensor([len(split_response(q, p)) for q, p in zip(queries, prompts, strict=True)], dtype=torch.float32)
    extra = {"accuracy": (score_t >= 1.0).float(), "response_chars": lengths}
    # a fixed key set: OpenRLHF stacks extra_logs across batches, so keys must not depend on the mix
    for name in TASK_NAMES:
        mask = torch.tensor([n == name for n in names], dtype=torch.float32)
        # per-task accuracy as a per-sample tensor: mean over a batch = share of correct samples of that task
        extra[f"correct_{name.replace('-', '_')}"] = mask * (score_t >= 1.0).float()
    return {"rewards": score_t.clone(), "scores": score_t, "extra_logs": extra}
