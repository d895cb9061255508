"""The HF copies of OpenRLHF's checkpoints, kept under `--ckpt.max_num` like the DeepSpeed checkpoints.

With `--ckpt.save_hf` (always on: flags.FIXED) OpenRLHF 0.11.2's `PolicyModelActor.save_checkpoint` writes
`<ckpt.path>/global_step<N>_hf` (an HF model directory) beside the DeepSpeed checkpoint `<ckpt.path>/_actor/
global_step<N>`, but only the DeepSpeed ones are rotated to `--ckpt.max_num` (openrlhf/trainer/ray/ppo_actor.py
`save_checkpoint`, openrlhf/utils/deepspeed/deepspeed.py `save_ckpt`). The policy actor calls
`prune_hf_checkpoints` after each save, so the HF copies follow the same rule: the newest `max_num` stay (at least
the one just written). The run's final model is OpenRLHF's `--ckpt.output_dir` save (ckpt/step_XXXXXX), which
stage eval and the pipeline read; it is not under ckpt.path and never pruned here.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

HF_DIR = re.compile(r"^global_step(\d+)_hf$")


def hf_checkpoints(root) -> list[Path]:
    """The `global_step<N>_hf` directories under root, oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := HF_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def prune_hf_checkpoints(root, max_num: int) -> list[Path]:
    """Delete all but the newest max(1, max_num) `global_step<N>_hf` directories under root; returns the deleted."""
    dirs = hf_checkpoints(root)
    drop = dirs[: max(0, len(dirs) - max(1, int(max_num)))]
    for p in drop:
        shutil.rmtree(p, ignore_errors=True)
    return drop


__all__ = ["HF_DIR", "hf_checkpoints", "prune_hf_checkpoints"]
