"""`python -m trace.integrations.openrlhf.launch --config CFG.yaml --out RUN_DIR`: one RL run through OpenRLHF.

What it does (stage rl, the default):
1. resolves our run config (model, task, arm, seed; `--set key=value` overrides) and writes the run dir
   exactly like `python -m trace.rl`: config.yaml, meta.json (kind "rl-openrlhf", plus the OpenRLHF
   command), metrics.jsonl (one line per step, the embedded trainer's metric names, written by the
   policy actor's rank 0), ckpt/step_XXXXXX (HF checkpoint) + ckpt/latest, and `done` at the end;
2. the policy: `rl.init_ckpt` when set, the hub id of a paper-flavor model, else the registry model
   built with the run's seed and saved to RUN_DIR/init_model;
3. the prompts: a config whose `task` carries `train_jsonl` (+ `prompt_key`, `label_key`; what the
   paper profile's DAG writes) trains on that file; otherwise the synthetic task's prompts, drawn per
   step like the embedded trainer, go to RUN_DIR/data/train.jsonl;
4. builds the `train_ppo_ray` argv (flags.py; saved in RUN_DIR/openrlhf_argv.json), starts Ray with a
   runtime env whose `worker_process_setup_hook` loads the plugin in every process (plugin.py), puts
   our engine actors (rollout.py) in place of `create_vllm_engines` and our policy actor (actor.py) in
   place of `PolicyModelActor`, and runs OpenRLHF's own `train_ppo_ray` main in this process.
Before step 1 `check_hooks` verifies the OpenRLHF version and that every name it patches is still
there and used (the tables `all_hooks()`, guards.py); a miss prints `error: <one line>` and exits 2.
The user's `train_ppo_ray` flags follow `--` (`launch --config C --out D -- --actor.gradient_checkpointing_enable`):
they are checked against TRACE's own with OpenRLHF's parser (`openrlhf_dest_of`, flags.merge_user_flags)
before anything is written. `--colocate all|none` picks OpenRLHF's colocated mode or engines on GPUs of
their own. A rerun of the same command resumes (`--ckpt.load_enable`; the policy actor continues the
metrics log from the DeepSpeed checkpoint's step); a run with `done` is left alone.
On a machine without GPUs Ray is given logical GPUs for OpenRLHF's placement and the CPU shim of
plugin.py handles OpenRLHF's CUDA calls; DeepSpeed runs on its CPU accelerator (gloo).
`--dry-run` checks the same and prints the `train_ppo_ray` command and OpenRLHF's parsed arguments as one
JSON object on stdout ({"command": [...], "args": {dotted name: value}}), writing nothing. Every refusal is
one line, `error: ...` on stderr, exit status 2 (`LaunchError` and the config / flag / hook errors).
The run config's `wandb:` section turns on OpenRLHF's own wandb logger (flags.wandb_flags; offline unless it says
online, the run under RUN_DIR/wandb); metrics.jsonl stays what the tables read. The reward of a single-turn task is
its verifier (reward.py) unless the user's `-- --reward.remote_url FILE.py|URL` replaces it (`check_reward`); a
user's file is recorded in meta.json (`reward_file`: its path and sha256), and a resumed run must bring the same bytes.
Stages sft and eval run our own entry points (`trace.sft`, `trace.eval`), which read the HF checkpoints
this stage leaves.
Compared against: `python -m trace.rl` on the same config (tests/integrations/openrlhf/).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import json
import netrc
import os
import runpy
import subprocess
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlparse

import torch
import yaml

from trace.integrations.openrlhf import guards, stand_ins

stand_ins.install()  # before OpenRLHF's modules import vLLM / flash-attn names

try:  # an untested OpenRLHF, or a hook target gone upstream: one line, exit 2 (guards.py)
    guards.check_openrlhf_version()
    import openrlhf.cli.train_ppo_ray as orl_main  # noqa: E402
    import openrlhf.trainer.ray as orl_ray  # noqa: E402
    import openrlhf.trainer.ray.ppo_actor as orl_actor  # noqa: E402
    import openrlhf.utils.config as orl_config  # noqa: E402
    import ray  # noqa: E402

    from trace.integrations.openrlhf import actor as trace_actor  # noqa: E402
    from trace.integrations.openrlhf.actor import TracePolicyActor  # noqa: E402
    from trace.integrations.openrlhf.rollout import create_engines  # noqa: E402
except guards.HookError as _e:
    if __name__ != "__main__":
        raise
    print(f"error: {_e}", file=sys.stderr)
    sys.exit(2)

from trace import config as C  # noqa: E402
from trace import rundir  # noqa: E402
from trace.episode import build_task  # noqa: E402
from trace.integrations.openrlhf import flags as F  # noqa: E402
from trace.integrations.openrlhf import plugin  # noqa: E402
from trace.models import build_model, build_tokenizer, get_spec, save_checkpoint  # noqa: E402

PKG_DIR = Path(__file__).resolve().parent
REPO_ROOT = PKG_DIR.parents[2]
REWARD_FILE = PKG_DIR / "reward.py"
AGENT_FILE = PKG_DIR / "agent.py"
MULTI_TURN_TASKS = ("long_horizon",)
JSONL_KEYS = ("train_jsonl", "test_jsonl", "prompt_key", "label_key")


class LaunchError(Exception):
    """A launch refused before OpenRLHF runs; main prints its one-line message and exits 2."""


def check_init_ckpt(cfg: dict) -> None:
    """ConfigError unless the model and `rl.init_ckpt` (when set) are usable (rundir.check_inputs, reads
    only); a path that does not exist names the SFT run that makes it."""
    init = cfg["rl"]["init_ckpt"]
    try:
        rundir.check_inputs(cfg, {"rl.init_ckpt": init})
    except C.ConfigError as e:
        if init and not Path(init).exists():
            raise C.ConfigError(f"{e}; train the SFT base first (`python -m trace.sft --config SFT.yaml --out {init}`, "
                                "README 'OpenRLHF') or --set rl.init_ckpt=null for a random initial policy") from None
        raise


def prepare_model(cfg: dict, out: Path, write: bool = True) -> str:
    """Path (or hub id) of the initial policy, loadable by AutoModelForCausalLM / AutoTokenizer; a registry
    model is saved to out/init_model (write=False: only its path)."""
    if cfg["rl"]["init_ckpt"]:
        return str(rundir.resolve_checkpoint(cfg["rl"]["init_ckpt"]).resolve())
    spec = get_spec(cfg["model"])
    if spec.hub_id:
        return spec.hub_id
    d = out / "init_model"
    if write and not (d / "config.json").exists():
        save_checkpoint(build_model(cfg["model"], seed=cfg["seed"]), build_tokenizer(), d)
    return str(d.resolve())


def synthetic_prompts(cfg: dict) -> list[dict]:
    """Prompts of every step, drawn like `RLTrainer._prompts_for` (OpenRLHF then shuffles them)."""
    rl, t = cfg["rl"], cfg["task"]
    task = build_task(cfg)
    train = task.make_split("train", t["n_train"], t["seed"])
    rows = []
    for step in range(1, rl["steps"] + 1):
        g = torch.Generator().manual_seed(cfg["seed"] * 1_000_003 + 7919 * step + 17)
        for i in torch.randperm(len(train), generator=g)[: rl["prompts_per_step"]].tolist():
            rows.append({"input": train[i].prompt, "label": train[i].label, "datasource": task.name})
    return rows


def load_run_config(path: str, sets: list[str]) -> tuple[dict, dict]:
    """Our run config plus the JSONL data keys a profile may put under `task` (the paper profile:
    train_jsonl, test_jsonl, prompt_key, label_key), which the trainers' schema does not have."""
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise C.ConfigError(f"config file {path}: {' '.join(str(e).split())}") from None
    if not isinstance(raw, dict):
        raise C.ConfigError(f"config file {path}: top level must be a mapping")
    task = raw.get("task") or {}
    data = {k: task.pop(k) for k in JSONL_KEYS if k in task}
    return C.load_config(None, sets, base=raw), data


def prepare_prompts(cfg: dict, out: Path, data: dict, write: bool = True) -> tuple[str, str, str, int | None]:
    """(jsonl path, input key, label key, longest prompt in characters or None when unknown); the synthetic
    prompts go to out/data/train.jsonl (write=False: only its path)."""
    if data.get("train_jsonl"):
        keys = C.DEFAULTS["task"]
        return (data["train_jsonl"], data.get("prompt_key", keys["prompt_key"]), data.get("label_key", keys["label_key"]),
                None)
    rows = synthetic_prompts(cfg)
    path = out / "data" / "train.jsonl"
    if write:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path.resolve()), "input", "label", max(len(r["input"]) for r in rows)


def build_argv(cfg: dict, out: Path, model_path: str, data: dict, gpus: int, zero_stage: int = 3,
               colocate: bool | None = None, prompts: tuple | None = None, ranks: int | None = None) -> list[str]:
    """TRACE's train_ppo_ray argv; `prompts` (prepare_prompts' answer) given: nothing is written."""
    prompts, input_key, label_key, longest = prompts or prepare_prompts(cfg, out, data)
    multi = cfg["task"]["name"] in MULTI_TURN_TASKS
    # the engine prepends <bos> to every prompt (as SFT and the embedded trainer encode it): one token more
    return F.ppo_flags(cfg, model_path=model_path, prompts=prompts, out=str(out.resolve()),
                       reward_file=None if multi else str(REWARD_FILE),
                       agent_file=str(AGENT_FILE) if multi else None, gpus=gpus, input_key=input_key,
                       label_key=label_key, max_prompt_len=(longest + 2) if longest else 1024,
                       zero_stage=zero_stage, colocate=colocate, ranks=ranks)


def exec_train_ppo_ray() -> None:
    """Run train_ppo_ray's `__main__` block (its parser lives there) with sys.argv as set. run_path re-runs
    the file launch already imported, in a fresh namespace, so its module-level imports pick up the names
    launch replaced; run_module would warn that the module is in sys.modules already."""
    runpy.run_path(orl_main.__file__, run_name="__main__")


def check_prompt_room(cfg: dict, argv: list[str], longest: int | None, dest_of) -> None:
    """LaunchError when the longest prompt (`longest` characters, + <bos>; None: unknown) and rl.max_new_tokens
    do not fit --data.max_len: OpenRLHF's executors would left-truncate the prompt and drop its <bos>."""
    max_len = int(F.flag_value(argv, "data.max_len", dest_of))
    need = longest + 1 + cfg["rl"]["max_new_tokens"] if longest else 0
    if need > max_len:
        raise LaunchError(f"--data.max_len {max_len} leaves no room for the longest prompt ({longest + 1} tokens with "
                          f"<bos>) and rl.max_new_tokens {cfg['rl']['max_new_tokens']}: OpenRLHF would cut the "
                          f"prompt's start, <bos> included; pass --data.max_len {need} or more")


def _binds_reward_func(path: Path) -> bool:
    """Whether the Python file binds `reward_func` at its top level (def, import or assignment), read without
    running it."""
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, ast.FunctionDef) and node.name == "reward_func":
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                (a.asname or a.name) == "reward_func" for a in node.names):
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "reward_func" for t in targets):
                return True
    return False


def check_reward(argv: list[str], dest_of) -> list[str]:
    """argv with --reward.remote_url checked, a file made absolute (the engines import it in Ray workers whose
    working directory is not the caller's); LaunchError in one line otherwise. OpenRLHF 0.11.2 takes one Python
    file defining `reward_func(queries, prompts, labels)` (loaded by path when the first entry ends in .py) or
    comma-separated reward server URLs (openrlhf/utils/agent.py SingleTurnAgentExecutor)."""
    value = F.flag_value(argv, "reward.remote_url", dest_of)
    if value is None or value == str(REWARD_FILE):
        return argv
    entries = value.split(",")
    if any(e.endswith(".py") for e in entries):
        path = Path(value)
        if len(entries) > 1:
            raise LaunchError(f"--reward.remote_url {value}: OpenRLHF takes one reward file (*.py) or reward server "
                              "URLs, not both")
        if not path.is_file():
            raise LaunchError(f"--reward.remote_url {value}: no such file")
        try:
            ok = _binds_reward_func(path)
        except (SyntaxError, UnicodeDecodeError) as e:
            raise LaunchError(f"--reward.remote_url {value}: not valid Python ({' '.join(str(e).split())})") from None
        if not ok:
            raise LaunchError(f"--reward.remote_url {value}: defines no reward_func(queries, prompts, labels), the "
                              "function OpenRLHF calls")
        resolved = str(path.resolve())
    else:
        bad = [e for e in entries if urlparse(e).scheme not in ("http", "https") or not urlparse(e).netloc]
        if bad:
            raise LaunchError(f"--reward.remote_url {bad[0]}: neither a Python reward file (*.py) nor an http(s) URL")
        resolved = value
    out = []
    for opt, toks in F.flag_groups(argv):
        if dest_of(opt) == "reward.remote_url":
            toks = [f"{opt}={resolved}"] if "=" in toks[0] else [opt, resolved]
        out += toks
    return out


def user_reward_file(argv: list[str], dest_of) -> dict | None:
    """{"path", "sha256"} of the user's reward file that --reward.remote_url names in a checked argv
    (`check_reward`: absolute), for meta.json; None for the task's verifier (reward.py) or reward server URLs."""
    value = F.flag_value(argv, "reward.remote_url", dest_of)
    if value is None or value == str(REWARD_FILE) or not value.endswith(".py"):
        return None
    return {"path": value, "sha256": hashlib.sha256(Path(value).read_bytes()).hexdigest()}


def wandb_credentials() -> bool:
    """Whether wandb finds an API key without asking: $WANDB_API_KEY, or the netrc entry `wandb login` writes for
    $WANDB_BASE_URL's host (default api.wandb.ai)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def check_wandb(cfg: dict) -> None:
    """LaunchError when wandb.mode is online without credentials: OpenRLHF's logger would fail inside its trainer
    actor, after the run has started (offline mode needs none)."""
    if cfg["wandb"]["mode"] == "online" and not wandb_credentials():
        raise LaunchError("wandb.mode online needs W&B credentials in the environment (WANDB_API_KEY or `wandb login`); "
                          "or set wandb.mode offline")


def _run_openrlhf_main(argv: list[str], capture) -> None:
    """Run OpenRLHF's train_ppo_ray main with `capture(parser_or_args)` intercepting it (no training):
    `capture` gets the ArgumentParser at parse_args and then OpenRLHF's hierarchical args."""

    class _Parsed(Exception):
        pass

    real_parse, real_h, old_argv, old_init = argparse.ArgumentParser.parse_args, orl_config.hierarchize, sys.argv, \
        ray.is_initialized

    def parse(parser, *a, **k):
        if capture(parser) is False:
            raise _Parsed
        return real_parse(parser, *a, **k)

    def hier(args):
        out = real_h(args)
        capture(out)
        return out

    def stop(*_a, **_k):
        raise _Parsed

    sys.argv, orl_config.hierarchize, ray.is_initialized = [F.MODULE, *argv], hier, stop
    argparse.ArgumentParser.parse_args = parse
    try:
        exec_train_ppo_ray()
    except _Parsed:
        pass
    finally:
        sys.argv, orl_config.hierarchize, ray.is_initialized = old_argv, real_h, old_init
        argparse.ArgumentParser.parse_args = real_parse


def parse_with_openrlhf(argv: list[str]):
    """Run OpenRLHF's own parser and validation on argv; returns its hierarchical args (no training)."""
    seen = {}

    def capture(x):
        if not isinstance(x, argparse.ArgumentParser):
            seen["args"] = x

    with contextlib.redirect_stdout(sys.stderr):  # OpenRLHF's validation notes; stdout is the dry run's JSON
        _run_openrlhf_main(argv, capture)
    if "args" not in seen:
        raise RuntimeError("OpenRLHF's train_ppo_ray did not reach argument parsing")
    return seen["args"]


def openrlhf_dest_of():
    """option string -> argparse destination in OpenRLHF's train_ppo_ray parser (unique prefixes too,
    as argparse accepts them); KeyError for a flag it does not have."""
    seen = {}

    def capture(x):
        if isinstance(x, argparse.ArgumentParser):
            seen["parser"] = x
            return False

    _run_openrlhf_main([], capture)
    opts = {o: a.dest for a in seen["parser"]._actions for o in a.option_strings}

    def dest_of(opt: str) -> str:
        if opt in opts:
            return opts[opt]
        hits = {d for o, d in opts.items() if o.startswith(opt) and o.startswith("--")}
        if len(hits) == 1:
            return hits.pop()
        raise KeyError(opt)

    return dest_of


def flat_args(args, prefix: str = "") -> dict:
    """OpenRLHF's hierarchical args as {dotted name: value} (what openrlhf_args.json holds)."""
    out = {}
    for k, v in vars(args).items():
        if isinstance(v, SimpleNamespace):
            out.update(flat_args(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool, type(None), list)) else repr(v)
    return out


CREATE_ENGINES = "openrlhf.trainer.ray.create_vllm_engines"
POLICY_ACTOR = "openrlhf.trainer.ray.ppo_actor.PolicyModelActor"
# what launch replaces before train_ppo_ray runs, and the code that must still take them by name
HOOKS = (
    guards.Hook(orl_main, "train", "openrlhf.cli.train_ppo_ray.train"),
    guards.Hook(orl_ray, "create_vllm_engines", CREATE_ENGINES),
    guards.Hook(orl_actor, "PolicyModelActor", POLICY_ACTOR),
)
USES = (
    guards.Use(orl_main, "train", "create_vllm_engines", CREATE_ENGINES, "openrlhf.cli.train_ppo_ray.train"),
    guards.Use(orl_main, "train", "PolicyModelActor", POLICY_ACTOR, "openrlhf.cli.train_ppo_ray.train"),
)


def all_hooks() -> tuple[tuple, tuple]:
    """(every Hook, every Use) TRACE puts into OpenRLHF: launch's, the policy actor's, the CPU shim's."""
    shim_hooks, shim_uses = plugin.hooks()
    return HOOKS + trace_actor.HOOKS + shim_hooks, USES + trace_actor.USES + shim_uses


def check_hooks() -> None:
    """Start-up check of every hook (guards.py): the OpenRLHF version, every name launch, the policy
    actor and the CPU shim replace or wrap (`all_hooks`), and that the OpenRLHF code meant to use each
    still refers to it. Raises guards.HookError with one line."""
    guards.check_openrlhf_version()
    guards.check_all(*all_hooks())
    if not issubclass(TracePolicyActor, guards.ray_actor_class(orl_actor.PolicyModelActor, POLICY_ACTOR)):
        raise guards.PatchNotInForce(f"TracePolicyActor does not derive from the class under `{POLICY_ACTOR}`")
    trace_actor.check_hooks()


def check_patches(engines, policy) -> None:
    """The replacements of launch are in place (engines None: OpenRLHF's own vLLM engines)."""
    if engines is not None:
        guards.require_patched(orl_ray, "create_vllm_engines", engines, CREATE_ENGINES)
    guards.require_patched(orl_actor, "PolicyModelActor", policy, POLICY_ACTOR)


def run_openrlhf(cfg: dict, argv: list[str], out: Path, gpus: int, engine: str = "trace",
                 zero_persistence: int | None = None, colocate: bool = True, ranks: int = 1) -> None:
    """Start Ray with the plugin in every process and run OpenRLHF's train_ppo_ray main here.
    engine "vllm" keeps OpenRLHF's vLLM engines (only our policy actor replaces OpenRLHF's).
    zero_persistence: DeepSpeed's stage3_param_persistence_threshold for the policy actor (None: OpenRLHF's).
    colocate: the engines share the actors' GPUs (a fifth of one each); else each takes a GPU of its own.
    ranks: actor ranks on a CPU machine (Ray gets logical GPUs for them and the reference model's as many)."""
    os.environ[plugin.RUN_DIR_ENV] = str(out.resolve())
    plugin.setup()
    pypath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env_vars = {plugin.RUN_DIR_ENV: str(out.resolve()), "PYTHONPATH": pypath, "TOKENIZERS_PARALLELISM": "false"}
    if zero_persistence is not None:
        env_vars[plugin.ZERO_PERSISTENCE_ENV] = str(zero_persistence)
    env_vars.update(F.wandb_env(cfg, str(out.resolve())))  # OpenRLHF's wandb logger runs in its PPOTrainer actor
    if gpus == 0:
        # threads per process: several OpenRLHF processes share the CPU cores
        env_vars["OMP_NUM_THREADS"] = str(cfg.get("threads") or 1)
    logical = {} if gpus > 0 else {"num_gpus": max(4, 2 * ranks), "num_cpus": max(8, os.cpu_count() or 1)}
    ray.init(runtime_env={"env_vars": env_vars, "worker_process_setup_hook": f"{plugin.__name__}.setup"},
             include_dashboard=False, **logical)
    old = (orl_ray.create_vllm_engines, orl_actor.PolicyModelActor, sys.argv)
    try:
        engines = None
        if engine == "trace":
            engines = partial(create_engines, cfg=cfg, num_gpus=(0.2 if colocate else 1) if gpus > 0 else 0)
            orl_ray.create_vllm_engines = engines
        policy = ray.remote(num_gpus=1)(TracePolicyActor)
        orl_actor.PolicyModelActor = policy
        check_patches(engines, policy)
        sys.argv = [F.MODULE, *argv]
        exec_train_ppo_ray()
    finally:
        orl_ray.create_vllm_engines, orl_actor.PolicyModelActor, sys.argv = old
        ray.shutdown()


def finish(cfg: dict, out: Path) -> None:
    step_dir = out / "ckpt" / f"step_{cfg['rl']['steps']:06d}"
    if (step_dir / "config.json").exists():
        rundir.commit_checkpoint(out, step_dir)
    if not (out / "metrics.jsonl").exists():
        raise LaunchError(f"{out}: OpenRLHF finished but no metrics.jsonl was written")
    rundir.mark_done(out, {"steps": cfg["rl"]["steps"], "framework": "openrlhf"})


def _delegate(stage: str, a) -> int:
    mod = {"sft": "trace.sft", "eval": "trace.eval"}[stage]
    cmd = [sys.executable, "-m", mod, "--config", a.config, "--out", a.out]
    if stage == "eval":
        if not a.ckpt:
            raise LaunchError("--ckpt is required for --stage eval")
        cmd += ["--ckpt", a.ckpt]
    for kv in a.set:
        cmd += ["--set", kv]
    return subprocess.call(cmd)


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """(launch's own arguments, the train_ppo_ray flags after the first `--`)."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def _parser() -> argparse.ArgumentParser:
    p = C.base_parser("python -m trace.integrations.openrlhf.launch", __doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="run directory (rl, sft) or eval JSON (eval)")
    p.add_argument("--stage", choices=["rl", "sft", "eval"], default="rl")
    p.add_argument("--ckpt", help="checkpoint to evaluate (stage eval)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs for the actor (default: all visible; 0 = CPU)")
    p.add_argument("--ranks", type=int, default=None, metavar="N",
                   help="on a CPU machine: N actor ranks (ZeRO data parallel over gloo, one of Ray's logical GPUs "
                        "each; default 1), a small rehearsal of a multi-GPU run; on GPUs the ranks are --gpus")
    p.add_argument("--colocate", choices=["all", "none"], default=None,
                   help="all: engines, policy and reference share the actor GPUs (OpenRLHF's --train.colocate_all, "
                        "CUDA-IPC weight sync; the default on GPUs); none: every engine takes a GPU of its own "
                        "(NCCL broadcast; --gpus N actors + N engines need 2N GPUs; the default on the CPU)")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=3,
                   help="DeepSpeed ZeRO stage of the actor (3: parameters, gradients and optimizer state "
                        "partitioned, the cluster setting; attention, shared experts and dense MLPs are "
                        "ZeRO-3 leaf modules, docs/openrlhf.md)")
    p.add_argument("--zero-persistence-threshold", type=int, default=None, metavar="N",
                   help="ZeRO-3: parameters of fewer than N elements stay unpartitioned (DeepSpeed's "
                        "stage3_param_persistence_threshold; default OpenRLHF's, 1e5); 0 partitions all, "
                        "as a real model's are (the CI's tiny models)")
    p.add_argument("--dry-run", action="store_true",
                   help="check everything and print the train_ppo_ray command and OpenRLHF's parsed arguments "
                        "(one JSON object on stdout); writes nothing")
    p.add_argument("--engine", choices=["trace", "vllm"], default="trace",
                   help="rollout engines: ours (every arm) or OpenRLHF's vLLM engines (bf16 arm only; needs vLLM)")
    p.epilog = ("Flags after `--` go to OpenRLHF's train_ppo_ray as given (e.g. -- --actor.gradient_checkpointing_enable "
                "--train.micro_batch_size 4); one TRACE sets from the run config is refused (docs/openrlhf.md).")
    return p


def main(argv=None) -> int:
    """The launch; every refusal is one line on stderr (`error: ...`) and exit status 2."""
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except (LaunchError, C.ConfigError, F.FlagConflict, F.UnsupportedConfig, guards.HookError) as e:
        print(f"error: {guards.one_line(e) or ' '.join(str(e).split())}", file=sys.stderr)
        return 2


def _main(argv: list[str]) -> int:
    mine, user_flags = split_passthrough(argv)
    a = _parser().parse_args(mine)
    if a.stage != "rl":
        if user_flags:
            raise LaunchError("train_ppo_ray flags after `--` apply to --stage rl only")
        return _delegate(a.stage, a)
    cfg, data = load_run_config(a.config, a.set)
    gpus = torch.cuda.device_count() if a.gpus is None else a.gpus
    colocate = (gpus > 0) if a.colocate is None else a.colocate == "all"
    ranks = a.ranks or max(gpus, 1)  # actor ranks (build_argv refuses a --ranks other than the GPUs)
    if gpus == 0 and ranks > 1 and not guards.deepspeed_gathers_wait_all():
        raise LaunchError("--ranks > 1 on a CPU needs DeepSpeed >= 0.19.8: earlier ZeRO-3 gathers over gloo wait on "
                          "their last all-gather only and read uninitialized parameters (DeepSpeed PR #8539)")
    if a.engine == "vllm" and (cfg["rl"]["method"] != "bf16" or stand_ins.is_stand_in("vllm") or gpus == 0):
        # vLLM serves BF16 weights and records nothing: the FP4 arms' rollouts and TRACE's records
        # need our engine (docs/openrlhf.md, "vLLM instead of our engine")
        raise LaunchError("--engine vllm runs the bf16 arm on GPUs with vLLM installed")
    out = Path(a.out)
    check_hooks()
    check_init_ckpt(cfg)
    check_wandb(cfg)
    # the whole train_ppo_ray argv and its checks before anything is written (the files it names come later)
    dest_of = openrlhf_dest_of()
    prompts = prepare_prompts(cfg, out, data, write=False)
    argv_orl = F.merge_user_flags(build_argv(cfg, out, prepare_model(cfg, out, write=False), data, gpus, a.zero_stage,
                                             colocate, prompts=prompts, ranks=a.ranks), user_flags, dest_of, a.engine)
    argv_orl = check_reward(argv_orl, dest_of)
    check_prompt_room(cfg, argv_orl, prompts[3], dest_of)
    if a.dry_run:
        args = flat_args(parse_with_openrlhf(argv_orl))
        print(json.dumps({"command": [F.MODULE, *argv_orl], "args": args}, indent=1, sort_keys=True))
        return 0
    if (out / "done").exists():
        print(f"[openrlhf] {out} is done; nothing to run", file=sys.stderr)
        return 0
    rundir.prepare_run_dir(out, cfg, kind="rl-openrlhf")
    # a resumed run must pass the same flags as it started with (note_meta: ConfigError on a difference)
    rundir.note_meta(out, "openrlhf_user_flags", user_flags)
    rundir.note_meta(out, "openrlhf_launch", {"gpus": gpus, "ranks": ranks, "colocate": colocate,
                                              "zero_stage": a.zero_stage, "engine": a.engine})
    reward = user_reward_file(argv_orl, dest_of)
    if reward is not None:  # what the rewards came from; a resumed run must score with the same file
        rundir.note_meta(out, "reward_file", reward)
    prepare_model(cfg, out)
    prepare_prompts(cfg, out, data)
    (out / "openrlhf_argv.json").write_text(json.dumps([F.MODULE, *argv_orl], indent=1) + "\n")
    print("[openrlhf] python -m " + " ".join([F.MODULE, *argv_orl]), flush=True)
    try:
        run_openrlhf(cfg, argv_orl, out, gpus, a.engine, a.zero_persistence_threshold, colocate, ranks)
    except KeyboardInterrupt:
        return rundir.report_interrupt(f"interrupted; rerun the same command to resume from the last DeepSpeed "
                                       f"checkpoint under {out / 'ckpt' / 'deepspeed'}")
    except Exception as e:
        line = guards.one_line(e)  # a hook that failed in a Ray actor surfaces wrapped in RayTaskError
        if line is None:
            raise
        raise LaunchError(line) from None
    finish(cfg, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
