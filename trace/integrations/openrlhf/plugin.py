"""Process setup for OpenRLHF runs with TRACE: what every Ray worker (and the driver) loads first.

`launch` starts Ray with `runtime_env={"worker_process_setup_hook": "trace.integrations.openrlhf.plugin.setup",
"env_vars": {"TRACE_RUN_DIR": out, ...}}`, so each process, before it unpickles an OpenRLHF actor:
1. registers the flash-attn / vLLM stand-ins where those packages are absent (stand_ins.py);
2. on a machine without CUDA, installs the CPU runtime shim below (documented in docs/openrlhf.md).
Actors find our run config in `$TRACE_RUN_DIR/config.yaml` (`run_config()`), and launch's
`--zero-persistence-threshold` in `$TRACE_ZERO_PERSISTENCE_THRESHOLD` (`zero_persistence_threshold()`).

The CPU shim: OpenRLHF 0.11.2 assumes CUDA in a handful of calls on its training path --
`torch.cuda.current_device()` as the target of `.to(...)` (experience batches, all-reduce of
metrics), `torch.cuda.synchronize()` after barriers, `torch.cuda.set_device(local_rank)`,
`torch.cuda.current_stream()` passed to the weight broadcast, `init_device_mesh("cuda", ...)` in
`DeepspeedStrategy.setup_distributed`, and the replay buffer's `torch.device(f"cuda:{...}")` target.
The shim makes the first four the CPU device / no-ops, builds the mesh on "cpu" and points the
replay buffer at the CPU; DeepSpeed itself picks its CPU accelerator (gloo) on its own, and the shim
turns off its JIT-built shared-memory all-reduce op (gloo does the same job without a compiler run).
Nothing else is changed, and none of it is installed when CUDA is available.
Compared against: OpenRLHF 0.11.2 sources (the calls listed above are all its torch.cuda uses on
the PPO path; the vLLM-only ones are never reached).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from trace import settings
from trace.integrations.openrlhf import guards, stand_ins

RUN_DIR_ENV = "TRACE_RUN_DIR"
ZERO_PERSISTENCE_ENV = "TRACE_ZERO_PERSISTENCE_THRESHOLD"
_CPU = torch.device("cpu")


def run_dir() -> Path:
    d = os.environ.get(RUN_DIR_ENV)
    if not d:
        raise RuntimeError(f"${RUN_DIR_ENV} is not set: OpenRLHF runs with TRACE start through "
                           "`python -m trace.integrations.openrlhf.launch`")
    return Path(d)


def zero_persistence_threshold() -> int | None:
    """DeepSpeed's stage3_param_persistence_threshold for the policy actor; None: OpenRLHF's ("auto")."""
    v = os.environ.get(ZERO_PERSISTENCE_ENV)
    return None if v in (None, "") else int(v)


def run_config() -> dict:
    """The run's resolved config (the launcher wrote it); its kernel switches become this worker process's
    (`trace.settings.use`), as an entry point's do."""
    import yaml
    cfg = yaml.safe_load((run_dir() / "config.yaml").read_text())
    settings.use(cfg)
    return cfg


def _shim_targets():
    import deepspeed.ops
    import openrlhf.trainer.ppo_utils.replay_buffer as rb_mod
    import openrlhf.utils.deepspeed.deepspeed as ds_mod
    return ds_mod, rb_mod, deepspeed.ops


_MESH = "openrlhf.utils.deepspeed.deepspeed.init_device_mesh"


def hooks() -> tuple[tuple, tuple]:
    """(Hooks, Uses) of the CPU shim: what it replaces, and the code that must still use it; launch checks
    them at start-up wherever it runs, so a rename shows before a CPU run. Imported here, not at module
    import: on a GPU the workers' setup loads neither OpenRLHF nor DeepSpeed, as before the shim existed."""
    ds, rb, ops = _shim_targets()
    return ((guards.Hook(ds, "init_device_mesh", _MESH),
             guards.Hook(rb, "NaiveReplayBuffer", "openrlhf.trainer.ppo_utils.replay_buffer.NaiveReplayBuffer"),
             guards.Hook(ops, "__compatible_ops__", "deepspeed.ops.__compatible_ops__")),
            (guards.Use(ds.DeepspeedStrategy, "setup_distributed", "init_device_mesh", _MESH,
                        "DeepspeedStrategy.setup_distributed"),))


def install_cpu_shim() -> bool:
    """The CUDA calls of OpenRLHF's training path made CPU-safe; returns False where CUDA exists."""
    if torch.cuda.is_available():
        return False
    if getattr(torch.cuda, "__trace_cpu_shim__", False):
        return True
    torch.cuda.current_device = lambda: _CPU
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.set_device = lambda device: None
    torch.cuda.current_stream = lambda device=None: None
    torch.cuda.__trace_cpu_shim__ = True

    ds_mod, rb_mod, ops = _shim_targets()
    from torch.distributed.device_mesh import init_device_mesh

    def _cpu_mesh(device_type, *args, **kwargs):
        return init_device_mesh("cpu", *args, **kwargs)

    ds_mod.init_device_mesh = _cpu_mesh

    buffer_init = rb_mod.NaiveReplayBuffer.__init__

    def _buffer_init(self, *args, **kwargs):
        # the buffer formats f"cuda:{current_device()}" once; its only use is the target of .to()
        cur = torch.cuda.current_device
        torch.cuda.current_device = lambda: 0
        try:
            buffer_init(self, *args, **kwargs)
        finally:
            torch.cuda.current_device = cur
        self.target_device = _CPU

    rb_mod.NaiveReplayBuffer.__init__ = _buffer_init
    # DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce op (g++, about a minute per
    # fresh machine) at init_distributed; marking it incompatible keeps plain gloo collectives
    ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return True


def setup() -> None:
    """Ray's worker_process_setup_hook (and the driver's own setup)."""
    stand_ins.install()
    install_cpu_shim()


__all__ = ["RUN_DIR_ENV", "hooks", "ZERO_PERSISTENCE_ENV", "install_cpu_shim", "run_config", "run_dir", "setup",
           "zero_persistence_threshold"]
