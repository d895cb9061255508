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
    assert res["meta"]["start_time"] <= res["meta"]["end_time"]  # the evaluation's job interval (analysis/gputime.py)
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


def test_evaluation_scores_each_unique_prompt_once_with_its_standard_error(monkeypatch):
    """The easy space's test split holds 44 unique prompts; asking for 64 used to evaluate 64 with 20
    repeats (n_prompts 64). Now every unique prompt is scored once: 44 prompts x 3 samples. With an
    engine whose sample j of prompt i is the gold answer iff (i + j) % 4 == 0, the per-prompt
    accuracies are 1/3 or 0, they average to the accuracy, and se = sd over prompts / sqrt(44)."""
    import math

    from trace.episode import build_task, encode_prompt
    from trace.models import build_model, build_tokenizer
    from trace.rollout import RolloutBatch
    from trace.rollout import engine as E
    from trace.sft import encode_text
    cfg = _cfg(["task.n_test=64", "eval.samples_per_prompt=3"])
    task, tok = build_task(cfg), build_tokenizer()
    exs = heldout_examples(cfg, task)
    assert len(exs) == 44 == len({e.prompt for e in exs})
    gold = {tuple(encode_prompt(tok, e.prompt)): encode_text(tok, task.sft_target(e)) for e in exs}
    wrong = encode_text(tok, "x\n")

    def fake_generate(self, prompts, *, n=1, **kw):
        toks, pi = [], []
        for i, p in enumerate(prompts):
            for j in range(n):
                toks.append(list(p) + (gold[tuple(p)] if (i + j) % 4 == 0 else wrong))
                pi.append(i)
        B = len(toks)
        pl = [len(prompts[i]) for i in pi]
        resp = [len(t) - q for t, q in zip(toks, pl, strict=True)]
        return RolloutBatch(toks, pl, [[0.0] * r for r in resp], [[True] * r for r in resp], pi, list(range(B)),
                            [True] * B, ["stop_string"] * B, sum(resp), 0.0)

    monkeypatch.setattr(E.RolloutEngine, "generate", fake_generate)
    res = evaluate_policy(build_model("qwen3_moe-tiny", seed=0), cfg, task, tok, "bf16")
    assert res["n_prompts"] == 44 and res["n"] == 132 and len(res["per_prompt"]) == 44
    pp = res["per_prompt"]
    assert set(pp) == {0.0, 1 / 3}
    assert math.isclose(sum(pp) / 44, res["accuracy"], abs_tol=1e-9)
    mean = sum(pp) / 44
    sd = math.sqrt(sum((p - mean) ** 2 for p in pp) / 43)
    assert sd > 0 and math.isclose(res["se"], sd / math.sqrt(44), rel_tol=1e-6)
