"""One actor rank of the world-size-2 test (test_world_size_2.py runs two of these, one process each):

    python tests/integrations/openrlhf/world2_rank.py RANK PORT SYNC_PORT INIT_CKPT OUT_JSON ARM

Both ranks: one gloo group of world size 2 with the CPU shim of launch's workers, the tiny model under DeepSpeed
ZeRO-3 with every parameter partitioned across the two ranks, one training step on this rank's own micro-batch
under the arm's replay (its own records), the gathered gradients, the optimizer step, then OpenRLHF's own
`ActorPPOTrainer.broadcast_to_vllm` (every parameter gathered by both ranks, broadcast by rank 0). Rank 0 also hosts
the rollout engine (`TraceRolloutEngine`, the actor body, in threads) at the other end of the weight-sync group.
Each rank checks against the unwrapped model given both ranks' micro-batches (the reference of data parallelism:
gradients averaged over the ranks) and writes what it found to OUT_JSON."""
import json
import os
import sys
import threading
import time
from types import SimpleNamespace

import torch

from trace.integrations.openrlhf import plugin, stand_ins

stand_ins.install()
plugin.install_cpu_shim()

import deepspeed  # noqa: E402
import ray  # noqa: E402
from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer  # noqa: E402
from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator  # noqa: E402
from vllm.distributed.utils import StatelessProcessGroup  # noqa: E402
from zero3_steps import B, T, ds_config, rollout_records, train_step  # noqa: E402

from trace import config as C  # noqa: E402
from trace import fp4  # noqa: E402
from trace.arms import ARMS  # noqa: E402
from trace.integrations.openrlhf.actor import TraceReplay, prepare_for_qat  # noqa: E402
from trace.integrations.openrlhf.rollout import TraceRolloutEngine  # noqa: E402
from trace.models import build_model  # noqa: E402
from trace.qat import patch_model  # noqa: E402

NAME = "qwen3_moe-tiny"
WORLD = 2


class _Remote:
    """`handle.method.remote(...)` of a Ray actor, run in a thread of this process; `ray.get` joins it."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *a, **k):
        t = threading.Thread(target=self.fn, args=a, kwargs=k)
        t.start()
        return t


def _join(refs):
    return [t.join() for t in (refs if isinstance(refs, list) else [refs])]


def main(rank: int, port: int, sync_port: int, init_ckpt: str, out: str, arm: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = C.load_config(None, [f"model={NAME}", f"rl.method={arm}"])
    mode, fmt = ARMS[arm].trainer_mode, cfg["rl"]["fmt"]
    ids = torch.randint(5, 100, (WORLD * B, T), generator=torch.Generator().manual_seed(1))
    batches = [ids[k * B:(k + 1) * B] for k in range(WORLD)]  # rank k trains on batch k
    mms = [rollout_records(NAME, cfg, b) for b in batches]
    tr = TraceReplay(cfg)

    # the reference: the unwrapped model over both ranks' micro-batches, gradients averaged
    ref = build_model(NAME, seed=0, dtype=torch.bfloat16)
    patch_model(ref, mode, fmt)
    refs = [train_step(tr, ref, b, mm, lambda loss: (loss / WORLD).backward()) for b, mm in zip(batches, mms, strict=False)]

    model = build_model(NAME, seed=0, dtype=torch.bfloat16)
    prepare_for_qat(model, mode, fmt, zero_stage=3)
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config())
    shards = {n: p.ds_tensor.numel() for n, p in model.named_parameters()}
    full = {n: p.ds_numel for n, p in model.named_parameters()}
    old, lp, al, flips = train_step(tr, model, batches[rank], mms[rank], eng.backward)
    ref_old, ref_lp, ref_al, ref_flips = refs[rank]
    grads = {n: deepspeed.utils.safe_get_full_grad(p) for n, p in model.named_parameters()}  # a collective
    want = dict(ref.named_parameters())
    grad_rel = {n: float((g - want[n].grad.float()).norm() / want[n].grad.float().norm().clamp_min(1e-12))
                for n, g in grads.items() if g is not None and want[n].grad is not None}
    eng.step()

    # the weight sync, OpenRLHF's code: both ranks gather each parameter, rank 0 broadcasts it to the engine
    roll = sync = None
    if rank == 0:
        roll = TraceRolloutEngine(init_ckpt, cfg, remote_rm_url=None)
        t = threading.Thread(target=roll.init_process_group,
                             args=("127.0.0.1", sync_port, 1, 2, "openrlhf"), kwargs={"backend": "gloo", "use_ray": False})
        t.start()
        sync = PyNcclCommunicator(StatelessProcessGroup.create("127.0.0.1", sync_port, 0, 2), torch.device("cpu"))
        t.join()
        ray.get = _join  # the engine's calls are threads here, not Ray object refs
    engines = [SimpleNamespace(update_weight=_Remote(roll.update_weight))] if roll is not None else []
    args = SimpleNamespace(vllm=SimpleNamespace(enable_prefix_caching=False, sync_with_ray=False),
                           ds=SimpleNamespace(zero_stage=3, tensor_parallel_size=1))
    trainer = SimpleNamespace(strategy=SimpleNamespace(args=args), actor=SimpleNamespace(model=eng, is_vlm=False),
                              use_cuda_ipc=False, vllm_engines=engines, _model_update_group=sync)
    t0 = time.perf_counter()
    ActorPPOTrainer.broadcast_to_vllm(trainer)
    sync_s = time.perf_counter() - t0
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        after = {n: p.detach().clone() for n, p in model.named_parameters()}
    init = dict(build_model(NAME, seed=0, dtype=torch.bfloat16).named_parameters())
    res = {"rank": rank, "world": torch.distributed.get_world_size(), "shards": shards, "full": full,
           "lp_diff": float((lp - ref_lp).abs().max()), "old_diff": float((old - ref_old).abs().max()),
           "align": al, "ref_align": ref_al, "flips": flips, "ref_flips": ref_flips, "grad_rel": grad_rel,
           "moved": sorted(n for n in after if not torch.equal(after[n], init[n].detach())), "sync_s": sync_s}
    if roll is not None:
        codes = roll.fp4_weights()
        res["syncs"] = roll.syncs
        res["engine_codes"] = len(codes)
        res["codes_equal"] = sorted(n for n, c in codes.items()
                                    if torch.equal(c, fp4.quantize_weight(after[n], fmt).codes))
        res["codes_changed"] = sorted(n for n, c in codes.items()
                                      if not torch.equal(c, fp4.quantize_weight(init[n].detach(), fmt).codes))
    with open(out, "w") as f:
        json.dump(res, f)
    torch.distributed.barrier()


if __name__ == "__main__":
    r, p, sp, ck, o, a = sys.argv[1:]
    main(int(r), int(p), int(sp), ck, o, a)
