"""The one episode step: prompt encoding, engine generate with stop strings and EOS, scoring; the
RL trainer's rollout and the evaluator run the same function (same seed -> same samples)."""
from __future__ import annotations

import torch

from trace import config as C
from trace.episode import build_task, encode_prompt, evaluate_policy, heldout_examples, run_episode
from trace.models import build_model, build_tokenizer
from trace.rollout import RolloutEngine


def _setup(extra=()):
    cfg = C.load_config(None, ["wandb.mode=disabled", "task.n_test=4", "eval.samples_per_prompt=2",
                               "eval.temperature=1.0", "rl.max_new_tokens=4", *extra])
    model = build_model("qwen3_moe-tiny", seed=0)
    eng = RolloutEngine(model.config, mode="bf16", dtype=torch.float32)
    eng.sync_weights(model)
    return cfg, model, eng, build_task(cfg), build_tokenizer()


def test_prompt_encoding_starts_with_bos():
    tok = build_tokenizer()
    ids = encode_prompt(tok, "1+2=")
    assert ids[0] == tok.bos_token_id and len(ids) == 5


def test_episode_scores_every_sample_and_times_generation_alone():
    cfg, _, eng, task, tok = _setup()
    exs = heldout_examples(cfg, task)
    ep = run_episode(eng, task, tok, exs, n=3, max_new_tokens=4, temperature=1.0, seed=7, max_turns=1)
    assert len(ep.scores) == len(ep.texts) == len(ep.batch.tokens) == 3 * len(exs)
    assert ep.batch.prompt_index == [i for i in range(len(exs)) for _ in range(3)]
    assert ep.texts == ep.batch.texts(tok)
    assert ep.scores == task.score_batch([exs[i] for i in ep.batch.prompt_index], ep.texts)
    assert ep.generate_s > 0 and ep.score_s >= 0
    assert 0.0 <= ep.accuracy <= 1.0


def test_evaluation_is_the_episode_step():
    """evaluate_policy = run_episode on the held-out split with the eval settings."""
    cfg, model, eng, task, tok = _setup()
    res = evaluate_policy(model, cfg, task, tok, "bf16")
    exs = heldout_examples(cfg, task)
    ep = run_episode(eng, task, tok, exs, n=2, max_new_tokens=4, temperature=1.0, seed=cfg["eval"]["seed"],
                     max_turns=cfg["rl"]["max_turns"])
    assert res["n"] == len(ep.scores) and res["n_prompts"] == len(exs)
    assert res["accuracy"] == ep.accuracy and res["reward"] == ep.reward
