"""One episode step, shared by RL training and evaluation: prompts -> engine -> environment -> scores.

    task = build_task(cfg)
    ep = run_episode(engine, task, tok, examples, n=8, max_new_tokens=6, temperature=1.0, seed=s,
                     max_turns=cfg["rl"]["max_turns"], recorder=rec)
    ep.batch (RolloutBatch), ep.scores [n * len(examples)], ep.texts, ep.generate_s, ep.score_s

Prompt encoding is `<bos>` + the prompt's character ids (`encode_prompt`, the same in SFT). The
engine samples n completions per prompt, ending a turn at the task's stop string and a sample at
EOS; multi-turn tasks get an `EnvPool` (one environment per sample) and up to
min(max_turns, task.max_turns) turns. Scores come from the task's verifier on the decoded responses.
Generation time (`generate_s`) is measured around the engine call alone.

`evaluate_policy` deploys a policy in a fresh engine ("bf16", or "fp4" = W4A4 + FP4 KV with weights
from the shared quantizer) and runs one episode over the held-out split `eval.split` ("test", or
"validation" for choices of configuration) with the `eval.*` settings, every unique held-out example once
(at most `n_test`); it returns the accuracy with its per-example accuracies, each example's cluster and the
cluster-robust standard error (`clustered_se`; a cluster is the task's `cluster_key`: the prompt text, which
long-horizon's secrets share, or coding's gold function);
the RL trainer (periodic eval), SFT (eval_every) and `python -m trace.eval` all call it.
Compared against: tests/test_episode.py (gold responses score 1, RL and eval share the step) and
tests/test_eval.py.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from trace.models import EOS_ID
from trace.rollout import EnvPool, RolloutBatch, RolloutEngine
from trace.stats import clustered_se


def encode_prompt(tok, prompt: str) -> list[int]:
    """`<bos>` + the prompt's character ids (the tokenizer adds no special tokens by itself)."""
    return [tok.bos_token_id] + tok(prompt, add_special_tokens=False)["input_ids"]


def build_task(cfg: dict):
    from trace.tasks import get_task
    from trace.tasks.datasets import with_jsonl
    t = cfg["task"]
    return with_jsonl(get_task(t["name"], difficulty=t["difficulty"], **(t.get("knobs") or {})), t)


@dataclass
class Episode:
    batch: RolloutBatch  # samples of prompt i are contiguous, n per prompt
    scores: list[float]  # per sample, the task's reward
    texts: list[str]  # per sample, the decoded response
    generate_s: float  # wall time of the engine call (sampling, environment turns, recording)
    score_s: float  # wall time of decoding and scoring

    @property
    def accuracy(self) -> float:
        return float((torch.tensor(self.scores) >= 1.0).float().mean())

    @property
    def reward(self) -> float:
        return float(torch.tensor(self.scores).mean())


def run_episode(engine: RolloutEngine, task, tok, examples, *, n: int, max_new_tokens: int, temperature: float,
                seed: int, max_turns: int, recorder=None) -> Episode:
    """n samples per example from `engine` (recording into `recorder` if given), scored by `task`."""
    env, turns = None, 1
    if task.multi_turn:
        env = EnvPool.for_examples(task, examples, n)
        turns = min(max_turns, getattr(task, "max_turns", max_turns))
    prompts = [encode_prompt(tok, e.prompt) for e in examples]
    t0 = time.perf_counter()
    batch = engine.generate(prompts, n=n, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                            stop_token_ids=(EOS_ID,), stop_strings=(task.stop,), tokenizer=tok,
                            recorder=recorder, env=env, max_turns=turns)
    t1 = time.perf_counter()
    texts = batch.texts(tok)
    scores = task.score_batch([examples[i] for i in batch.prompt_index], texts)
    return Episode(batch, list(scores), texts, t1 - t0, time.perf_counter() - t1)


# ----------------------------------------------------------------------------------------------
# Evaluation: one episode over the held-out split
# ----------------------------------------------------------------------------------------------
def eval_settings(cfg: dict) -> dict:
    e = cfg["eval"]
    return {
        "n_test": e["n_test"] or cfg["task"]["n_test"],
        "samples_per_prompt": e["samples_per_prompt"],
        "temperature": e["temperature"],
        "max_new_tokens": e["max_new_tokens"] or cfg["rl"]["max_new_tokens"],
        "seed": e["seed"],
        "split": e["split"],
    }


def heldout_examples(cfg: dict, task):
    """At most `n_test` examples of the held-out split `eval.split`, each once (fewer when it holds fewer)."""
    s = eval_settings(cfg)
    return task.heldout(s["n_test"], cfg["task"]["seed"], split=s["split"])


def cluster_ids(task, examples) -> list[int]:
    """Per example, the index of its cluster (`task.cluster_key`), clusters numbered in order of first
    appearance."""
    ids: dict[str, int] = {}
    return [ids.setdefault(task.cluster_key(e), len(ids)) for e in examples]


@torch.no_grad()
def evaluate_policy(model, cfg: dict, task, tok, mode: str = "bf16", examples=None, state_dict=None) -> dict:
    """Accuracy / mean reward of `model` deployed in the engine (`mode` "bf16" or "fp4"). state_dict: the
    parameters by name to deploy in place of the model's own (a ZeRO-3 rank's model holds shards only; the
    OpenRLHF policy actor gathers them), with the model's config and its RoPE buffer."""
    if mode not in ("bf16", "fp4"):
        raise ValueError(f"mode must be 'bf16' or 'fp4', got {mode!r}")
    s = eval_settings(cfg)
    examples = examples if examples is not None else heldout_examples(cfg, task)
    eng = RolloutEngine(model.config, mode="bf16" if mode == "bf16" else "w4a4", fmt=cfg["rl"]["fmt"],
                        kv_fp4=mode == "fp4", device=cfg["device"])
    if state_dict is None:
        eng.sync_weights(model)
    else:
        rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
        eng.sync_weights(state_dict, inv_freq=getattr(rotary, "inv_freq", None))
    ep = run_episode(eng, task, tok, examples, n=s["samples_per_prompt"], max_new_tokens=s["max_new_tokens"],
                     temperature=s["temperature"], seed=s["seed"], max_turns=cfg["rl"]["max_turns"])
    correct = torch.tensor(ep.scores) >= 1.0
    per_prompt = torch.zeros(len(examples), dtype=torch.float64).index_add_(
        0, torch.tensor(ep.batch.prompt_index), correct.double())
    per_prompt = (per_prompt / s["samples_per_prompt"]).tolist()  # [examples] fraction correct
    cluster = cluster_ids(task, examples)
    return {"accuracy": ep.accuracy, "reward": ep.reward, "n": len(ep.scores), "n_prompts": len(examples),
            "n_clusters": len(set(cluster)), "se": clustered_se(per_prompt, cluster), "per_prompt": per_prompt,
            "cluster": cluster, "tokens_per_s": ep.batch.num_generated_tokens / max(ep.generate_s, 1e-9),
            "response_len": ep.batch.num_generated_tokens / max(len(ep.scores), 1)}  # generated tokens per sample
