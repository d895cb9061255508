"""One RL step's metrics record: a line of a run's metrics.jsonl, written by both trainers and read by analysis/.

    from trace.metrics import StepMetrics, ABSENT
    m = StepMetrics(step=3, method="trace", reward_mean=0.5, ...)   # an unknown name is a TypeError
    log.log(m.to_dict())                                            # the fields that are not ABSENT, in field order

Writers: the embedded trainer (`trace.rl.trainer.RLTrainer`) and the OpenRLHF policy actor
(`trace.integrations.openrlhf.actor.metrics_line`). Reader: analysis/runs.py (`RunData.series` and
`layer_profile` take only these names). tests/test_metrics.py keeps the writers and the reader on these fields.

A field is ABSENT (left out of the line) where its writer or the step has no such quantity, and None (JSON null)
where the quantity exists in the record but is undefined this step (e.g. `kl_ref` without a KL term). Per-layer
fields are dicts {layer: value}. Fields whose name starts with `time_` and the throughputs
(`rollout_gen_tokens_per_s`, `record_overhead`) are wall-clock measurements; every other field of the embedded
trainer is a function of the config and seed (on the CPU: scripts/compare_runs.py compares two runs on them).
Definitions of the quantities: docs/DESIGN.md §3 (guidance, flips, alignment term) and §4 (metrics).
Pure Python (no torch), so analysis/ imports it cheaply.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


class _Absent:
    """The value of a field the line leaves out."""

    _one = None

    def __new__(cls):
        if cls._one is None:
            cls._one = super().__new__(cls)
        return cls._one

    def __repr__(self) -> str:
        return "ABSENT"

    def __bool__(self) -> bool:
        return False


ABSENT: Any = _Absent()


def absent_if_none(v):
    """`v`, or ABSENT where it is None (a quantity the line leaves out rather than logging as null)."""
    return ABSENT if v is None else v


@dataclass(slots=True)
class StepMetrics:
    """One metrics.jsonl line. Step 0 (the initial policy's evaluation) holds step, method and eval_accuracy. Slots:
    setting a name that is not a field raises AttributeError, as passing one to the constructor raises TypeError."""

    step: int  # RL step, 1-based; 0 = the initial policy's held-out evaluation
    method: str  # the arm (rl.method, trace/arms.py)
    framework: str = ABSENT  # "openrlhf" for the OpenRLHF actor's lines; absent for the embedded trainer
    # ---- rollout outcome
    reward_mean: float = ABSENT  # mean task reward of the step's samples
    accuracy: float = ABSENT  # fraction of samples with reward >= 1
    response_len: float = ABSENT  # trainable (generated) tokens per sample
    # ---- train-rollout mismatch over trainable tokens (trace.guidance.mismatch)
    k1: float = ABSENT  # mean(lp_roll - lp_train)
    k3: float = ABSENT  # mean(r - 1 - log r), r = exp(lp_train - lp_roll)
    dlp_abs_mean: float = ABSENT  # mean |lp_train - lp_roll|
    dlp_abs_max: float = ABSENT  # max |lp_train - lp_roll|
    ratio_out_frac: float = ABSENT  # fraction of tokens with r outside [0.5, 2]
    chi2: float = ABSENT  # mean (r - 1)^2
    k3_grad: float = ABSENT  # exact arm: k3 of the forward whose gradient the step takes (its values are the engine's)
    # ---- per-layer flip rates {layer: rate} (DESIGN.md §3 diagnostics; {} for arms whose trainer keeps BF16 activations)
    code_flip_rate: dict = ABSENT  # trainer's own RTN code != the rollout's
    scale_flip_rate: dict = ABSENT  # own block scale != the rollout's
    unrecoverable_rate: dict = ABSENT  # guided code != the rollout's, at guided sites of a full-codes reference
    routing_flip_rate: dict = ABSENT  # own top-k expert set != the rollout's, per token
    # ---- guidance record and rollout speed
    guidance_bytes_per_gen_token: float = ABSENT  # bytes of the arm's own record per generated token (0 without)
    guidance_bits_per_element: float | None = ABSENT  # bits per guided element (None without a record)
    rollout_gen_tokens_per_s: float = ABSENT  # generated tokens / generation time, recording excluded
    record_overhead: float = ABSENT  # time on the arm's own record / generation time (0 without one)
    # ---- wall-clock seconds of the step's phases
    time_generate_s: float = ABSENT  # the engine call
    time_record_s: float = ABSENT  # the arm's own record (rows, final feed, finish)
    time_score_s: float = ABSENT  # decoding and the task's verifier
    time_rollout_s: float = ABSENT  # the rollout phase (generation, recording, scoring)
    time_sync_s: float = ABSENT  # OpenRLHF: the weight sync before this step's rollout
    time_train_s: float = ABSENT  # forwards, losses, backwards and the optimizer step (no diagnostic split)
    time_exact_score_s: float = ABSENT  # exact arm: the engine's scoring forward, inside time_train_s
    # ---- loss and its parts
    loss: float = ABSENT  # the optimized loss: policy loss + kl_coef * kl_ref + align_coef * align_loss
    policy_loss: float = ABSENT  # PPO-clip with TIS / ICEPOP, token mean
    kl_ref: float | None = ABSENT  # k3 KL to the reference policy (None without a KL term)
    align_loss: float | None = ABSENT  # the unweighted alignment term (None for arms without it)
    clip_frac: float = ABSENT  # fraction of tokens where PPO's clip is active
    is_filter_frac: float | None = ABSENT  # fraction of tokens past the TIS cap / outside ICEPOP's band
    # the alignment term's parts (ReplayStats.alignment_parts): per part ("codes": elements, "scales": block
    # scales) the mean hinge over flipped items, the part's share of the term's sum, the flipped fraction of its
    # items, and the mean hinge per layer {layer: hinge}; absent for a part with nothing recorded
    align_codes_hinge_layer: dict = ABSENT
    align_scales_hinge_layer: dict = ABSENT
    align_codes_hinge: float = ABSENT
    align_codes_share: float = ABSENT
    align_codes_flipped: float = ABSENT
    align_scales_hinge: float = ABSENT
    align_scales_share: float = ABSENT
    align_scales_flipped: float = ABSENT
    # ---- gradient
    grad_norm: float = ABSENT  # before clipping
    grad_norm_align: float = ABSENT  # the weighted alignment term's gradient alone (steps with the term)
    grad_norm_rest: float = ABSENT  # the rest of the loss's gradient (steps with the term)
    align_grad_ratio: float | None = ABSENT  # grad_norm_align / grad_norm_rest (None without the term)
    time_split_s: float = ABSENT  # the extra backward that the split costs, left out of the other times
    n_tokens: int = ABSENT  # trainable tokens of the step
    gpu_peak_alloc_gb: float | None = ABSENT  # the step's peak allocated GPU memory (None off a GPU)
    gpu_peak_reserved_gb: float | None = ABSENT  # the step's peak of what the allocator held (None off a GPU)
    actor_ranks: int = ABSENT  # OpenRLHF: the actor's data-parallel ranks
    # ---- periodic held-out evaluation (step 0, every rl.eval_every-th step and the last)
    eval_accuracy: float = ABSENT
    eval_reward: float = ABSENT
    time_eval_s: float = ABSENT  # OpenRLHF: the evaluation's seconds
    time_step_s: float = ABSENT  # the whole step with its evaluation, less time_split_s

    def to_dict(self) -> dict:
        """The line: every field that is not ABSENT, in field order."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not ABSENT}

    @classmethod
    def from_dict(cls, line: dict) -> StepMetrics:
        """A line read back (TypeError on a name that is not a field)."""
        return cls(**line)


FIELDS: tuple[str, ...] = tuple(f.name for f in fields(StepMetrics))
# the per-layer rates ({layer: rate})
LAYER_FIELDS: tuple[str, ...] = ("code_flip_rate", "scale_flip_rate", "unrecoverable_rate", "routing_flip_rate")
# what every training step's line holds, from either trainer
TRAIN_FIELDS: tuple[str, ...] = (
    "step", "method", "reward_mean", "accuracy", "response_len", "k1", "k3", "dlp_abs_mean", "dlp_abs_max",
    "ratio_out_frac", "chi2", *LAYER_FIELDS, "guidance_bytes_per_gen_token", "rollout_gen_tokens_per_s",
    "record_overhead", "time_rollout_s", "time_train_s", "loss", "policy_loss", "kl_ref", "align_loss", "clip_frac",
    "is_filter_frac", "grad_norm", "time_step_s")
# the alignment term's parts (what `ReplayStats.alignment_parts` returns, besides the per-layer dicts)
ALIGN_PART_FIELDS: tuple[str, ...] = ("align_codes_hinge", "align_codes_share", "align_codes_flipped",
                                      "align_scales_hinge", "align_scales_share", "align_scales_flipped")


def check_line(line: dict) -> None:
    """Raise ValueError where a metrics line holds a name that is not a StepMetrics field."""
    extra = sorted(set(line) - set(FIELDS))
    if extra:
        raise ValueError(f"not StepMetrics fields (trace/metrics.py): {extra}")


__all__ = ["ABSENT", "ALIGN_PART_FIELDS", "FIELDS", "LAYER_FIELDS", "StepMetrics", "TRAIN_FIELDS", "absent_if_none",
           "check_line"]
