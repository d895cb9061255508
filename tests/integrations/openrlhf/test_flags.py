"""Every arm's OpenRLHF flags go through OpenRLHF's own parser and validation, with the meaning we intend."""
import pytest

from trace import config as C
from trace.arms import ARMS
from trace.integrations.openrlhf.flags import UnsupportedConfig, ppo_flags
from trace.integrations.openrlhf.launch import parse_with_openrlhf


def _cfg(*sets):
    return C.load_config(None, ["model=qwen3_moe-tiny", "rl.steps=3", "rl.prompts_per_step=4", "rl.group_size=4",
                                *sets])


def _args(cfg, **kw):
    kw.setdefault("reward_file", "reward.py")
    return parse_with_openrlhf(ppo_flags(cfg, model_path="m", prompts="p.jsonl", out="/tmp/o", **kw))


@pytest.mark.parametrize("method", sorted(ARMS))
def test_every_arm_parses(method):
    a = _args(_cfg(f"rl.method={method}"))
    assert a.algo.advantage.estimator == "group_norm" and a.rollout.n_samples_per_prompt == 4
    assert a.ds.attn_implementation == "sdpa" and not a.ds.packing_samples
    assert a.train.batch_size == 16 and a.rollout.batch_size == 4 and a.data.max_samples == 12
    # TIS (default tis_cap 2.0): token-level clip into [0, 2]
    assert (a.algo.advantage.is_correction_level, a.algo.advantage.is_correction_mode) == ("token", "clip")
    assert list(a.algo.advantage.is_correction_threshold) == [0.0, 2.0]
    assert a.algo.kl.init_coef == 0.0 and not a.algo.kl.use_loss


@pytest.mark.parametrize("adv", ["group_norm", "reinforce_baseline", "rloo"])
def test_estimators(adv):
    assert _args(_cfg(f"rl.advantage={adv}")).algo.advantage.estimator == adv


def test_icepop_kl_and_agent():
    a = _args(_cfg("rl.tis_cap=null", "rl.icepop=[0.5, 5.0]", "rl.kl_coef=0.01"), reward_file=None,
              agent_file="agent.py", gpus=8)
    assert (a.algo.advantage.is_correction_mode, list(a.algo.advantage.is_correction_threshold)) == ("mask", [0.5, 5.0])
    assert a.algo.kl.use_loss and a.algo.kl.estimator == "k3" and a.algo.kl.init_coef == 0.01
    assert a.train.agent_func_path == "agent.py" and a.reward.remote_url == ["agent"]
    assert a.train.colocate_all and a.vllm.sync_backend == "nccl" and a.actor.num_gpus_per_node == 8


def test_rollout_ratio_refused():
    with pytest.raises(UnsupportedConfig, match="ppo_ratio"):
        ppo_flags(_cfg("rl.ppo_ratio=rollout"), model_path="m", prompts="p", out="o", reward_file="r.py")


def test_vllm_engine_only_for_bf16(tmp_path):
    from trace.integrations.openrlhf.launch import main
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: qwen3_moe-tiny\nrl: {method: trace}\n")
    assert main(["--config", str(cfg), "--out", str(tmp_path / "o"), "--engine", "vllm", "--gpus", "8"]) == 2
    assert not (tmp_path / "o").exists()
