"""What OpenRLHF 0.11.2 imports from flash-attn and vLLM, for machines that have neither.

Every OpenRLHF module imports once two names exist: `flash_attn.bert_padding` (top of
`openrlhf/models/ring_attn_utils.py`, pad/unpad helpers used only with sample packing) and `vllm`
(`SamplingParams` at module level in `samples_generator.py`; `vllm.inputs.TokensPrompt` and
`vllm.utils.random_uuid` in `vllm_engine.py`; `StatelessProcessGroup` and `PyNcclCommunicator` in
`openrlhf.utils.distributed_util`, the weight-sync group between trainer rank 0 and the engines).
With packing off and our engine actors in place of vLLM engines, nothing else of either is called;
the sync group stand-in is torch's own c10d (NCCL on a GPU, gloo on the CPU), so OpenRLHF's
broadcast protocol runs unchanged without vLLM. `install()` registers minimal modules under those
names only when the real package is absent (a real flash-attn or vLLM always wins), so importing
OpenRLHF works on a CPU machine and on a GPU machine without vLLM.

    from trace.integrations.openrlhf import stand_ins; stand_ins.install()
    import openrlhf.trainer.ppo_utils.samples_generator   # works without vllm / flash_attn

The pad/unpad helpers follow flash-attn's `bert_padding` semantics (tests/integrations/openrlhf
checks a round trip); `SamplingParams` carries the fields OpenRLHF sets and our engine reads.
Compared against: flash-attn 2.8 `bert_padding`, vLLM `SamplingParams` field names.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
import uuid
from dataclasses import dataclass

import torch

# OpenRLHF 0.11.2 compares vllm.__version__ with packaging.version: below 0.16 it sets
# NCCL_CUMEM_ENABLE=0 for the weight-sync group (ppo_actor.py), and its engines assert > 0.10.0.
# The stand-in reports the vLLM release OpenRLHF 0.11.2 pins (its `vllm` extra: vllm==0.29.0), so
# every comparison takes the current path; the local label marks it as ours.
STAND_IN_VERSION = "0.29.0+trace.stand.in"


# ---------------------------------------------------------------------------------------------- flash_attn
def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """x [N, ...] -> x[indices] (flash-attn's autograd op; plain indexing has the same gradient)."""
    return x[indices]


def unpad_input(hidden: torch.Tensor, attention_mask: torch.Tensor, unused_mask=None):
    """hidden [B, T, ...], mask [B, T] -> (rows [nnz, ...], indices, cu_seqlens, max_seqlen, seqused)."""
    seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    cu = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden.reshape(-1, *hidden.shape[2:])
    return flat[indices], indices, cu, int(seqlens.max()) if seqlens.numel() else 0, seqlens


def pad_input(rows: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Inverse of unpad_input: rows [nnz, ...] -> [B, T, ...] with zeros at padding."""
    out = rows.new_zeros(batch * seqlen, *rows.shape[1:])
    out[indices] = rows
    return out.reshape(batch, seqlen, *rows.shape[1:])


def _all_gather(x: torch.Tensor, group=None):
    ws = torch.distributed.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(ws)]
    torch.distributed.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)


# ---------------------------------------------------------------------------------------------- vllm
@dataclass
class SamplingParams:
    """The fields OpenRLHF's samples generator and executors set or read."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = 16
    min_tokens: int = 0
    skip_special_tokens: bool = True
    logprobs: int | None = None
    stop: list | None = None
    stop_token_ids: list | None = None
    include_stop_str_in_output: bool = False
    seed: int | None = None
    n: int = 1


def TokensPrompt(prompt_token_ids, **kw):  # noqa: N802 - vLLM's name (a TypedDict there)
    return {"prompt_token_ids": list(prompt_token_ids), **kw}


def random_uuid() -> str:
    return uuid.uuid4().hex


class StatelessProcessGroup:
    """vLLM's rendezvous outside torch.distributed's default group, on a torch TCPStore: the
    trainer's rank 0 and the engines form a weight-sync group while the trainer ranks already
    have their own default group."""

    def __init__(self, store, rank: int, world_size: int):
        self.store, self.rank, self.world_size = store, rank, world_size

    @classmethod
    def create(cls, host: str, port: int, rank: int, world_size: int, store_timeout: int = 300, **_):
        from datetime import timedelta
        store = torch.distributed.TCPStore(host, int(port), world_size, is_master=rank == 0,
                                           timeout=timedelta(seconds=store_timeout))
        return cls(store, rank, world_size)


class PyNcclCommunicator:
    """vLLM's broadcast communicator over a StatelessProcessGroup: torch's NCCL process group for
    CUDA devices, gloo on the CPU (the CPU path of tests and CI)."""

    def __init__(self, group: StatelessProcessGroup, device):
        from datetime import timedelta
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        self.device = dev
        if dev.type == "cuda":
            self.pg = torch.distributed.ProcessGroupNCCL(group.store, group.rank, group.world_size)
        else:
            self.pg = torch.distributed.ProcessGroupGloo(group.store, group.rank, group.world_size,
                                                         timedelta(seconds=300))

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None):
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([tensor], opts).wait()


def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    m.__trace_stand_in__ = True
    m.__path__ = []  # a package, so submodules resolve through sys.modules
    # a spec without an origin: importlib.util.find_spec works, and transformers' availability check
    # (no __file__, no version) still reports the package as absent, so it never picks flash-attn
    m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    return m


def install() -> list[str]:
    """Register the stand-ins whose real package is missing; returns the names registered."""
    done = []
    if "flash_attn" not in sys.modules and importlib.util.find_spec("flash_attn") is None:
        from einops import rearrange
        mods = {
            "flash_attn": _module("flash_attn"),
            "flash_attn.bert_padding": _module("flash_attn.bert_padding", index_first_axis=index_first_axis,
                                               pad_input=pad_input, unpad_input=unpad_input, rearrange=rearrange),
            "flash_attn.utils": _module("flash_attn.utils"),
            "flash_attn.utils.distributed": _module("flash_attn.utils.distributed", all_gather=_all_gather),
        }
        sys.modules.update(mods)
        done += list(mods)
    if "vllm" not in sys.modules and importlib.util.find_spec("vllm") is None:
        mods = {
            "vllm": _module("vllm", __version__=STAND_IN_VERSION, SamplingParams=SamplingParams),
            "vllm.inputs": _module("vllm.inputs", TokensPrompt=TokensPrompt),
            "vllm.utils": _module("vllm.utils", random_uuid=random_uuid),
            "vllm.distributed": _module("vllm.distributed"),
            "vllm.distributed.utils": _module("vllm.distributed.utils", StatelessProcessGroup=StatelessProcessGroup),
            "vllm.distributed.device_communicators": _module("vllm.distributed.device_communicators"),
            "vllm.distributed.device_communicators.pynccl": _module(
                "vllm.distributed.device_communicators.pynccl", PyNcclCommunicator=PyNcclCommunicator),
        }
        sys.modules.update(mods)
        done += list(mods)
    return done


def is_stand_in(name: str) -> bool:
    return bool(getattr(sys.modules.get(name), "__trace_stand_in__", False))
