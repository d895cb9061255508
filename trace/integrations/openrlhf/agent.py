"""The multi-turn environment file OpenRLHF loads with `--train.agent_func_path PATH.py` (long_horizon).

OpenRLHF imports this file by path in the rollout actor and instantiates `AgentExecutor()`, a
`MultiTurnAgentExecutor` over `AgentInstance`: one instance per sample, wrapping our
`GuessNumberEnv` (trace/tasks/long_horizon.py) reset on the sample's prompt and label. Each turn the
engine generates up to the task's stop string, `step` returns the environment's feedback (appended
as non-trainable tokens), the reward and whether the episode is over, as the embedded trainer's
`EnvPool` does. Task knobs (e.g. `shaping`) come from the run config in $TRACE_RUN_DIR.
Compared against: `trace.rollout.EnvPool` + `GuessNumberEnv` (the same transcript protocol;
tests/integrations/openrlhf/test_reward_agent.py runs it with OpenRLHF's own executor).
"""
from __future__ import annotations

import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

from trace.tasks.base import Example
from trace.tasks.long_horizon import GuessNumberEnv


def _shaping() -> float:
    try:
        from trace.integrations.openrlhf.plugin import run_config
        return float((run_config()["task"].get("knobs") or {}).get("shaping", 0.0))
    except RuntimeError:  # no run dir (a bare OpenRLHF run of this file): the task default
        return 0.0


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.env = GuessNumberEnv(_shaping())

    async def reset(self, states: dict, **kwargs):
        prompt = self.env.reset(Example(prompt=states["observation"], label=str(states["label"]),
                                        datasource="long_horizon"))
        return {"observation": prompt}

    async def step(self, states: dict, **kwargs):
        obs, reward, done = self.env.step(states["action_text"])
        r = torch.tensor(float(reward))
        return {"rewards": r, "scores": r, "environment_feedback": obs, "done": done,
                "sampling_params": states.get("sampling_params"),
                "extra_logs": {"accuracy": torch.tensor(float(done and reward >= 1.0)),
                               "turns": torch.tensor(float(self.env.turns_used))}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
