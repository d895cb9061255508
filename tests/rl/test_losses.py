"""The RL loss functions (trace/rl/losses.py) and the trainer's choice of their arguments, on hand-computed
values: the PPO-clip loss with TIS and ICEPOP and the IS weight's own old policy (`is_old_log_probs`, what
rl.ppo_ratio=rollout passes), the k3 KL estimate's direction, and the advantage estimators' baselines and
divisors. tests/rl/test_openrlhf_crosscheck.py compares the same functions against OpenRLHF's code where
its wheel can be had; these need nothing but torch."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from tests.rl.conftest import small_cfg
from trace.rl.losses import compute_advantages, group_baseline, kl_k3, policy_loss
from trace.rl.trainer import RLTrainer

# one sample of 4 tokens, the last masked out
LP = [-1.0, -0.5, -2.0, -0.2]  # the trainer's log-probs
ROLL = [-1.5, -0.5, -1.0, -0.3]  # the rollout's
ADV = [1.0, 1.0, -1.0, 1.0]
MASK = [1, 1, 1, 0]


def _t(v):
    return torch.tensor([v], dtype=torch.float64)


def _ppo_terms(lp, old, adv, eps=0.2):
    """Per-token -min(r A, clip(r, 1 - eps, 1 + eps) A), r = exp(lp - old), in plain Python."""
    out = []
    for a, b, A in zip(lp, old, adv, strict=True):
        r = math.exp(a - b)
        out.append(-min(r * A, min(max(r, 1 - eps), 1 + eps) * A))
    return out


def _masked_mean(v, mask=MASK):
    return sum(x for x, m in zip(v, mask, strict=True) if m) / sum(mask)


def test_plain_ppo_clip_by_hand():
    lp = _t(LP).requires_grad_(True)
    loss, info = policy_loss(lp, _t(ROLL), _t(ADV), _t(MASK).bool(), clip_eps=0.2)
    terms = _ppo_terms(LP, ROLL, ADV)
    # r = e^0.5 (A > 0): clipped to 1.2; r = 1: -1; r = e^-1 (A < 0): clipped to 0.8, loss +0.8
    assert terms[:3] == pytest.approx([-1.2, -1.0, 0.8])
    assert float(loss) == pytest.approx(_masked_mean(terms), rel=1e-12)
    assert info["clip_frac"] == pytest.approx(2 / 3)  # tokens 0 and 2 clipped
    assert info["ppo_kl"] == pytest.approx(_masked_mean([b - a for a, b in zip(LP, ROLL, strict=True)]))
    loss.backward()
    # clipped tokens pass no gradient; the unclipped one -A r / n_tokens
    assert lp.grad[0].tolist() == pytest.approx([0.0, -1 / 3, 0.0, 0.0])


@pytest.mark.parametrize("cap", [2.0, 1.5])
def test_tis_weights_by_the_capped_is_ratio(cap):
    """TIS: each token's loss times min(exp(old - rollout), cap), OpenRLHF's default form (old = the PPO old policy)."""
    old = [-0.8, -0.5, -1.4, -0.3]
    loss, info = policy_loss(_t(LP), _t(old), _t(ADV), _t(MASK).bool(), _t(ROLL), clip_eps=0.2, tis_cap=cap)
    w = [min(math.exp(o - r), cap) for o, r in zip(old, ROLL, strict=True)]  # e^0.7 = 2.01, 1, e^-0.4, 1
    terms = [t * c for t, c in zip(_ppo_terms(LP, old, ADV), w, strict=True)]
    assert float(loss) == pytest.approx(_masked_mean(terms), rel=1e-12)
    assert info["is_filter_frac"] == pytest.approx(1 / 3)  # e^0.7 > cap in both cases


def test_icepop_drops_tokens_outside_the_band_and_keeps_the_weight_of_the_rest():
    old = [-0.8, -0.5, -1.4, -0.3]  # IS ratios e^0.7 = 2.01 (dropped), 1, e^-0.4 = 0.67 (kept, weighted)
    loss, info = policy_loss(_t(LP), _t(old), _t(ADV), _t(MASK).bool(), _t(ROLL), clip_eps=0.2, icepop=(0.5, 2.0))
    t = _ppo_terms(LP, old, ADV)
    assert float(loss) == pytest.approx(_masked_mean([0.0, t[1], t[2] * math.exp(-0.4), 0.0]), rel=1e-12)
    assert info["is_filter_frac"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="not both"):
        policy_loss(_t(LP), _t(old), _t(ADV), _t(MASK).bool(), _t(ROLL), tis_cap=2.0, icepop=(0.5, 2.0))
    with pytest.raises(ValueError, match="rollout log-probs"):
        policy_loss(_t(LP), _t(old), _t(ADV), _t(MASK).bool(), None, tis_cap=2.0)


@pytest.mark.parametrize("kw", [dict(tis_cap=2.0), dict(icepop=(0.5, 2.0))], ids=["tis", "icepop"])
def test_is_weight_takes_its_own_old_policy(kw):
    """rl.ppo_ratio=rollout: the PPO ratio is against the rollout (old = rollout log-probs) and the IS weight
    against the trainer (is_old = its detached log-probs): weights exp(lp - rollout) = e^0.5, 1, e^-1, not 1.
    With ICEPOP e^-1 = 0.37 is outside [0.5, 2] and dropped."""
    lp = _t(LP)
    loss, info = policy_loss(lp, _t(ROLL), _t(ADV), _t(MASK).bool(), _t(ROLL), clip_eps=0.2,
                             is_old_log_probs=lp.detach(), **kw)
    t = _ppo_terms(LP, ROLL, ADV)
    w = [math.exp(a - b) for a, b in zip(LP, ROLL, strict=True)]
    if "icepop" in kw:
        w = [x if 0.5 <= x <= 2.0 else 0.0 for x in w]
    want = _masked_mean([a * b for a, b in zip(t, w, strict=True)])
    assert float(loss) == pytest.approx(want, rel=1e-12)
    assert abs(want - _masked_mean(t)) > 0.1  # an IS weight of 1 would give the plain PPO loss
    assert info["is_filter_frac"] == pytest.approx(1 / 3 if "icepop" in kw else 0.0)


@pytest.mark.parametrize("ppo_ratio", ["rollout", "trainer"])
def test_trainer_passes_the_old_policy_of_its_ppo_ratio(tmp_path, ppo_ratio):
    """RLTrainer.policy_loss: ppo_ratio=rollout -> PPO ratio exp(lp - rollout), IS weight exp(lp - rollout) (the
    trainer's detached log-probs); ppo_ratio=trainer (OpenRLHF's decoupled form) -> PPO ratio 1 in value,
    IS weight exp(lp - rollout) as well. A small random-init trainer of the bf16 arm (no alignment term)."""
    cfg = small_cfg(["rl.method=bf16", f"rl.ppo_ratio={ppo_ratio}", "rl.tis_cap=2.0", "rl.icepop=null",
                     "rl.clip_eps=0.2", "rl.kl_coef=0.0"])
    tr = RLTrainer(cfg, tmp_path / "r", progress=False)
    tb = SimpleNamespace(lp_roll=_t(ROLL), mask=_t(MASK).bool())
    lp = _t(LP).requires_grad_(True)
    loss, parts = tr.policy_loss(lp, tb, _t(ADV))
    w = [min(math.exp(a - b), 2.0) for a, b in zip(LP, ROLL, strict=True)]
    t = _ppo_terms(LP, ROLL if ppo_ratio == "rollout" else LP, ADV)
    assert float(loss) == pytest.approx(_masked_mean([a * b for a, b in zip(t, w, strict=True)]), rel=1e-12)
    assert parts["kl_ref"] is None and "align_loss" not in parts  # the train step adds the alignment term
    assert parts["clip_frac"] == pytest.approx(2 / 3 if ppo_ratio == "rollout" else 0.0)


def test_kl_k3_is_kl_of_the_policy_from_the_reference():
    """k3(lp, ref) = exp(ref - lp) - 1 + (lp - ref), >= 0 and 0 only at lp == ref; not symmetric: the reversed
    arguments give e - 2 where this gives 1/e."""
    lp, ref = torch.tensor([-1.0, -2.0, -1.0]), torch.tensor([-2.0, -1.0, -1.0])
    k = kl_k3(lp, ref)
    assert k.tolist() == pytest.approx([math.exp(-1), math.e - 2, 0.0], rel=1e-6)
    # clamped like OpenRLHF: log ratio >= -10, value <= 10
    assert float(kl_k3(torch.tensor([-30.0]), torch.tensor([0.0]))) == pytest.approx(10.0)
    assert float(kl_k3(torch.tensor([0.0]), torch.tensor([-30.0]))) == pytest.approx(10.0)


def test_group_baselines_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])  # two groups of 4
    # rloo: r minus the mean of the OTHER three samples
    assert group_baseline(r, 4, "rloo").tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0])
    # reinforce_baseline before whitening: r minus the group mean
    assert group_baseline(r, 4, "reinforce_baseline").tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    # group_norm: over the unbiased std (sqrt(1/3) for 1, 0, 0, 1); a constant group gives 0, not NaN
    s = math.sqrt(1 / 3)
    assert group_baseline(r, 4, "group_norm").tolist() == pytest.approx([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s,
                                                                          0, 0, 0, 0], rel=1e-6)
    r2 = torch.tensor([3.0, 1.0])
    assert group_baseline(r2, 2, "rloo").tolist() == [2.0, -2.0]
    for est in ("rloo", "group_norm"):
        with pytest.raises(ValueError):
            group_baseline(r2, 1, est)
    with pytest.raises(ValueError, match="groups of 3"):
        group_baseline(r, 3, "rloo")


def test_advantages_spread_over_action_tokens_and_whiten():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1]]).bool()
    a = compute_advantages(r, mask, 4, "rloo")
    want = torch.tensor([[2, 2, 0], [-2, 0, 0], [-2, -2, -2], [0, 2, 2]]) / 3
    torch.testing.assert_close(a, want)
    # reinforce_baseline: (r - mean_g) whitened over the 8 action tokens: values +-0.5 (4 of each sign here)
    # have mean 0 and (biased) variance 0.25 -> +-1
    b = compute_advantages(r, mask, 4, "reinforce_baseline")
    assert b[mask].tolist() == pytest.approx([1, 1, -1, -1, -1, -1, 1, 1], rel=1e-6)
    assert bool((b[~mask] == 0).all())
