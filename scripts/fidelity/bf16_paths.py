"""Where the rollout's and the trainer's forwards part: one rollout batch of an SFT base (W4A4 + FP4 KV,
a full-codes record of every layer) replayed, unguided, through the patched HF model in three trainer
precisions, for an engine in FP32 and in BF16.

Trainer precisions: fp32 (FP32 weights and ops), autocast (FP32 master weights under BF16 autocast:
the RL trainer; matmuls in BF16, residual stream, norms and softmax in FP32) and bf16 (BF16 weights, no
autocast: every op and the residual stream in BF16, like the BF16 engine). Per pair: per-layer code flip
rate of the trainer's own rounding against the rollout's codes (rollout routing), the same per
quantization site of layer 0 (where a difference first shows), k3 and mean |dlp| over the sampled tokens.

    PYTHONPATH=$PWD python scripts/fidelity/bf16_paths.py MODEL SFT_CKPT [--batches 3] [--profile smoke] [--device cpu]
MODEL: a model of the profile (smoke: qwen3_moe-tiny | mixtral-tiny; small: the *-small flavors, with
`--device cuda`: the engine's Triton kernels in BF16, cuBLAS in the trainer); SFT_CKPT:
results/runs/PROFILE/MODEL/reasoning/sft/ckpt (after `snakemake all`; scripts/gpu/profile_chunk.sh rebuilds
the small profile's). The run config is the profile's trace seed 0 config of MODEL. Compared against: nothing
upstream; the numbers are in results/fidelity/.
"""
import argparse
import json
import warnings

import torch

from trace import config as C
from trace import rundir
from trace.episode import build_task, run_episode
from trace.guidance import Recorder
from trace.guidance.mismatch import mismatch_metrics
from trace.models import load_checkpoint
from trace.qat import patch_model, replay
from trace.rl.trainer import build_train_batch, token_logprobs
from trace.rollout import RolloutEngine


def main(model: str, ckpt: str, batches: int = 3, profile: str = "smoke", device: str = "cpu") -> None:
    torch.set_num_threads(2)
    cfg = C.load_config(f"results/runs/{profile}/configs/{model}/reasoning/trace-seed0.yaml", ["threads=2"])
    task = build_task(cfg)
    train = task.make_split("train", cfg["task"]["n_train"], cfg["task"]["seed"])
    trainers = {}
    ckpt = rundir.resolve_checkpoint(ckpt)
    for name, dtype in (("fp32", torch.float32), ("autocast", torch.float32), ("bf16", torch.bfloat16)):
        m, tok = load_checkpoint(ckpt, dtype=dtype, device=device)
        patch_model(m, "w4a4kv4", "nvfp4")
        trainers[name] = m.eval()
    for eng_dtype in (torch.float32, torch.bfloat16):
        eng = RolloutEngine(trainers["fp32"].config, mode="w4a4", kv_fp4=True, dtype=eng_dtype, device=device)
        eng.sync_weights(trainers["fp32"])
        acc = {name: {"k3": [], "dlp": [], "flip": {}, "site0": {}} for name in trainers}
        for b in range(batches):
            g = torch.Generator().manual_seed(100 + b)
            examples = [train[i] for i in torch.randperm(len(train), generator=g)[:8].tolist()]
            rec = Recorder(layers=None, full_codes=True)
            batch = run_episode(eng, task, tok, examples, n=8, max_new_tokens=6, temperature=1.0, seed=b,
                                max_turns=1, recorder=rec).batch
            record = rec.finish()
            tb = build_train_batch(batch, tok.pad_token_id, device=device)
            for name, m in trainers.items():
                with torch.no_grad(), replay(m, record, tb.seq, tb.pos, guide=False) as st:
                    lp = token_logprobs(m, tb, autocast=name == "autocast")
                mm = mismatch_metrics(lp, tb.lp_roll, tb.mask)
                acc[name]["k3"].append(mm["k3"])
                acc[name]["dlp"].append(mm["dlp_abs_mean"])
                for layer, v in st.summary()["code_flip_rate"].items():
                    acc[name]["flip"].setdefault(int(layer), []).append(v)
                for site, (f, n) in st.totals().layer(0).site_codes.items():
                    if n:
                        acc[name]["site0"].setdefault(site, []).append(f / n)
        for name, a in acc.items():
            row = {"model": model, "device": device, "engine": str(eng_dtype).split(".")[-1], "trainer": name,
                   "k3": sum(a["k3"]) / len(a["k3"]), "dlp_abs_mean": sum(a["dlp"]) / len(a["dlp"]),
                   "code_flip_rate": {k: round(sum(v) / len(v), 5) for k, v in sorted(a["flip"].items())},
                   "layer0_sites": {k: round(sum(v) / len(v), 5) for k, v in sorted(a["site0"].items())}}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("ckpt")
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--profile", default="smoke")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    main(a.model, a.ckpt, a.batches, a.profile, a.device)
