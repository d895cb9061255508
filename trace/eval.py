"""Evaluate a checkpoint on the task's test split under BF16 and FP4 deployment.

    python -m trace.eval --config CFG.yaml --ckpt RUN_DIR_OR_MODEL_DIR --out eval.json [--set eval.temperature=0]

Deployment = the rollout engine (trace/rollout) with the checkpoint's weights: "bf16" runs it
unquantized, "fp4" in W4A4 with the FP4 KV cache (weights re-quantized from the checkpoint's master
weights by the shared quantizer). `posthoc-fp4` is simply the "fp4" entry of a `bf16`-trained run.
The test set is every unique held-out prompt once, at most `n_test` of them. Sampling:
`eval.samples_per_prompt` samples at `eval.temperature` (0 = greedy) per test prompt, seeded by
`eval.seed`, so SFT base and RL policies are scored on identical prompts with identical seeds.
accuracy = fraction of samples with reward 1; reward = mean reward; per_prompt = each prompt's
fraction correct; se = the accuracy's standard error clustered by prompt. The episode and the scoring are
trace/episode.py's (`evaluate_policy`), the same step RL training runs.

Output: {"checkpoint": path, "task": ..., "bf16": {"accuracy", "se", "reward", "n", "n_prompts", "per_prompt"},
"fp4": {...}, "meta": {... trace/rundir.py's run metadata, "start_time", "end_time" of the evaluation}}.
`--ckpt` takes a model directory (config.json), a run directory or its ckpt/ (the latest checkpoint).
Compared against: tests/test_eval.py (a gold-answer oracle scores 1, the stand-alone JSON shape).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from trace import config as C
from trace import rundir
from trace.episode import build_task, eval_settings, evaluate_policy, heldout_examples


def evaluate_checkpoint(cfg: dict, ckpt, modes=None) -> dict:
    from trace.models import build_tokenizer, load_checkpoint
    rundir.set_threads(cfg)
    path = rundir.resolve_checkpoint(ckpt)
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
    a, cfg = C.parse_cli(p, argv)
    try:  # the checkpoint must be the config's model; exit 2 before anything is written
        rundir.check_inputs(cfg, {"--ckpt": a.ckpt})
    except C.ConfigError as e:
        C.fail(e)
    started = rundir.utc_now()
    try:
        res = evaluate_checkpoint(cfg, a.ckpt)
    except KeyboardInterrupt:  # nothing is written before the evaluation ends
        return rundir.report_interrupt(f"interrupted; nothing written to {a.out}; rerun the same command to evaluate")
    # start and end of the evaluation (analysis/gputime.py); files written before end_time existed have
    # only start_time, taken here, i.e. when the evaluation had ended
    res["meta"] = {**rundir.collect_meta(), "start_time": started, "end_time": rundir.utc_now()}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({m: {k: v for k, v in res[m].items() if k != "per_prompt"} for m in cfg["eval"]["modes"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
