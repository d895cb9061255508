"""TRACE inside OpenRLHF 0.11.2, without edits to OpenRLHF (docs/openrlhf.md).

    python -m trace.integrations.openrlhf.launch --config CFG.yaml --out RUN_DIR [--gpus 0]

launch.py (entry point, run dir) -> flags.py (config -> train_ppo_ray flags) -> plugin.py (worker setup:
stand_ins.py, CPU shim) -> rollout.py (our engine as OpenRLHF's rollout engine, records as handles) ->
actor.py (OpenRLHF's policy actor with our QAT patch and replay; records.py batches the records; checkpoints.py
prunes its HF checkpoints);
reward.py and agent.py are the files OpenRLHF loads by path. Importing this package imports nothing.
Compared against: the embedded trainer `python -m trace.rl` (tests/integrations/openrlhf/).
"""
