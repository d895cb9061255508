"""Rollout speed with and without records: one RL-step-sized generate (8 train prompts x 8 samples,
6 new tokens, W4A4 + FP4 KV, temperature 1) of a smoke SFT checkpoint, with no record, with trace's
guidance record (rho 0.5, routing of every MoE layer) and with the all-layer full-codes diagnostic
record; tokens per whole call (the old speed column) vs per generation alone (`generate_s`, the new
one) and the recording's share. Median of 6 repetitions after one warm-up.

    PYTHONPATH=$PWD python scripts/fidelity/rollout_speed.py MODEL_CKPT_DIR [MODEL_CONFIG.yaml]

MODEL_CKPT_DIR: e.g. results/runs/smoke/qwen3_moe-tiny/reasoning/sft (after `snakemake all`); the task
comes from the run config (default: the smoke profile's trace-seed0 config of that model).
Compared against: the rollout and recording seconds the RL runs log (metrics.jsonl).
"""
import statistics
import sys
import warnings
from pathlib import Path

import torch

from trace import config as C
from trace import rundir
from trace.episode import build_task, encode_prompt
from trace.guidance import Recorder, guided_layer_indices
from trace.models import EOS_ID, build_tokenizer, load_checkpoint
from trace.rollout import RolloutEngine


def main(ckpt: str, cfg_path: str | None = None) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    if cfg_path is None:
        model_dir = Path(ckpt).parents[1]  # .../<model>/reasoning/sft -> .../<model>
        cfg_path = str(model_dir.parent / "configs" / model_dir.name / "reasoning-short" / "trace-seed0.yaml")
    cfg = C.load_config(cfg_path, ["wandb.mode=disabled"])
    model, _ = load_checkpoint(rundir.resolve_checkpoint(ckpt), device="cpu", load_tokenizer=False)
    task, tok = build_task(cfg), build_tokenizer()
    prompts = [encode_prompt(tok, e.prompt) for e in task.make_split("train", 8, 0)]
    eng = RolloutEngine(model.config, mode="w4a4", kv_fp4=True, dtype=torch.float32)
    eng.sync_weights(model)
    n_layers = model.config.num_hidden_layers
    makers = {"no record": lambda: None,
              "trace record": lambda: Recorder(layers=guided_layer_indices(n_layers, 0.5)),
              "diagnostic record": lambda: Recorder(layers=None, full_codes=True)}
    res = {k: [] for k in makers}
    for rep in range(7):
        for k, make in makers.items():
            b = eng.generate(prompts, n=8, max_new_tokens=6, temperature=1.0, seed=rep, stop_token_ids=(EOS_ID,),
                             stop_strings=(task.stop,), tokenizer=tok, recorder=make())
            if rep:
                res[k].append((b.num_generated_tokens / b.elapsed_s, b.num_generated_tokens / b.generate_s,
                               b.record_s / b.generate_s))
    for k, v in res.items():
        print(f"{k:18s} tok/s of the whole call {statistics.median(x[0] for x in v):7.0f} | of generation alone "
              f"{statistics.median(x[1] for x in v):7.0f} | recording / generation {statistics.median(x[2] for x in v):.2f}")


if __name__ == "__main__":
    main(*sys.argv[1:])
