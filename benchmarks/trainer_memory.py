"""What the RL trainer's forward keeps for the backward, by source line: the memory that decides how many
runs share a GPU (the small profile's `gpu_slots_per_device`, profile_chunk.sh's SLOTS).

One RL step of a profile's run config on the CPU (random initial weights unless --init-ckpt, so generations
run to their length limit: an upper bound), with a saved-tensors hook around the trainer's forward that adds
up the bytes of every storage autograd keeps (each once, whole: a saved view keeps its base alive, and a tensor
saved by two ops is one allocation), keyed by the innermost trace/ or kernels/ line that first saved it.
Parameters are not counted (they are kept anyway). Scale by prompts: saved memory is linear in the batch.

    PYTHONPATH=. .venv/bin/python benchmarks/trainer_memory.py --model mixtral-small --task coding --arm trace --prompts 8

Compared against: the other arms of the same step (qat-independent, the same forward without guidance).
"""
from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "workflow" / "scripts"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from runplan import (  # noqa: E402, F401  (CalibrationMissing: what step_config raises)
    CalibrationMissing,
    Plan,
)

from trace import config as C  # noqa: E402
from trace.rl.trainer import RLTrainer  # noqa: E402


def _origin() -> str:
    for f in reversed(traceback.extract_stack()[:-2]):
        parts = Path(f.filename).parts
        if len(parts) >= 2 and parts[-2] in ("rl", "qat", "guidance", "fp4", "rollout", "kernels", "models"):
            return f"{parts[-2]}/{parts[-1]}:{f.lineno}"
    return "elsewhere (transformers / torch)"


class SavedStorages:
    """Saved-tensors hook that adds up the storages autograd keeps for the backward, by origin and dtype: each
    storage once and whole (a saved view keeps all of its base alive; one tensor saved by two ops, e.g. silu's
    input and then mul's, is one allocation), at the first save that keeps it. Parameters are not counted, nor
    views of `params` (e.g. a model's per-expert weight views): they are kept anyway."""

    def __init__(self, params=()):
        self.by: collections.Counter = collections.Counter()
        self._seen: dict[int, torch.Tensor] = {}  # storage address -> a tensor on it (kept: the address stays its)
        self._params = {p.untyped_storage().data_ptr() for p in params}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if not isinstance(t, torch.nn.Parameter) and ptr not in self._params and ptr not in self._seen:
            self._seen[ptr] = t
            self.by[(_origin(), str(t.dtype).replace("torch.", ""))] += st.nbytes()
        return t

    def __call__(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def saved_bytes(cfg: dict) -> tuple[dict, int]:
    """({(origin, dtype): bytes}, generated tokens) of one RL step of `cfg` (a validated run config)."""
    with tempfile.TemporaryDirectory() as out:
        tr = RLTrainer(cfg, out, progress=False)
        saved = SavedStorages(tr.model.parameters())
        forward = tr.logprobs

        def hooked(*a, **k):
            with saved():
                return forward(*a, **k)

        tr.logprobs = hooked
        m = tr.step(1).to_dict()
    return dict(saved.by), int(m["n_tokens"])


def step_config(profile: str, model: str, task: str, arm: str, prompts: int, *, init_ckpt: str | None = None,
                threads: int | None = None, calibrated: bool = True, **rl) -> dict:
    """(the validated run config of (model, task, arm) in `profile`, seed 0, for one step on the CPU at `prompts`
    prompts per step with BF16 autocast as on a GPU and `rl` over its rl keys, the profile's prompts per step).
    calibrated=False: no rl.align_coef from the profile's calibration file (runplan's `run_config`), the trainer's
    default instead."""
    with open(profile) as f:
        plan = Plan(yaml.safe_load(f))
    cfg = plan.run_config(model, task, arm, plan.config["seeds"][0], calibrated=calibrated)
    full = cfg["rl"].get("prompts_per_step")
    cfg.update(device="cpu", threads=threads or torch.get_num_threads())
    cfg["rl"].update(init_ckpt=init_ckpt, prompts_per_step=prompts, autocast="bf16", **rl)
    return C.validate(C.deep_merge(C.DEFAULTS, cfg)), full


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="experiments/profiles/small.yaml")
    ap.add_argument("--model", default="mixtral-small")
    ap.add_argument("--task", default="coding")
    ap.add_argument("--arm", default="trace")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step (the profile's value is scaled down)")
    ap.add_argument("--init-ckpt", default=None)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--recompute-experts", action="store_true", help="rl.recompute_experts on")
    a = ap.parse_args(argv)
    cfg, full = step_config(a.profile, a.model, a.task, a.arm, a.prompts, init_ckpt=a.init_ckpt,
                            recompute_experts=a.recompute_experts)
    by, n_gen = saved_bytes(cfg)
    total = sum(by.values())
    print(f"{a.model} {a.task} {a.arm}: {a.prompts} prompts, {n_gen} generated tokens, saved {total / 1e9:.2f} GB"
          + (f" (x{full / a.prompts:g} at the profile's {full} prompts: {total * full / a.prompts / 1e9:.1f} GB)"
             if full else ""))
    for (where, dtype), b in sorted(by.items(), key=lambda kv: -kv[1])[: a.top]:
        print(f"  {b / 1e6:9.1f} MB  {dtype:9s} {where}")


if __name__ == "__main__":
    main()
