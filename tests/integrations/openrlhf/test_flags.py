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


@pytest.mark.parametrize("method", sorted(m for m in ARMS if not ARMS[m].exact))
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


def test_exact_arm_refused():
    with pytest.raises(UnsupportedConfig, match="rl.method=exact"):
        ppo_flags(_cfg("rl.method=exact"), model_path="m", prompts="p", out="o", reward_file="r.py")


def test_vllm_engine_only_for_bf16(tmp_path):
    from trace.integrations.openrlhf.launch import main
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: qwen3_moe-tiny\nrl: {method: trace}\n")
    assert main(["--config", str(cfg), "--out", str(tmp_path / "o"), "--engine", "vllm", "--gpus", "8"]) == 2
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------ launch -- FLAGS
def _launch(tmp_path, *args):
    """A dry run: (exit status, OpenRLHF's parsed args, the train_ppo_ray argv), both from its stdout JSON."""
    import contextlib
    import io
    import json

    from trace.integrations.openrlhf.launch import main
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: qwen3_moe-tiny\ntask: {name: reasoning, n_train: 32}\n"
                   "rl: {method: trace, steps: 2, prompts_per_step: 2, group_size: 2}\n")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = main(["--config", str(cfg), "--out", str(tmp_path / "o"), "--dry-run", *map(str, args)])
    assert not (tmp_path / "o").exists()  # a dry run writes nothing
    if rc:
        return rc, None, None
    printed = json.loads(stdout.getvalue())
    return rc, printed["args"], printed["command"]


def test_user_flags_reach_openrlhfs_parsed_args(tmp_path):
    rc, args, argv = _launch(tmp_path, "--gpus", 0, "--", "--actor.gradient_checkpointing_enable",
                             "--train.micro_batch_size", 2, "--rollout.micro_batch_size=1", "--ckpt.max_num", 1)
    assert rc == 0
    assert args["actor.gradient_checkpointing_enable"] is True and args["ckpt.max_num"] == 1
    assert args["train.micro_batch_size"] == 2 and args["rollout.micro_batch_size"] == 1
    assert argv.count("--train.micro_batch_size") == 1  # the user's value replaced TRACE's default
    assert args["ckpt.load_enable"] is True and args["ckpt.path"].endswith("ckpt/deepspeed")  # resume on rerun


def test_colocation_is_a_launch_option(tmp_path):
    _, args, _ = _launch(tmp_path / "a", "--gpus", 2)
    assert args["train.colocate_all"] is True and args["actor.num_gpus_per_node"] == 2
    _, args, _ = _launch(tmp_path / "b", "--gpus", 2, "--colocate", "none")
    assert args["train.colocate_all"] is False and args["vllm.num_engines"] == 2


def test_actor_ranks_on_a_cpu_are_a_launch_option(tmp_path, capsys):
    """--ranks N: N actor ranks on a CPU machine (data parallel, the per-rank micro-batch split N ways); on GPUs
    the ranks are the GPUs, and a --ranks that differs is refused in one line."""
    _, args, _ = _launch(tmp_path / "a", "--gpus", 0, "--ranks", 2, "--", "--vllm.num_engines", 1)
    assert args["actor.num_gpus_per_node"] == 2 and args["ref.num_gpus_per_node"] == 2
    assert args["train.micro_batch_size"] == 2 and args["train.batch_size"] == 4  # 4 samples over 2 ranks
    assert args["vllm.num_engines"] == 1 and args["train.colocate_all"] is False
    rc, _, _ = _launch(tmp_path / "b", "--gpus", 2, "--ranks", 1)
    assert rc == 2 and "on GPUs the actor ranks are the GPUs" in capsys.readouterr().err


def test_cpu_ranks_refused_with_a_deepspeed_whose_gathers_race(tmp_path, capsys, monkeypatch):
    from trace.integrations.openrlhf import guards

    assert guards.deepspeed_gathers_wait_all()  # the pinned DeepSpeed (requirements-openrlhf.txt)
    assert not guards.deepspeed_gathers_wait_all("0.19.6") and guards.deepspeed_gathers_wait_all("0.20.0")
    monkeypatch.setattr(guards, "deepspeed_gathers_wait_all", lambda installed=None: False)
    rc, _, _ = _launch(tmp_path, "--gpus", 0, "--ranks", 2)
    assert rc == 2 and "DeepSpeed >= 0.19.8" in capsys.readouterr().err


@pytest.mark.parametrize("flags,needle", [
    (["--actor.adam.lr", "1e-3"], "--actor.adam.lr is set by TRACE (from rl.lr)"),
    (["--train.see", "3"], "--train.see is set by TRACE (from seed)"),  # an abbreviation argparse would accept
    (["--ds.zero_stage", "2"], "launch --zero-stage"),
    (["--no.such_flag"], "--no.such_flag is not a flag of OpenRLHF's train_ppo_ray"),
])
def test_conflicting_or_unknown_user_flag_refused(tmp_path, capsys, flags, needle):
    rc, _, _ = _launch(tmp_path, "--gpus", 0, "--", *flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "o").exists()  # refused before the run dir is made


# ------------------------------------------------------------------------------------------ honest flags
@pytest.mark.parametrize("flags,needle", [
    (["--vllm.enable_sleep"], "no sleep / wake_up"),
    (["--train.async_enable"], "no pause / resume"),
    (["--train.partial_rollout_enable"], "partial rollouts need"),
    (["--vllm.gpu_memory_utilization", "0.5"], "no memory pool"),
    (["--vllm.enforce_eager"], "no vLLM CUDA graphs"),
    (["--vllm.enable_prefix_caching"], "no prefix cache"),
    (["--eval.dataset", "e.jsonl"], "rl.eval_every"),
    (["--ds.packing_samples"], "packing needs flash attention"),
])
def test_flags_the_engine_cannot_honour_are_refused(tmp_path, capsys, flags, needle):
    rc, _, _ = _launch(tmp_path, "--gpus", 0, "--", *flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and f"{flags[0]} is not supported: " in err[0] and needle in err[0], err


@pytest.mark.parametrize("flags,needle", [
    (["--ds.attn_implementation", "flash_attention_2"], "fixed by TRACE: the QAT patch runs attention"),
    (["--ckpt.save_hf"], "fixed by TRACE: every checkpoint keeps an HF copy"),
    (["--ckpt.load_enable"], "fixed by TRACE: it is always on"),
])
def test_fixed_flags_say_why(tmp_path, capsys, flags, needle):
    rc, _, _ = _launch(tmp_path, "--gpus", 0, "--", *flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and needle in err[0] and "change it there" not in err[0], err


def test_defaults_the_user_may_replace_reach_openrlhf(tmp_path):
    rc, args, argv = _launch(tmp_path, "--gpus", 0, "--", "--rollout.top_p", 0.9, "--actor.adam.betas", 0.9, 0.95,
                             "--actor.lr_scheduler", "cosine_with_min_lr", "--actor.lr_warmup_ratio", 0.1)
    assert rc == 0
    assert args["rollout.top_p"] == 0.9 and list(args["actor.adam.betas"]) == [0.9, 0.95]
    assert args["actor.lr_scheduler"] == "cosine_with_min_lr" and args["actor.lr_warmup_ratio"] == 0.1
    for opt in ("--rollout.top_p", "--actor.adam.betas", "--actor.lr_scheduler", "--actor.lr_warmup_ratio"):
        assert argv.count(opt) == 1, opt  # the user's value replaced TRACE's


def test_every_trace_flag_has_one_honest_rule():
    """Each flag TRACE sets is user-settable, derived from a real config key or launch option, or fixed with a
    reason; none is also in UNSUPPORTED."""
    import re

    from trace.integrations.openrlhf.flags import FIXED, SOURCE, UNSUPPORTED, USER_SETTABLE, flag_groups
    from trace.integrations.openrlhf.launch import openrlhf_dest_of
    dest_of = openrlhf_dest_of()
    argvs = [ppo_flags(_cfg("rl.kl_coef=0.01"), model_path="m", prompts="p", out="o", reward_file="r.py", gpus=2),
             ppo_flags(_cfg("wandb.mode=offline"), model_path="m", prompts="p", out="o", agent_file="a.py")]
    dests = {dest_of(o) for argv in argvs for o, _ in flag_groups(argv)}
    for d in dests:
        assert sum(d in t for t in (USER_SETTABLE, SOURCE, FIXED)) == 1, d
    assert not dests & set(UNSUPPORTED)
    from trace.integrations.openrlhf.launch import JSONL_KEYS
    for where in SOURCE.values():  # every config key named exists in the run config (or launch's task data keys)
        if where.startswith("launch "):
            continue
        for key in re.findall(r"[a-z_]+(?:\.[a-z_]+)*", where.replace(" x ", " ")):
            if key.startswith("task.") and key[5:] in JSONL_KEYS:
                continue
            node = C.DEFAULTS
            for part in key.split("."):
                assert isinstance(node, dict) and part in node, (where, key)
                node = node[part]


def test_prompt_length_follows_data_max_len(tmp_path, capsys):
    """--data.max_len replaces TRACE's budget; one that would cut a prompt's <bos> is refused in one line."""
    _, args, _ = _launch(tmp_path / "a", "--gpus", 0)
    default = args["data.max_len"]
    rc, args, argv = _launch(tmp_path / "b", "--gpus", 0, "--", "--data.max_len", 4096)
    assert rc == 0 and args["data.max_len"] == 4096 and argv.count("--data.max_len") == 1
    rc, _, _ = _launch(tmp_path / "c", "--gpus", 0, "--", "--data.max_len", default - 2)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "<bos>" in err[0] and f"--data.max_len {default - 1} or more" in err[0], err
