"""Guidance-side fidelity measurements (routing replay coverage, byte accounting, flip diagnostic) on the
smoke profile's RL setup, starting from a smoke SFT checkpoint. Two modes:

  steps:   run S RL steps of an arm and print per-step k3, per-layer code-flip rate (the DESIGN.md §3
           diagnostic), alignment loss and guidance bytes, then their means:
      PYTHONPATH=$PWD python scripts/fidelity/guidance_probe.py steps MODEL CKPT METHOD RHO S
  routing: the same rollouts (B batches of 8 prompts x 8 samples, no optimizer step) replayed with
           routing replay on every MoE layer vs on the guided layers only; mean k3 and |dlp|:
      PYTHONPATH=$PWD python scripts/fidelity/guidance_probe.py routing MODEL CKPT - RHO B

MODEL: qwen3_moe-tiny | mixtral-tiny; CKPT: an SFT run's ckpt/ dir (results/runs/smoke/MODEL/reasoning/
sft/ckpt after `snakemake all`). Compared against: results/guidance/probe.json (`python -m trace.guidance.probe`).
"""
import copy
import json
import sys
import tempfile
import warnings

import torch

from trace import config as C
from trace.episode import run_episode
from trace.guidance import Recorder, guided_layer_indices
from trace.qat import replay
from trace.rl.losses import mismatch_metrics
from trace.rl.trainer import RLTrainer, build_train_batch, token_logprobs


def trainer(model: str, ckpt: str, method: str, rho: float) -> RLTrainer:
    cfg = C.load_config(f"results/runs/smoke/configs/{model}/reasoning/trace-seed0.yaml",
                        [f"rl.init_ckpt={ckpt}", f"rl.method={method}", f"rl.rho={rho}", "threads=1",
                         "rl.eval_every=0"])
    torch.set_num_threads(1)
    return RLTrainer(cfg, tempfile.mkdtemp(), progress=False)


def steps(tr: RLTrainer, n: int) -> None:
    rows = []
    for s in range(1, n + 1):
        r = tr._step(s)
        flip = {int(k): v for k, v in r["code_flip_rate"].items()}
        row = {"step": s, "k3": r["k3"], "flip": flip, "flip_mean": sum(flip.values()) / max(len(flip), 1),
               "align_loss": r["align_loss"], "bytes_per_gen_token": r["guidance_bytes_per_gen_token"],
               "bits_per_element": r["guidance_bits_per_element"]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    print("MEAN", json.dumps({k: sum(r[k] for r in rows) / len(rows) for k in rows[0]
                              if isinstance(rows[0][k], float)}))


def routing(tr: RLTrainer, rho: float, n: int) -> None:
    layers = guided_layer_indices(tr.num_layers, rho)
    acc = {"all": [], "guided": []}
    for s in range(1, n + 1):
        rec = Recorder(layers=layers)
        batch = run_episode(tr.engine, tr.task, tr.tok, tr._prompts_for(s), n=8, max_new_tokens=6, temperature=1.0,
                            seed=1000 + s, max_turns=1, recorder=rec).batch
        record = rec.finish()
        part = copy.copy(record)
        part.routing = {i: v for i, v in record.routing.items() if i in layers}
        tb = build_train_batch(batch, tr.tok.pad_token_id)
        for name, r in (("all", record), ("guided", part)):
            with torch.no_grad(), replay(tr.model, r, tb.seq, tb.pos):
                lp = token_logprobs(tr.model, tb, True)
            acc[name].append(mismatch_metrics(lp, tb.lp_roll, tb.mask))
    for name, ms in acc.items():
        print("rho", rho, "routing replay on", name, "layers:",
              {k: f"{sum(m[k] for m in ms) / len(ms):.3e}" for k in ("k3", "dlp_abs_mean", "dlp_abs_max")})


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    mode, model, ckpt, method, rho, n = sys.argv[1:7]
    tr = trainer(model, ckpt, "trace" if method == "-" else method, float(rho))
    steps(tr, int(n)) if mode == "steps" else routing(tr, float(rho), int(n))
