"""Environment adapters for multi-turn generation in the rollout engine.

The engine calls `env.step(sample_index, generated_text_this_turn) -> (observation_text, done)` (or
`env(sample_index, text)`) whenever a sample's turn ends at a stop string; the observation is appended
as non-trainable tokens and generation continues from the cache. `EnvPool` wraps one
`trace.tasks.long_horizon.GuessNumberEnv`-style environment per sample (its `step(action) ->
(observation, reward, done)`), resetting each with the example of the sample's prompt, and keeps the
rewards:

    pool = EnvPool.for_examples(task, examples, n)        # sample i plays examples[i // n]
    out = engine.generate([tok(ex.prompt) ... ], n=n, env=pool, stop_strings=("\\n",), tokenizer=tok,
                          max_turns=task.max_turns)
    pool.rewards                                          # per sample

Compared against: `trace.tasks.long_horizon.run_episode` (the same transcript protocol).
"""
from __future__ import annotations


class EnvPool:
    def __init__(self, envs: list):
        self.envs = list(envs)
        self.rewards = [0.0] * len(self.envs)
        self.done = [False] * len(self.envs)

    @classmethod
    def for_examples(cls, task, examples, n: int = 1) -> "EnvPool":
        """One env per sample (samples of prompt i are contiguous, n per prompt), reset on its example."""
        return cls([task.make_env(ex) for ex in examples for _ in range(n)])

    def step(self, sample_index: int, text: str) -> tuple[str, bool]:
        if not 0 <= sample_index < len(self.envs):
            raise IndexError(f"sample {sample_index} has no environment (pool of {len(self.envs)})")
        obs, reward, done = self.envs[sample_index].step(text)
        self.rewards[sample_index] = float(reward)
        self.done[sample_index] = bool(done)
        return obs, done
