"""OpenRLHF's broadcast weight sync into our engine actor: trainer rank 0 and the engine form the
stateless group (the vLLM stand-in on torch gloo), every parameter is broadcast in BF16, and the
engine re-quantizes once, at the parameter flagged empty_cache, to exactly the trainer's FP4 codes."""
import socket
import threading

import torch

from trace import config as C
from trace import fp4
from trace.integrations.openrlhf import stand_ins
from trace.integrations.openrlhf.rollout import TraceRolloutEngine
from trace.models import build_model, build_tokenizer, save_checkpoint

stand_ins.install()  # vLLM names below: the stand-ins where vLLM is absent

from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator  # noqa: E402
from vllm.distributed.utils import StatelessProcessGroup  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _in_thread(fn, *args, **kw):
    t = threading.Thread(target=fn, args=args, kwargs=kw)
    t.start()
    return t


def test_broadcast_sync_requantizes_once(tmp_path):
    save_checkpoint(build_model("qwen3_moe-tiny", seed=0), build_tokenizer(), tmp_path)
    eng = TraceRolloutEngine(str(tmp_path), C.load_config(None, ["model=qwen3_moe-tiny", "rl.method=trace"]),
                             remote_rm_url=None)
    # the RoPE buffer of the model the engine loaded, here as a model cast to BF16 holds it (BF16-rounded), so that it
    # differs from what a state dict's sync would compute from the config
    rope = eng.engine.weights.inv_freq.to(torch.bfloat16).float()
    assert not torch.equal(rope, eng.engine.weights.inv_freq)
    eng._inv_freq = rope.clone()
    port = _free_port()
    t = _in_thread(eng.init_process_group, "127.0.0.1", port, 1, 2, "openrlhf", backend="gloo", use_ray=False)
    comm = PyNcclCommunicator(StatelessProcessGroup.create("127.0.0.1", port, 0, 2), torch.device("cpu"))
    t.join()
    # the trainer's next weights, twice: other inits, in BF16 as DeepSpeed holds them
    for sync, seed in enumerate((1, 2), start=1):
        params = list(build_model("qwen3_moe-tiny", seed=seed).to(torch.bfloat16).named_parameters())
        for i, (name, p) in enumerate(params):
            t = _in_thread(eng.update_weight, name, p.dtype, p.shape, empty_cache=i == len(params) - 1)
            comm.broadcast(p.data, src=0)
            t.join()
            assert eng.syncs == sync - 1 + (i == len(params) - 1)  # re-quantized once per sync, at the last one
        codes = eng.fp4_weights()
        assert len(codes) > 0
        sd = dict(params)
        for name, c in codes.items():
            assert torch.equal(c, fp4.quantize_weight(sd[name].detach(), "nvfp4").codes), name
        assert torch.equal(eng.engine.weights.inv_freq, rope)  # a sync carries parameters only: RoPE stays the model's
