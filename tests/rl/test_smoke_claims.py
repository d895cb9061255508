"""The two experimental claims of the smoke setting on the CPU (qwen3_moe-tiny, easy arithmetic, the smoke configs):

1. Learning signal: `bf16` RL raises held-out accuracy over the SFT base by more than 3 standard
   errors of the rise, clustered by prompt (analysis.learning.rise: same prompts, same sampling seed;
   the easy split's 44 unique test prompts x 16 samples at temperature 1 each). Before the evaluation
   set lost its repeats this read 0.207 -> 0.406 on 64 prompts with 20 repeats and a binomial SE.
2. Mismatch ordering: on the same base, prompts and seeds, `trace` has lower k3 and mean |dlp| than
   `qat-independent`, and `fp4-naive` the highest of the three.

Same runs from the command line:
    python -m trace.sft --config experiments/configs/smoke_sft_reasoning.yaml --out runs/sft
    python -m trace.rl  --config experiments/configs/smoke_rl_reasoning.yaml --out runs/rl_bf16 \\
        --set rl.method=bf16 --set rl.init_ckpt=runs/sft
    python -m trace.eval --config experiments/configs/smoke_rl_reasoning.yaml --ckpt runs/sft --out sft.json
"""
from __future__ import annotations

import warnings

import pytest

from analysis.learning import rise
from tests.rl.conftest import RL_CONFIG, ROOT, ROOT_OVERRIDES
from trace import config as C
from trace.eval import evaluate_checkpoint
from trace.rl.trainer import RLTrainer


def _rl_cfg(sft_ckpt, extra=()):
    return C.load_config(ROOT / RL_CONFIG, ROOT_OVERRIDES + [f"rl.init_ckpt={sft_ckpt}", *extra])


@pytest.mark.slow
def test_bf16_rl_beats_sft_base(tmp_path, sft_ckpt):
    # 60 steps: at the config's 30 the rise depends on the CPU kind (a Xeon of the CI's kind: 0.134 -> 0.193, 1.8 SE,
    # at the commit that passed elsewhere); at 60 it read 0.134 -> 0.261 (3.9 SE) there
    cfg = _rl_cfg(sft_ckpt, ["rl.method=bf16", "rl.steps=60", "rl.eval_every=0"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = evaluate_checkpoint(cfg, sft_ckpt, modes=["bf16"])["bf16"]
        RLTrainer(cfg, tmp_path / "rl", progress=False).run()
        after = evaluate_checkpoint(cfg, tmp_path / "rl", modes=["bf16"])["bf16"]
    r = rise(base, after)  # the smoke pipeline's learning check: paired, prompt-clustered SE
    print(f"\nSFT base accuracy {r['acc_base']:.3f} -> RL {r['acc_final']:.3f} ({r['n_prompts']} unique prompts, "
          f"rise {r['rise']:+.3f}, 3 SE = {3 * r['se_rise']:.3f})")
    assert r["n_prompts"] == base["n_prompts"] == 44 and base["n"] == 44 * 16  # the easy split's unique test prompts
    assert r["rise"] > 3 * r["se_rise"], r


@pytest.mark.slow
def test_mismatch_ordering_across_arms(tmp_path, sft_ckpt):
    res = {}
    for m in ("fp4-naive", "qat-independent", "trace"):
        cfg = _rl_cfg(sft_ckpt, [f"rl.method={m}", "rl.steps=3", "rl.eval_every=0"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            recs = RLTrainer(cfg, tmp_path / m, progress=False).run()
        res[m] = {k: sum(r[k] for r in recs) / len(recs) for k in ("k3", "dlp_abs_mean")}
    print("\n" + "\n".join(f"{m:16s} k3={v['k3']:.2e} |dlp|={v['dlp_abs_mean']:.2e}" for m, v in res.items()))
    for k in ("k3", "dlp_abs_mean"):
        assert res["trace"][k] < res["qat-independent"][k] < res["fp4-naive"][k], (k, res)
    assert res["trace"]["k3"] < 0.5 * res["qat-independent"]["k3"]
