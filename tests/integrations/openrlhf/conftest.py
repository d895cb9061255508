"""OpenRLHF tests need the OpenRLHF stack (scripts/install.sh installs it); skipped without it."""
import os
import socket

import pytest

pytest.importorskip("openrlhf", reason="the OpenRLHF stack is not installed (bash scripts/install.sh)")
pytest.importorskip("deepspeed", reason="deepspeed is not installed (bash scripts/install.sh)")
pytest.importorskip("ray", reason="ray is not installed (bash scripts/install.sh)")


@pytest.fixture
def tiny_rl_config(tmp_path):
    """write(steps, n_test=..., **rl) -> the path of an RL config of qwen3_moe-tiny on the easy reasoning task, its
    init checkpoint a fresh random model (seed 0) under tmp_path/init; `rl` keys override the defaults."""
    import yaml

    from trace.models import build_model, build_tokenizer, save_checkpoint

    def write(steps, n_test=8, **rl):
        init = tmp_path / "init"
        if not init.exists():
            save_checkpoint(build_model("qwen3_moe-tiny", seed=0), build_tokenizer(), init)
        cfg = tmp_path / "rl.yaml"
        cfg.write_text(yaml.safe_dump({
            "model": "qwen3_moe-tiny", "seed": 0, "threads": 1,
            "task": {"name": "reasoning", "difficulty": "easy", "n_train": 64, "n_test": n_test},
            "rl": {"steps": steps, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8, "ckpt_every": steps,
                   "init_ckpt": str(init), **rl},
            "eval": {"samples_per_prompt": 1},
        }))
        return cfg

    return write


@pytest.fixture(scope="module")
def gloo():
    """One gloo process group of world size 1, as OpenRLHF's actor ranks have on the CPU; DeepSpeed's
    override of F.linear (ZeRO-3 keeps it for the process) is undone afterwards."""
    import torch

    linear = torch.nn.functional.linear
    if not torch.distributed.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
        import deepspeed
        import deepspeed.ops
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no g++ build of a CPU op
        deepspeed.init_distributed(dist_backend="gloo")
    yield
    torch.nn.functional.linear = linear
