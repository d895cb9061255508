"""Evaluate a checkpoint on the task's test split under BF16 and FP4 deployment.

    python -m trace.eval --config CFG.yaml --ckpt RUN_DIR_OR_MODEL_DIR --out eval.json [--set eval.temperature=0]

Deployment = the rollout engine (trace/rollout) with the checkpoint's weights: "bf16" runs it
unquantized, "fp4" in W4A4 with the FP4 KV cache (weights re-quantized from the checkpoint's master
weights by the shared quantizer). `posthoc-fp4` is simply the "fp4" entry of a `bf16`-trained run.
Sampling: `eval.samples_per_prompt` samples at `eval.temperature` (0 = greedy) per test prompt, seeded
by `eval.seed`, so SFT base and RL policies are scored on identical prompts with identical seeds.
accuracy = fraction of samples with reward 1; reward = mean reward.

Output: {"checkpoint": path, "task": ..., "bf16": {"accuracy", "reward", "n", "n_prompts"}, "fp4": {...}}.
`--ckpt` takes a model directory (config.json), a run directory or its ckpt/ (the latest checkpoint).
Compared against: tests/test_eval.py (a gold-answer oracle scores 1, the stand-alone JSON shape).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from trace import config as C


def eval_settings(cfg: dict) -> dict:
    e = cfg["eval"]
    return {
        "n_test": e["n_test"] or cfg["task"]["n_test"],
        "samples_per_prompt": e["samples_per_prompt"],
        "temperature": e["temperature"],
        "max_new_tokens": e["max_new_tokens"] or cfg["rl"]["max_new_tokens"],
        "seed": e["seed"],
    }


def heldout_examples(cfg: dict, task):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # small easy splits are topped up with repeats; expected
        return task.make_split("test", eval_settings(cfg)["n_test"], cfg["task"]["seed"])


@torch.no_grad()
def evaluate_policy(model, cfg: dict, task, tok, mode: str = "bf16", examples=None) -> dict:
    """Accuracy / mean reward of `model` deployed in the engine (`mode` "bf16" or "fp4")."""
    from trace.models import EOS_ID
    from trace.rollout import EnvPool, RolloutEngine
    from trace.sft import encode_prompt
    if mode not in ("bf16", "fp4"):
        raise ValueError(f"mode must be 'bf16' or 'fp4', got {mode!r}")
    s = eval_settings(cfg)
    examples = examples if examples is not None else heldout_examples(cfg, task)
    eng = RolloutEngine(model.config, mode="bf16" if mode == "bf16" else "w4a4", fmt=cfg["rl"]["fmt"],
                        kv_fp4=mode == "fp4", dtype=torch.float32, device=cfg["device"])
    eng.sync_weights(model)
    prompts = [encode_prompt(tok, e.prompt) for e in examples]
    n = s["samples_per_prompt"]
    env, max_turns = None, 1
    if task.multi_turn:
        env = EnvPool.for_examples(task, examples, n)
        max_turns = min(cfg["rl"]["max_turns"], getattr(task, "max_turns", cfg["rl"]["max_turns"]))
    t0 = time.perf_counter()
    batch = eng.generate(prompts, n=n, max_new_tokens=s["max_new_tokens"], temperature=s["temperature"],
                         seed=s["seed"], stop_token_ids=(EOS_ID,), stop_strings=(task.stop,), tokenizer=tok,
                         env=env, max_turns=max_turns)
    scores = torch.tensor(task.score_batch([examples[i] for i in batch.prompt_index], batch.texts(tok)))
    return {"accuracy": float((scores >= 1.0).float().mean()), "reward": float(scores.mean()),
            "n": int(scores.numel()), "n_prompts": len(examples),
            "tokens_per_s": batch.num_generated_tokens / max(time.perf_counter() - t0, 1e-9)}


def evaluate_checkpoint(cfg: dict, ckpt, modes=None) -> dict:
    from trace.models import build_tokenizer, load_checkpoint
    from trace.sft import build_task
    C.set_threads(cfg)
    path = C.resolve_checkpoint(ckpt)
    model, _ = load_checkpoint(path, device=cfg["device"], load_tokenizer=False)
    task = build_task(cfg)
    tok = build_tokenizer()
    examples = heldout_examples(cfg, task)
    out = {"checkpoint": str(path), "task": cfg["task"], "eval": eval_settings(cfg)}
    for m in modes or cfg["eval"]["modes"]:
        out[m] = evaluate_policy(model, cfg, task, tok, mode=m, examples=examples)
    return out


def main(argv=None) -> int:
    p = C.base_parser("python -m trace.eval", "Evaluate a checkpoint under BF16 and FP4 deployment.")
    p.add_argument("--ckpt", required=True, help="model dir, run dir or run/ckpt dir")
    p.add_argument("--out", required=True, help="output JSON file")
    a = p.parse_args(argv)
    try:
        cfg = C.load_config(a.config, a.set)
    except C.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    res = evaluate_checkpoint(cfg, a.ckpt)
    res["meta"] = C.collect_meta()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({m: res[m] for m in cfg["eval"]["modes"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
