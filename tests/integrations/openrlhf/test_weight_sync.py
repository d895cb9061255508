"""OpenRLHF's broadcast weight sync into our engine actor: trainer rank 0 and the engine form the
stateless group (the vLLM stand-in on torch gloo), every parameter is broadcast in BF16, and the
engine re-quantizes each one as it arrives (`RolloutEngine.sync_tensor`) and drops it, closing the
sync at the parameter flagged empty_cache (`finish_sync`):
- the FP4 codes are exactly the trainer's (`trace.fp4.quantize_weight` of the broadcast tensors);
- every tensor the engine holds (FP4 codes, scales and outer scales, dequantized weights, embeddings,
  norms, lm_head, RoPE) is bit-identical to what the whole-state-dict re-quantization
  (`RolloutEngine.sync_weights`, the sync that waited for every tensor) makes of the same tensors, for
  qwen3_moe, mixtral with tied embeddings (no lm_head broadcast: the engine's lm_head takes the
  embeddings) and qwen2_moe (shared expert, biases), and it is written in place (same addresses);
- the engine never holds more than one received tensor: the pending store has it alone while it is
  re-quantized, and every earlier one is freed by then."""
import copy
import socket
import threading
import time
import weakref

import pytest
import torch

from trace import config as C
from trace import fp4
from trace.integrations.openrlhf import stand_ins
from trace.integrations.openrlhf.rollout import TraceRolloutEngine
from trace.models import build_model, build_tokenizer, save_checkpoint
from trace.rollout import RolloutEngine

stand_ins.install()  # vLLM names below: the stand-ins where vLLM is absent

from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator  # noqa: E402
from vllm.distributed.utils import StatelessProcessGroup  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Call(threading.Thread):
    """fn(*args, **kw) in a thread; join() re-raises what it raised."""

    def __init__(self, fn, *args, **kw):
        super().__init__()
        self.fn, self.a, self.kw, self.error = fn, args, kw, None

    def run(self):
        try:
            self.fn(*self.a, **self.kw)
        except BaseException as e:  # noqa: BLE001 - re-raised by join
            self.error = e

    def join(self, timeout=None):
        super().join(timeout)
        if self.error is not None:
            raise self.error


def _in_thread(fn, *args, **kw):
    t = _Call(fn, *args, **kw)
    t.start()
    return t


def _released(ref, wait_s=1.0) -> bool:
    """Whether the tensor behind a weakref is freed, waiting up to wait_s for gloo's worker thread, which lets go of
    the buffer of a finished broadcast a moment after the broadcast returns. (Each arrival checks the one before
    it; the earlier ones were checked at their successors' arrival.)"""
    t0 = time.perf_counter()
    while ref() is not None and time.perf_counter() - t0 < wait_s:
        time.sleep(0.005)
    return ref() is None


def _engine(tmp_path, name, **overrides):
    save_checkpoint(build_model(name, seed=0, **overrides), build_tokenizer(), tmp_path)
    return TraceRolloutEngine(str(tmp_path), C.load_config(None, [f"model={name}", "rl.method=trace"]),
                              remote_rm_url=None)


def _connect(eng):
    """The weight-sync group of trainer rank 0 (returned) and the engine, over gloo."""
    port = _free_port()
    t = _in_thread(eng.init_process_group, "127.0.0.1", port, 1, 2, "openrlhf", backend="gloo", use_ray=False)
    comm = PyNcclCommunicator(StatelessProcessGroup.create("127.0.0.1", port, 0, 2), torch.device("cpu"))
    t.join()
    return comm


def _broadcast(eng, comm, params):
    """OpenRLHF's sync as trainer rank 0 runs it: update_weight per parameter, the last one flagged empty_cache."""
    for i, (name, p) in enumerate(params):
        t = _in_thread(eng.update_weight, name, p.dtype, p.shape, empty_cache=i == len(params) - 1)
        comm.broadcast(p.data, src=0)
        t.join()


def _held(w) -> dict:
    """Every tensor of an EngineWeights, by a readable path."""
    out = {"embed": w.embed, "norm": w.norm, "lm_head": w.lm_head, "inv_freq": w.inv_freq}
    for i, lw in enumerate(w.layers):
        out.update({f"layers.{i}.{k}": t for k, t in lw.items()})
    for n, q in w.fp4.items():
        out.update({f"{n}.codes": q.codes, f"{n}.scales": q.scales, f"{n}.outer": q.outer})
    return out


def test_broadcast_sync_requantizes_to_the_trainers_codes(tmp_path):
    eng = _engine(tmp_path, "qwen3_moe-tiny")
    # the RoPE buffer as a model cast to BF16 holds it (BF16-rounded), so that it differs from what a state dict's
    # sync would compute from the config: a sync carries parameters only and leaves it as it is
    rope = eng.engine.weights.inv_freq.to(torch.bfloat16).float()
    assert not torch.equal(rope, eng.engine.weights.inv_freq)
    eng.engine.weights.inv_freq.copy_(rope)
    comm = _connect(eng)
    # the trainer's next weights, twice: other inits, in BF16 as DeepSpeed holds them
    for sync, seed in enumerate((1, 2), start=1):
        params = list(build_model("qwen3_moe-tiny", seed=seed).to(torch.bfloat16).named_parameters())
        _broadcast(eng, comm, params)
        info = eng.sync_info()
        assert info["syncs"] == sync and info["params"] == len(params) and info["seconds"] > 0
        codes = eng.fp4_weights()
        assert len(codes) > 0
        sd = dict(params)
        for name, c in codes.items():
            assert torch.equal(c, fp4.quantize_weight(sd[name].detach(), "nvfp4").codes), name
        assert torch.equal(eng.engine.weights.inv_freq, rope)


@pytest.mark.parametrize("name,overrides", [("qwen3_moe-tiny", {}), ("mixtral-tiny", {"tie_word_embeddings": True}),
                                            ("qwen2_moe-tiny", {})])
def test_per_tensor_sync_equals_whole_dict_sync_holding_one_tensor(tmp_path, name, overrides):
    eng = _engine(tmp_path, name, **overrides)
    assert eng.engine.mode == "w4a4"
    ref = copy.deepcopy(eng.engine)  # the engine as it started, for the whole-dict sync
    rope = eng.engine.weights.inv_freq.clone()
    before = {k: t.data_ptr() for k, t in _held(eng.engine.weights).items()}
    start = {k: t.clone() for k, t in _held(eng.engine.weights).items()}
    params = list(build_model(name, seed=1, **overrides).to(torch.bfloat16).named_parameters())
    tied = bool(overrides.get("tie_word_embeddings"))
    assert tied == ("lm_head.weight" not in dict(params))  # a tied model's parameters name the embeddings once

    seen, alive = [], []
    sync_tensor = eng.engine.sync_tensor

    def watch(pname, tensor):
        # what the engine holds as this tensor arrives: the pending store, and the earlier received tensors not freed
        seen.append((pname, sorted(eng.pending), [n for n, r in alive[-1:] if not _released(r)]))
        alive.append((pname, weakref.ref(tensor)))
        sync_tensor(pname, tensor)

    eng.engine.sync_tensor = watch
    _broadcast(eng, _connect(eng), params)
    assert [s[0] for s in seen] == [n for n, _ in params]
    assert [s for s in seen if s[1] != [s[0]] or s[2]] == []  # the one being re-quantized, nothing else
    assert eng.pending == {} and [n for n, r in alive if not _released(r)] == []

    # the sync as it was: every received tensor kept until the last, then the whole state dict at once
    sd = {n: p.detach().clone() for n, p in params}
    if tied:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    ref.sync_weights(sd, inv_freq=rope)
    got, want = _held(eng.engine.weights), _held(ref.weights)
    assert got.keys() == want.keys() and any(k.endswith(".codes") for k in got)
    assert [k for k in got if not torch.equal(got[k], want[k])] == []
    assert {k: t.data_ptr() for k, t in got.items()} == before  # in place: decode graphs stay valid
    assert eng.sync_info()["params"] == len(sd) and eng.sync_info()["syncs"] == 1
    # the new weights (every FP4 weight's codes, the embeddings), the RoPE buffer kept
    moved = [k for k in got if k.endswith(".codes") or k == "embed"]
    assert [k for k in moved if torch.equal(start[k], got[k])] == [] and torch.equal(start["inv_freq"], got["inv_freq"])


def test_open_sync_refuses_generation_and_a_missing_parameter_fails():
    m = build_model("qwen3_moe-tiny", seed=0, dtype=torch.bfloat16)
    eng = RolloutEngine(m.config, mode="w4a4", kv_fp4=True, dtype=torch.bfloat16, device="cpu")
    eng.sync_weights(m)
    params = dict(build_model("qwen3_moe-tiny", seed=1, dtype=torch.bfloat16).named_parameters())
    eng.sync_tensor("model.layers.0.self_attn.q_proj.weight", params["model.layers.0.self_attn.q_proj.weight"])
    with pytest.raises(RuntimeError, match="weight sync is open"):
        eng.generate([[1, 40, 41]], max_new_tokens=2)
    with pytest.raises(KeyError, match="did not bring"):
        eng.finish_sync()
    eng.generate([[1, 40, 41]], max_new_tokens=2)  # closed (with the error), the engine generates again
