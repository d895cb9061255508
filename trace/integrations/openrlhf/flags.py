"""Our run config (model, task, arm, seed) -> OpenRLHF 0.11.2 `train_ppo_ray` flags (dotted names).

    argv = ppo_flags(cfg, model_path="runs/x/init_model", prompts="runs/x/data/train.jsonl",
                     out="runs/x", reward_file=REWARD_FILE, agent_file=AGENT_FILE, gpus=0)

The arm's `trace.guidance.Method` decides what runs where (an arm whose trainer log-probs come from the rollout
engine, the exact arm, is refused); this module only translates the
shared RL hyper-parameters into OpenRLHF's names, so both trainers optimise the same objective:
- estimator: rl.advantage (group_norm / reinforce_baseline / rloo) -> --algo.advantage.estimator,
  rl.group_size -> --rollout.n_samples_per_prompt;
- rollout/train mismatch correction through OpenRLHF's own is_correction options: TIS weight
  min(r, tis_cap) = token level, clip into [0, tis_cap]; ICEPOP [lo, hi] = token level, mask;
- KL to the initial policy as a loss (k3) when rl.kl_coef > 0, else no reference model;
- one optimizer step per rollout step (train batch = prompts_per_step * group_size), constant lr,
  AdamW betas (0.9, 0.99) and gradient clipping as our trainer;
- sdpa attention, no sample packing (packing needs flash-attn), ZeRO stage 3 by default;
- the run config's `wandb:` section -> OpenRLHF's own wandb logger (`wandb_flags`, `wandb_env`);
- the reward: the task's verifier (reward.py) by `--reward.remote_url`, OpenRLHF's reward-file flag, which the
  user's own file or server URL replaces (single-turn tasks; multi-turn ones are rewarded by agent.py's env).
OpenRLHF's decoupled PPO ratio (old policy = the trainer's own log-prob) is rl.ppo_ratio="trainer";
"rollout" has no OpenRLHF equivalent and is refused. TRACE's own settings (method, rho, align_coef,
fmt) are not OpenRLHF flags: the plugin reads them from the run dir's config.yaml.

The user's own flags (`launch ... -- FLAGS`) join TRACE's through `merge_user_flags`, compared by
OpenRLHF's own argparse destinations (aliases and abbreviations included). Each TRACE flag is in one table:
- `USER_SETTABLE`: TRACE only defaults it; the user's value replaces TRACE's;
- `SOURCE`: derived from a run config key or a launch option; refused, naming where to change it;
- `FIXED`: what TRACE's trainer or engine needs; refused, saying why (also where TRACE leaves it out).
A flag TRACE does not set is appended as given, unless it is in `UNSUPPORTED` (an OpenRLHF feature the
TRACE engine or the QAT patch cannot honour: refused, saying why). Every refusal is one line (`FlagConflict`). `--ckpt.load_enable` is always on: a rerun of the same command loads OpenRLHF's
DeepSpeed checkpoint (`--ckpt.path`), and the policy actor continues the metrics log from its step.
Compared against: OpenRLHF's own argument parser (tests/integrations/openrlhf/test_flags.py parses
every arm's flags with `openrlhf.cli.train_ppo_ray`'s parser and its validation).
"""
from __future__ import annotations

import hashlib
import os

from trace.guidance import Method
from trace.settings import TaskSettings

MODULE = "openrlhf.cli.train_ppo_ray"


class UnsupportedConfig(ValueError):
    """A config value that OpenRLHF cannot express."""


class FlagConflict(ValueError):
    """A user's train_ppo_ray flag that TRACE sets itself (the message is one line)."""


# flags TRACE sets only as a default: the user's value (after `launch --`) replaces TRACE's
USER_SETTABLE = {
    "train.micro_batch_size": "training micro-batch per GPU (TRACE: the whole per-rank batch)",
    "rollout.micro_batch_size": "old-log-prob forward micro-batch per GPU (TRACE: the whole per-rank batch)",
    "vllm.num_engines": "rollout engine actors (TRACE: one per actor GPU)",
    "rollout.top_p": "nucleus sampling of the rollouts (TRACE: 1.0, the full distribution, as the embedded trainer)",
    "actor.adam.betas": "AdamW betas (TRACE: 0.9 0.99, the embedded trainer's)",
    "actor.lr_scheduler": "learning-rate schedule (TRACE: constant, the embedded trainer's)",
    "actor.lr_warmup_ratio": "warm-up fraction of the schedule (TRACE: 0.0)",
    "data.max_len": "prompt + response tokens (TRACE: the longest synthetic prompt, else 1024, + rl.max_new_tokens "
    "per turn); launch refuses one too short for the longest prompt it knows",
    "reward.remote_url": "the reward of a single-turn task: a Python file defining reward_func(queries, prompts, "
    "labels) or reward server URL(s), OpenRLHF's convention (TRACE: the task's verifier, "
    "trace/integrations/openrlhf/reward.py); launch checks the file before the run",
}
# where a flag TRACE derives comes from (a run config key or a launch option): FlagConflict says to change it there
SOURCE = {
    "actor.model_name_or_path": "rl.init_ckpt", "train.seed": "seed", "actor.adam.lr": "rl.lr",
    "actor.adam.weight_decay": "rl.weight_decay", "actor.max_norm": "rl.grad_clip", "actor.eps_clip": "rl.clip_eps",
    "rollout.n_samples_per_prompt": "rl.group_size", "rollout.batch_size": "rl.prompts_per_step",
    "train.batch_size": "rl.prompts_per_step x rl.group_size", "rollout.max_new_tokens": "rl.max_new_tokens",
    "rollout.temperature": "rl.temperature", "algo.advantage.estimator": "rl.advantage",
    "data.max_samples": "rl.steps x rl.prompts_per_step", "ckpt.save_steps": "rl.ckpt_every",
    "algo.kl.init_coef": "rl.kl_coef", "algo.advantage.is_correction_level": "rl.tis_cap / rl.icepop",
    "algo.advantage.is_correction_mode": "rl.tis_cap / rl.icepop",
    "algo.advantage.is_correction_threshold": "rl.tis_cap / rl.icepop",
    "ds.zero_stage": "launch --zero-stage", "train.colocate_all": "launch --colocate",
    "actor.num_gpus_per_node": "launch --gpus / --ranks", "ref.num_gpus_per_node": "launch --gpus / --ranks",
    "ckpt.path": "launch --out", "ckpt.output_dir": "launch --out", "data.prompt_dataset": "task.train_jsonl",
    "data.input_key": "task.prompt_key", "data.label_key": "task.label_key",
    "algo.kl.use_loss": "rl.kl_coef", "algo.kl.estimator": "rl.kl_coef",
    "vllm.sync_backend": "launch --colocate / --gpus", "train.agent_func_path": "task.name",
    "logger.wandb.project": "wandb.project", "logger.wandb.run_name": "wandb.name",
}
# flags TRACE fixes: FlagConflict says why they cannot change
FIXED = {
    "vllm.tensor_parallel_size": "the TRACE engine runs one engine per GPU (tensor parallel size 1)",
    "actor.num_nodes": "launch runs on one node, in the Ray instance it starts", "ref.num_nodes": "launch runs on one "
    "node, in the Ray instance it starts",
    "ckpt.load_enable": "it is always on, so that a rerun of the command resumes",
    "ckpt.save_hf": "every checkpoint keeps an HF copy (ckpt/deepspeed/global_stepN_hf), pruned to --ckpt.max_num "
    "like the DeepSpeed checkpoints (trace/integrations/openrlhf/checkpoints.py)",
    "ds.attn_implementation": "the QAT patch runs attention (FP4 KV included) through sdpa (trace.qat.patch_model)",
    "ds.param_dtype": "OpenRLHF trains in BF16 as TRACE's QAT does (rl.autocast: bf16)",
    "train.max_epochs": "one optimizer step per rollout step, as the embedded trainer",
    "train.num_episodes": "the prompt file holds every step's prompts (rl.steps x rl.prompts_per_step)",
    "logger.logging_steps": "metrics.jsonl has one line per step",
    "logger.wandb.key": "TRACE turns OpenRLHF's wandb logger on from the run config (wandb.mode offline or online), "
    "and wandb reads its API key from the environment (WANDB_API_KEY or `wandb login`), not from the command line "
    "that the run dir records",
}
# OpenRLHF features the TRACE engine or the QAT patch cannot honour: refused when the user passes them
UNSUPPORTED = {
    "vllm.enable_sleep": "the TRACE engine has no sleep / wake_up (it frees no memory between rollouts)",
    "train.async_enable": "the TRACE engine has no pause / resume of generation, and each step's records must come "
    "from the weights the trainer replays them on",
    "train.partial_rollout_enable": "partial rollouts need the engine's pause / resume (async), which the TRACE "
    "engine has not",
    "vllm.gpu_memory_utilization": "the TRACE engine allocates its KV cache per call; it has no memory pool to size",
    "vllm.enforce_eager": "the TRACE engine has no vLLM CUDA graphs to disable",
    "vllm.enable_prefix_caching": "the TRACE engine has no prefix cache",
    "eval.dataset": "OpenRLHF's evaluation is not used; TRACE evaluates the held-out split every rl.eval_every steps "
    "(run config keys rl.eval_every, eval.split)",
    "ds.packing_samples": "packing needs flash attention, and the QAT patch runs attention through sdpa",
}
# a key that only switches OpenRLHF's wandb logger on: OpenRLHF creates its WandbLogger when --logger.wandb.key is
# set and calls wandb.login(key=...) only without credentials in the environment, which offline mode skips
# (openrlhf/utils/logging_utils.py WandbLogger, openrlhf/trainer/ppo_trainer.py; wandb/sdk/wandb_login.py)
WANDB_KEY_SWITCH = "from-environment"


def flag_groups(argv: list[str]) -> list[tuple[str, list[str]]]:
    """[(option string, the tokens of that flag: option and values)] of an argv of `--name [values]` flags
    (`--name=value` kept as one token)."""
    groups: list[tuple[str, list[str]]] = []
    for tok in argv:
        if tok.startswith("--"):
            groups.append((tok.split("=", 1)[0], [tok]))
        elif not groups:
            raise FlagConflict(f"train_ppo_ray flags must start with an option, got {tok!r}")
        else:
            groups[-1][1].append(tok)
    return groups


def merge_user_flags(trace_argv: list[str], user_argv: list[str], dest_of, engine: str = "trace") -> list[str]:
    """TRACE's argv with the user's flags: a flag TRACE sets raises FlagConflict unless it is in
    USER_SETTABLE (then the user's replaces TRACE's); one in FIXED raises it whether TRACE sets it or not; one
    in UNSUPPORTED raises it with the TRACE engine (engine "vllm": OpenRLHF's engines honour the vllm.* ones);
    --reward.remote_url raises it for a multi-turn task (agent file); any other is appended.
    dest_of(option) -> the argparse destination in OpenRLHF's parser (KeyError: no such flag)."""
    def dest(opt):
        try:
            return dest_of(opt)
        except KeyError:
            raise FlagConflict(f"{opt} is not a flag of OpenRLHF's train_ppo_ray") from None

    mine = [(dest(o), toks) for o, toks in flag_groups(trace_argv)]
    theirs = [(dest(o), o, toks) for o, toks in flag_groups(user_argv)]
    owned = {d for d, _ in mine}
    for d, opt, _ in theirs:
        if d == "reward.remote_url" and "train.agent_func_path" in owned:
            # OpenRLHF replaces the reward URL by "agent" whenever an agent file is given (train_ppo_ray.py)
            raise FlagConflict(f"train_ppo_ray flag {opt}: a multi-turn task is rewarded by its environment "
                               "(trace/integrations/openrlhf/agent.py); a reward file or URL applies to single-turn "
                               "tasks")
        if d in owned and d in SOURCE:
            raise FlagConflict(f"train_ppo_ray flag {opt} is set by TRACE (from {SOURCE[d]}); change it there, "
                               "not after `--`")
        if d in owned and d not in USER_SETTABLE:
            raise FlagConflict(f"train_ppo_ray flag {opt} is fixed by TRACE: {FIXED.get(d, 'TRACE sets it')}")
        if d in FIXED:  # also where TRACE leaves it out (logger.wandb.key with wandb off)
            raise FlagConflict(f"train_ppo_ray flag {opt} is fixed by TRACE: {FIXED[d]}")
        if d in UNSUPPORTED and not (engine == "vllm" and d.startswith("vllm.")):
            raise FlagConflict(f"train_ppo_ray flag {opt} is not supported: {UNSUPPORTED[d]}")
    replaced = {d for d, _, _ in theirs}
    out = [t for d, toks in mine if d not in replaced for t in toks]
    return out + [t for _, _, toks in theirs for t in toks]


def flag_value(argv: list[str], dest: str, dest_of) -> str | None:
    """The value of the last flag in argv whose argparse destination is `dest` (None: not there)."""
    value = None
    for opt, toks in flag_groups(argv):
        if dest_of(opt) == dest:
            value = toks[0].split("=", 1)[1] if "=" in toks[0] else (toks[1] if len(toks) > 1 else None)
    return value


def _num(x) -> str:
    return repr(float(x)) if isinstance(x, float) else str(x)


def is_correction_flags(rl: dict) -> list[str]:
    """TIS / ICEPOP as OpenRLHF's token-level is_correction options (see the cross-check test of
    trace/rl/losses.py for the equality of the two losses)."""
    if rl.get("icepop") is not None:
        lo, hi = rl["icepop"]
        return ["--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_mode", "mask",
                "--algo.advantage.is_correction_threshold", _num(lo), _num(hi)]
    if rl.get("tis_cap") is not None:
        return ["--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_mode", "clip",
                "--algo.advantage.is_correction_threshold", "0.0", _num(rl["tis_cap"])]
    return ["--algo.advantage.is_correction_level", "off"]


def wandb_on(cfg: dict) -> bool:
    """Whether the run config turns wandb on (wandb.mode offline or online)."""
    return cfg["wandb"]["mode"] != "disabled"


def wandb_flags(cfg: dict, out: str) -> list[str]:
    """The run config's `wandb:` section as OpenRLHF 0.11.2's --logger.wandb.* flags (openrlhf/cli/train_ppo_ray.py:
    key, org, group, project, run_name); none when wandb.mode is disabled. The key only switches OpenRLHF's logger
    on (WANDB_KEY_SWITCH); the mode and the directory go through the environment (`wandb_env`), as OpenRLHF's
    `wandb.init` takes neither. run_name: wandb.name, else the run dir's name, as the embedded trainer's."""
    if not wandb_on(cfg):
        return []
    w = cfg["wandb"]
    return ["--logger.wandb.key", WANDB_KEY_SWITCH, "--logger.wandb.project", str(w.get("project") or "trace-fp4-rl"),
            "--logger.wandb.run_name", str(w.get("name") or os.path.basename(os.path.normpath(out)))]


def wandb_env(cfg: dict, out: str) -> dict[str, str]:
    """The environment of OpenRLHF's wandb run (its PPOTrainer actor): the config's mode (offline unless the
    config says online), the run dir as its directory (RUN_DIR/wandb/offline-run-*, as the embedded trainer's),
    and a run id fixed by the run dir with resume allowed, so a resumed run continues its wandb run. {} when off."""
    if not wandb_on(cfg):
        return {}
    run_id = hashlib.sha256(os.path.abspath(out).encode()).hexdigest()[:16]
    return {"WANDB_MODE": cfg["wandb"]["mode"], "WANDB_DIR": os.path.abspath(out), "WANDB_RUN_ID": run_id,
            "WANDB_RESUME": "allow"}


def ppo_flags(cfg: dict, *, model_path: str, prompts: str, out: str, reward_file: str | None = None,
              agent_file: str | None = None, gpus: int = 0, colocate: bool | None = None,
              zero_stage: int = 3, sync: str | None = None, label_key: str = TaskSettings.label_key,
              input_key: str = "input", max_prompt_len: int | None = None, ranks: int | None = None) -> list[str]:
    """The argv (after `python -m openrlhf.cli.train_ppo_ray`) for one RL run.

    gpus: GPUs per node for the actor (0 on a CPU machine: Ray is given logical GPUs by the launcher).
    ranks: actor ranks (DeepSpeed's data-parallel world size) on a CPU machine, one logical GPU each (default 1); on
    GPUs the ranks are the GPUs. sync: weight-sync backend, "nccl" (GPU; CUDA IPC when colocated) or "gloo"
    (CPU; a torch gloo group between trainer rank 0 and the engines)."""
    rl = cfg["rl"]
    if Method.from_config(rl).logprobs_from_engine:
        raise UnsupportedConfig("rl.method=exact: its trainer log-probs come from the rollout engine's batch-invariant "
                                "kernels, which OpenRLHF's experience maker does not call; run it with python -m trace.rl")
    if rl["ppo_ratio"] != "trainer":
        raise UnsupportedConfig("rl.ppo_ratio: OpenRLHF uses the trainer's own log-probs as the old policy "
                                "(ppo_ratio=trainer); 'rollout' cannot be expressed")
    if rl["autocast"] != "bf16":
        raise UnsupportedConfig("rl.autocast: OpenRLHF trains in BF16 (--ds.param_dtype bf16); 'none' cannot be expressed")
    if (reward_file is None) == (agent_file is None):
        raise ValueError("pass exactly one of reward_file (single turn) and agent_file (multi-turn)")
    if ranks is not None and gpus > 0 and ranks != gpus:
        raise UnsupportedConfig(f"on GPUs the actor ranks are the GPUs (--gpus {gpus}); --ranks {ranks} is for a CPU "
                                "machine")
    n_actor = int(gpus) if gpus > 0 else int(ranks or 1)
    if n_actor < 1:
        raise UnsupportedConfig(f"need at least one actor rank, got {n_actor}")
    if colocate is None:
        colocate = gpus > 0
    sync = sync or ("nccl" if gpus > 0 else "gloo")
    samples = rl["prompts_per_step"] * rl["group_size"]
    if samples % n_actor:
        raise UnsupportedConfig(f"prompts_per_step * group_size = {samples} must be divisible by the "
                                f"{n_actor} actor ranks")
    turns = rl["max_turns"] if agent_file is not None else 1
    max_len = (max_prompt_len or 256) + rl["max_new_tokens"] * turns
    argv = [
        "--actor.model_name_or_path", model_path,
        "--actor.num_nodes", "1", "--actor.num_gpus_per_node", str(n_actor),
        "--ref.num_nodes", "1", "--ref.num_gpus_per_node", str(n_actor),
        "--vllm.num_engines", str(n_actor), "--vllm.tensor_parallel_size", "1",
        "--vllm.sync_backend", sync,
        "--data.prompt_dataset", prompts, "--data.input_key", input_key, "--data.label_key", label_key,
        "--data.max_len", str(max_len), "--data.max_samples", str(rl["steps"] * rl["prompts_per_step"]),
        "--rollout.batch_size", str(rl["prompts_per_step"]),
        "--rollout.n_samples_per_prompt", str(rl["group_size"]),
        "--rollout.max_new_tokens", str(rl["max_new_tokens"]),
        "--rollout.temperature", _num(rl["temperature"]), "--rollout.top_p", "1.0",
        "--rollout.micro_batch_size", str(max(1, samples // n_actor)),
        "--train.batch_size", str(samples), "--train.micro_batch_size", str(max(1, samples // n_actor)),
        "--train.max_epochs", "1", "--train.num_episodes", "1", "--train.seed", str(cfg["seed"]),
        "--algo.advantage.estimator", rl["advantage"],
        "--actor.eps_clip", _num(rl["clip_eps"]),
        "--actor.adam.lr", _num(rl["lr"]), "--actor.adam.betas", "0.9", "0.99",
        "--actor.adam.weight_decay", _num(rl["weight_decay"]), "--actor.max_norm", _num(rl["grad_clip"]),
        "--actor.lr_scheduler", "constant", "--actor.lr_warmup_ratio", "0.0",
        "--ds.zero_stage", str(zero_stage), "--ds.param_dtype", "bf16",
        "--ds.attn_implementation", "sdpa",
        "--ckpt.output_dir", os.path.join(out, "ckpt", f"step_{rl['steps']:06d}"),
        "--ckpt.path", os.path.join(out, "ckpt", "deepspeed"),
        "--ckpt.save_steps", str(rl["ckpt_every"]), "--ckpt.save_hf",
        "--ckpt.load_enable",  # a rerun of the command resumes from the DeepSpeed checkpoint under ckpt.path
        "--logger.logging_steps", "1",
    ]
    argv += wandb_flags(cfg, out)
    argv += is_correction_flags(rl)
    if rl["kl_coef"] > 0:
        argv += ["--algo.kl.use_loss", "--algo.kl.estimator", "k3", "--algo.kl.init_coef", _num(rl["kl_coef"])]
    else:
        argv += ["--algo.kl.init_coef", "0.0"]
    if colocate:
        argv += ["--train.colocate_all"]
    if agent_file is not None:
        argv += ["--train.agent_func_path", agent_file]
    else:
        argv += ["--reward.remote_url", reward_file]
    return argv


__all__ = ["FIXED", "MODULE", "SOURCE", "UNSUPPORTED", "USER_SETTABLE", "WANDB_KEY_SWITCH", "FlagConflict",
           "UnsupportedConfig", "flag_groups", "flag_value", "is_correction_flags", "merge_user_flags", "ppo_flags",
           "wandb_env", "wandb_flags", "wandb_on"]
