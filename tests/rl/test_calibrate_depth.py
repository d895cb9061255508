"""The alignment coefficient's rule at each guided depth (DESIGN.md §3, trace/rl/calibrate.py): one coefficient
gives step-1 ratios an order of magnitude apart at rho 1 and rho 0.5, so each depth is calibrated on its own, and the
calibrated ratios (median of seeds 0-2) then lie within 2x of each other. The rule's median is over each seed's own
SFT base, and the trainer logs the ratio at every step."""
from __future__ import annotations

import statistics

import pytest

from tests.rl.conftest import RL_CONFIG, ROOT, ROOT_OVERRIDES, small_cfg
from trace import config as C
from trace import rundir


@pytest.mark.slow
def test_calibrated_step1_ratios_at_rho_1_and_half_within_2x(sft_ckpt):
    from trace.rl.calibrate import calibrate
    reps = {}
    for rho in (1.0, 0.5):
        cfg = C.load_config(ROOT / RL_CONFIG, ROOT_OVERRIDES + [f"rl.init_ckpt={sft_ckpt}", "rl.method=trace",
                                                               f"rl.rho={rho}"])
        reps[rho] = calibrate(cfg, coef=0.1)
        assert reps[rho]["rho"] == rho and len(reps[rho]["runs"]) == 3
        # the ratio is linear in the coefficient at step 1: seed 0's step at the chosen one is the prediction
        assert reps[rho]["check"]["linearity_rel_err"] < 0.05, reps[rho]["check"]
    per_unit = {rho: r["ratio_per_unit_coef_median"] for rho, r in reps.items()}
    # one coefficient for both depths: the term is several times weaker where every layer is guided
    assert per_unit[0.5] > 3 * per_unit[1.0], per_unit
    # each depth at its own coefficient: the median of the three seeds' step-1 ratios
    calibrated = {rho: statistics.median(x["ratio"] / x["coef"] * r["align_coef"] for x in r["runs"])
                  for rho, r in reps.items()}
    assert all(0.13 <= v <= 0.27 for v in calibrated.values()), calibrated
    assert max(calibrated.values()) <= 2 * min(calibrated.values()), calibrated
    print({rho: (r["align_coef"], per_unit[rho], calibrated[rho]) for rho, r in reps.items()})


def test_the_median_is_over_each_seeds_own_base(monkeypatch):
    """Seed k's step 1 starts from the k-th base of --bases; the coefficient comes from the median ratio."""
    from trace.rl import calibrate as cal
    seen = []

    def fake_step1(cfg, coef, seed, base=None):
        seen.append((seed, base))
        ratio = {"b0": 0.004, "b1": 0.001, "b2": 0.002}[base] * coef / 0.1
        return {"seed": seed, "init_ckpt": base, "coef": coef, "ratio": ratio}

    monkeypatch.setattr(cal, "step1", fake_step1)
    cfg = C.load_config(None, ["rl.method=trace", "rl.rho=1.0"])
    rep = cal.calibrate(cfg, coef=0.1, bases=["b0", "b1", "b2"])
    assert seen == [(0, "b0"), (1, "b1"), (2, "b2"), (0, "b0")]  # the last: the check at the chosen coefficient
    assert rep["init_ckpt"] == ["b0", "b1", "b2"] and rep["rho"] == 1.0
    assert rep["align_coef"] == 10.0  # 0.2 / (median 0.002 / 0.1)
    with pytest.raises(C.ConfigError, match="one per seed"):
        cal.calibrate(cfg, bases=["b0"])


def test_every_step_logs_the_alignment_gradient_ratio(tmp_path, sft_ckpt):
    """metrics.jsonl holds grad_norm_align / grad_norm_rest at every step of an arm with the term (not only at
    step 1 and evaluation steps), and none for an arm without it."""
    from trace.rl.trainer import RLTrainer
    for method in ("trace", "trace-noalign"):
        cfg = small_cfg([f"rl.method={method}", "rl.steps=2", "rl.eval_every=0"], init_ckpt=sft_ckpt)
        RLTrainer(cfg, tmp_path / method, progress=False).run()
        recs = rundir.read_metrics(tmp_path / method / "metrics.jsonl")
        assert [r["step"] for r in recs] == [1, 2]
        for r in recs:
            if method == "trace":
                assert r["align_grad_ratio"] == pytest.approx(r["grad_norm_align"] / r["grad_norm_rest"])
                assert r["align_grad_ratio"] > 0 and r["time_split_s"] > 0
                assert r["time_step_s"] > r["time_train_s"] > 0
            else:
                assert r["align_grad_ratio"] is None and "grad_norm_align" not in r and r["time_split_s"] == 0.0
