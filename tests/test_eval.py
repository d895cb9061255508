"""Evaluation under BF16 and FP4 deployment: JSON shape of the CLI, the oracle check (a policy that
always emits the gold answer scores 1), and checkpoint resolution."""
from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

from trace import config as C
from trace.episode import evaluate_policy, heldout_examples

ROOT = Path(__file__).resolve().parent.parent


def _cfg(extra=()):
    return C.load_config(None, ["wandb.mode=disabled", "threads=2", "task.n_test=8", "eval.samples_per_prompt=2",
                                "rl.max_new_tokens=4", *extra])


def test_eval_cli_json(tmp_path):
    from trace.models import build_model, build_tokenizer, save_checkpoint
    m = build_model("qwen3_moe-tiny", seed=0)
    save_checkpoint(m, build_tokenizer(), tmp_path / "model")
    cfgp = tmp_path / "c.yaml"
    cfgp.write_text(C.dump_config(_cfg()))
    out = tmp_path / "e" / "eval.json"
    r = subprocess.run([sys.executable, "-m", "trace.eval", "--config", str(cfgp), "--ckpt", str(tmp_path / "model"),
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["checkpoint"].endswith("model")
    for mode in ("bf16", "fp4"):
        assert set(res[mode]) >= {"accuracy", "reward", "n"} and res[mode]["n"] == 16
        assert 0.0 <= res[mode]["accuracy"] <= 1.0


def test_gold_policy_scores_one(monkeypatch):
    """Feed the evaluator an engine whose samples are the gold responses: accuracy must be 1, and the
    reasoning accuracy of a random-init model must be ~0."""
    from trace.episode import build_task, encode_prompt
    from trace.models import build_model, build_tokenizer
    from trace.rollout import RolloutBatch
    from trace.rollout import engine as E
    from trace.sft import encode_text
    cfg = _cfg()
    task, tok = build_task(cfg), build_tokenizer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exs = heldout_examples(cfg, task)
    gold = {tuple(encode_prompt(tok, e.prompt)): encode_text(tok, task.sft_target(e)) for e in exs}

    def fake_generate(self, prompts, *, n=1, **kw):
        toks, pl, lps, tr, pi = [], [], [], [], []
        for j, p in enumerate(prompts):
            for _ in range(n):
                g = gold[tuple(p)]
                toks.append(list(p) + g)
                pl.append(len(p))
                lps.append([0.0] * len(g))
                tr.append([True] * len(g))
                pi.append(j)
        B = len(toks)
        return RolloutBatch(toks, pl, lps, tr, pi, list(range(B)), [True] * B, ["stop_string"] * B, B, 0.0)

    model = build_model("qwen3_moe-tiny", seed=0)
    base = evaluate_policy(model, cfg, task, tok, "bf16")
    assert base["accuracy"] <= 0.1
    monkeypatch.setattr(E.RolloutEngine, "generate", fake_generate)
    for mode in ("bf16", "fp4"):
        assert evaluate_policy(model, cfg, task, tok, mode)["accuracy"] == 1.0
