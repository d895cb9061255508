"""The reward function file OpenRLHF loads with `--reward.remote_url PATH.py` (single-turn tasks).

OpenRLHF's `SingleTurnAgentExecutor` imports this file by path and calls
`reward_func(queries, prompts, labels)` per sample (queries = prompt + response text); it is our
verifier routing of `trace.tasks.reward_func`, so both trainers score identically. It is the default:
a user's own file or reward server URL after `launch ... -- --reward.remote_url` takes its place. The file is
loaded outside any package, hence the absolute import (the launcher puts the repository on
PYTHONPATH of every Ray worker).
Compared against: `trace.tasks.reward_func.reward_func` (the same function object).
"""
from trace.tasks.reward_func import reward_func  # noqa: F401
