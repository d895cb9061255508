"""RL losses, advantage estimators and train-rollout mismatch metrics (pure tensor functions).

* `compute_advantages`: outcome rewards of `group_size` samples per prompt -> per-token advantages,
  with OpenRLHF's estimator names and numerics (OpenRLHF 0.11.2,
  `openrlhf/trainer/ppo_utils/experience_maker.py::compute_advantages_and_returns`):
  "group_norm" (GRPO: (r - mean_g) / (std_g + 1e-9), unbiased std), "rloo" (r minus the mean of the
  other samples of the group), "reinforce_baseline" (r - mean_g, then whitened over all action tokens
  of the batch with rstd = rsqrt(max(var, 1e-8))).
* `policy_loss`: PPO-clip with train/rollout importance correction, argument-for-argument the
  semantics of OpenRLHF 0.11.2 `openrlhf/models/loss.py::PolicyLoss` with token-level aggregation:
  TIS = `is_correction_level="token", mode="clip"` (coef = clamp(pi_old/pi_rollout, 0, cap)),
  ICEPOP = `level="token", mode="mask"` (tokens whose ratio is outside [lo, hi] dropped, survivors
  keep their IS weight).
* `kl_k3`: Schulman's k3 estimator as OpenRLHF's `compute_approx_kl(kl_estimator="k3")`.
* `mismatch_metrics` (defined in trace/guidance/mismatch.py, shared with the OpenRLHF actor): k1, k3,
  |dlp| mean/max, fraction of r outside [0.5, 2], chi^2 over trainable tokens.

tests/rl/test_openrlhf_crosscheck.py imports OpenRLHF's own modules (with stubs for ray/deepspeed)
and compares on random inputs; no OpenRLHF code is copied here.
"""
from __future__ import annotations

import torch

from trace.guidance.mismatch import mismatch_metrics
from trace.settings import RLSettings


class NonFiniteError(FloatingPointError):
    """The trainer produced NaN/inf; the step was not applied."""


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def group_baseline(rewards: torch.Tensor, group_size: int, estimator: str) -> torch.Tensor:
    """Per-sample shaped reward [N] (N = prompts * group_size, grouped contiguously by prompt)."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.float().reshape(-1, group_size)
    if estimator == "group_norm":
        if group_size < 2:
            raise ValueError("group_norm needs group_size >= 2 (the std of one sample is undefined)")
        out = (r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-9)
    elif estimator == "rloo":
        if group_size < 2:
            raise ValueError("rloo needs group_size >= 2")
        out = r - (r.sum(-1, keepdim=True) - r) / (group_size - 1)
    elif estimator == "reinforce_baseline":
        out = r - r.mean(-1, keepdim=True)
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    return out.reshape(-1)


def compute_advantages(rewards: torch.Tensor, action_mask: torch.Tensor, group_size: int,
                       estimator: str = "group_norm") -> torch.Tensor:
    """Per-token advantages [N, T] for outcome rewards [N]; zero where action_mask is 0.

    With an outcome reward and gamma = 1 the return of every action token is the shaped reward of its
    sample (OpenRLHF's get_cumulative_returns); reinforce_baseline then whitens over the action tokens.
    """
    mask = action_mask.float()
    shaped = group_baseline(rewards, group_size, estimator)
    adv = shaped[:, None] * mask
    if estimator == "reinforce_baseline":
        n = mask.sum()
        mean = (adv * mask).sum() / n
        var = ((adv - mean).pow(2) * mask).sum() / n
        adv = (adv - mean) * var.clamp(min=1e-8).rsqrt()
        adv = adv * mask
    return adv


def policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                action_mask: torch.Tensor, rollout_log_probs: torch.Tensor | None = None,
                clip_eps: float = RLSettings.clip_eps, tis_cap: float | None = None,
                icepop: tuple[float, float] | None = None,
                is_old_log_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Token-level PPO-clip loss with optional TIS or ICEPOP correction against the rollout.

    ratio = exp(clamp(log_probs - old_log_probs, -20, 20)); loss_t = -min(ratio*A, clip(ratio)*A);
    is = exp(old_log_probs - rollout_log_probs) (detached);
    TIS: loss_t *= clamp(is, 0, tis_cap); ICEPOP: loss_t *= is * [lo <= is <= hi].
    `is_old_log_probs` replaces old_log_probs in the IS weight only (default: old_log_probs, OpenRLHF's
    form); the trainer passes its own detached log-probs there when the PPO old policy is the rollout.
    Returns (scalar loss = masked token mean, info dict of detached scalars).
    """
    if tis_cap is not None and icepop is not None:
        raise ValueError("choose TIS (tis_cap) or ICEPOP (icepop), not both")
    mask = action_mask.float()
    log_ratio = log_probs - old_log_probs
    ratio = log_ratio.clamp(-20.0, 20.0).exp()
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages
    loss = -torch.min(surr1, surr2)
    info: dict = {}
    if tis_cap is not None or icepop is not None:
        if rollout_log_probs is None:
            raise ValueError("TIS / ICEPOP need the rollout log-probs")
        is_src = old_log_probs if is_old_log_probs is None else is_old_log_probs
        is_ratio = (is_src - rollout_log_probs).detach().exp()
        if tis_cap is not None:
            coef = is_ratio.clamp(min=0.0, max=tis_cap)
            filtered = is_ratio > tis_cap
        else:
            lo, hi = icepop
            keep = (is_ratio >= lo) & (is_ratio <= hi)
            coef = torch.where(keep, is_ratio, torch.zeros_like(is_ratio))
            filtered = ~keep
        loss = coef * loss
        info["is_filter_frac"] = float(masked_mean(filtered.float(), mask))
    out = masked_mean(loss, mask)
    info["clip_frac"] = float(masked_mean(torch.lt(surr2, surr1).float(), mask))
    info["ppo_kl"] = float(masked_mean(-log_ratio.detach(), mask))
    return out, info


def kl_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 KL(pi || pi_ref) estimate, clamped like OpenRLHF (log ratio >= -10, value in [-10, 10])."""
    lr = (log_probs.float() - ref_log_probs.float()).clamp(min=-10)
    return ((-lr).exp() - 1 + lr).clamp(-10, 10)


__all__ = ["NonFiniteError", "compute_advantages", "group_baseline", "kl_k3", "masked_mean", "mismatch_metrics", "policy_loss"]
