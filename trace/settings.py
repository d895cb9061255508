"""The run settings: one dataclass per section of a run config, each field with its one default and one line of
documentation. They are the only source of defaults; trace/config.py derives its DEFAULTS and its JSON schema
from them, and `python -m trace.settings` prints every key with its default and meaning.

    model, seed, device, threads     RunSettings (the top level)
    task.*    TaskSettings           the task and its splits (trace/tasks)
    sft.*     SFTSettings            supervised fine-tuning of the base (trace/sft.py)
    rl.*      RLSettings             the RL run and its arm (trace/rl, trace/guidance/method.py)
    eval.*    EvalSettings           held-out evaluation (trace/episode.py)
    wandb.*   WandbSettings          the metrics mirror (trace/rundir.py)
    engine.*  EngineSettings         which kernels compute (trace/fp4, trace/rollout): speed, not results

A field's JSON type comes from its annotation (int -> integer, float -> number, Literal -> enum, X | None -> X or
null); `setting(..., minimum=0)` adds schema keywords. This module imports nothing of trace/, so every layer can
read it (tests/test_layers.py).

Environment overrides: the `engine` fields and `sft.determinism` are switches a benchmark or a rebuild flips for
one process, so each has an environment variable (ENV, below) that overrides the field where it is set and not
empty. `switch(name)` is the one place that reads them: the field's value from the run config the process
started with (`use(cfg)`, called by the entry points), else its default, unless its variable is set. A run's
meta.json records the variables that were set (trace/rundir.py ENV_KEYS). Other TRACE_* variables are not
settings of a run but of the tooling around it (TRACE_RUN_DIR, TRACE_GIT_COMMIT, TRACE_ALLOW_DIRTY, the
sandbox's, the GPU tests' and the OpenRLHF launcher's hand-offs to its workers); their modules document them.

Migration: resolved configs (a run directory's config.yaml) written before a key had a default lack it. `migrate`
fills exactly the keys in ADDED, with the value their absence meant, and nothing else, so that such a config
compares equal to today's resolution of the same settings (tests/test_settings.py loads every committed one).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

TASK_NAMES = ("reasoning", "reasoning-short", "coding", "program", "long_horizon")
ADVANTAGES = ("group_norm", "reinforce_baseline", "rloo")


def setting(default, doc: str, **schema):
    """A settings field: its default, one line saying what it sets, and extra JSON-schema keywords."""
    kw = {"default_factory": (lambda d=default: copy.deepcopy(d))} if isinstance(default, (dict, list)) else \
        {"default": default}
    return field(metadata={"doc": doc, "schema": schema}, **kw)


def section(cls):
    """A nested section of the settings (its defaults are its fields')."""
    return field(default_factory=cls, metadata={"doc": (cls.__doc__ or "").strip().splitlines()[0], "schema": {}})


@dataclass
class TaskSettings:
    """The task: generated splits of a registered task, or local JSONL files."""
    name: Literal[TASK_NAMES] = setting("reasoning-short", "the task (trace/tasks); `reasoning` needs "
                                        "rl.max_new_tokens >= its longest gold response")
    difficulty: Literal["easy", "medium", "hard"] = setting("easy", "the generator's preset")
    n_train: int = setting(512, "generated training prompts", minimum=1)
    n_test: int = setting(128, "generated test prompts", minimum=1)
    seed: int = setting(0, "seed of the generated splits")
    knobs: dict = setting({}, "task-specific generator knobs (replaced whole by a config, never merged)")
    train_jsonl: str | None = setting(None, "local JSONL replacing the generated training split "
                                      "(the OpenRLHF launcher passes it on as its prompt dataset)")
    test_jsonl: str | None = setting(None, "local JSONL replacing the generated test split")
    validation_jsonl: str | None = setting(None, "local JSONL replacing the generated validation split")
    prompt_key: str = setting("prompt", "the prompt's key in the JSONL files")
    label_key: str = setting("label", "the label's key in the JSONL files")


@dataclass
class SFTSettings:
    """Supervised fine-tuning of the base policy."""
    steps: int = setting(400, "optimizer steps", minimum=0)
    batch_size: int = setting(32, "sequences per step", minimum=1)
    lr: float = setting(3.0e-3, "peak AdamW learning rate", exclusiveMinimum=0)
    weight_decay: float = setting(0.0, "AdamW weight decay", minimum=0)
    warmup: int = setting(20, "linear warm-up steps", minimum=0)
    grad_clip: float = setting(1.0, "global gradient-norm clip", exclusiveMinimum=0)
    ckpt_every: int = setting(100, "steps between checkpoints", minimum=1)
    log_every: int = setting(10, "steps between metrics lines", minimum=1)
    eval_every: int = setting(0, "steps between held-out evaluations (0: none)", minimum=0)
    init_seed: int = setting(0, "seed of the random initial weights")
    label_smoothing: float = setting(0.0, "label smoothing of the token loss", minimum=0, maximum=0.9)
    determinism: Literal["strict", "math", "none"] = setting(
        "strict", "determinism mode on a GPU (trace/sft.py; a CPU run is always 'none')")


@dataclass
class RLSettings:
    """The RL run and its arm."""
    method: str = setting("bf16", "the arm (trace/arms.py ARMS)")
    steps: int = setting(20, "RL steps", minimum=0)
    prompts_per_step: int = setting(8, "prompts per step", minimum=1)
    group_size: int = setting(8, "samples per prompt", minimum=1)
    max_new_tokens: int = setting(8, "generation limit per sample", minimum=1)
    temperature: float = setting(1.0, "sampling temperature", exclusiveMinimum=0)
    lr: float = setting(1.0e-4, "AdamW learning rate", exclusiveMinimum=0)
    weight_decay: float = setting(0.0, "AdamW weight decay", minimum=0)
    grad_clip: float = setting(1.0, "global gradient-norm clip", exclusiveMinimum=0)
    clip_eps: float = setting(0.2, "PPO ratio clip", exclusiveMinimum=0)
    kl_coef: float = setting(0.0, "weight of the KL to the initial policy", minimum=0)
    advantage: Literal[ADVANTAGES] = setting("group_norm", "advantage estimator")
    tis_cap: float | None = setting(2.0, "truncated importance-sampling cap (null: none)", exclusiveMinimum=0)
    icepop: list[float] | None = setting(None, "ICEPOP's [lo, hi] token mask, replacing TIS",
                                         minItems=2, maxItems=2, items={"type": "number", "minimum": 0})
    ppo_ratio: Literal["rollout", "trainer"] = setting("trainer", "the PPO ratio's denominator")
    rho: float = setting(0.5, "guided fraction of the layers (the deepest)", minimum=0, maximum=1)
    # DESIGN.md §3's rule (step-1 gradient ratio 0.2) on qwen3_moe-tiny, the defaults' flavor
    # (results/guidance/align_calibration.md); the small and paper profiles calibrate their own on a GPU
    align_coef: float = setting(5.0, "weight of the alignment term in the loss", minimum=0)
    align_scales: bool = setting(True, "the block-scale part of the alignment term")
    fmt: Literal["nvfp4", "mxfp4"] = setting("nvfp4", "the FP4 format")
    autocast: Literal["bf16", "none"] = setting("bf16", "the trainer's autocast dtype")
    init_ckpt: str | None = setting(None, "the SFT checkpoint (or run dir) to start from; null: random weights")
    ckpt_every: int = setting(5, "steps between checkpoints", minimum=1)
    eval_every: int = setting(0, "steps between held-out evaluations (0: none)", minimum=0)
    max_turns: int = setting(8, "turns of a multi-turn episode", minimum=1)
    diag_flips: bool = setting(True, "the diagnostic full-codes record for flip statistics")
    recompute_experts: bool = setting(False, "recompute the QAT experts in backward (activation memory)")
    micro_batch: int | None = setting(None, "sequences per trainer forward/backward, gradients accumulated "
                                      "(null or 0: the whole batch)", minimum=0)
    experts: Literal["auto", "loop", "grouped"] = setting(
        "auto", "the QAT experts' implementation (trace/qat/experts.py; both compute the same)")


@dataclass
class EvalSettings:
    """Held-out evaluation."""
    n_test: int | None = setting(None, "prompts evaluated (null: task.n_test)", minimum=1)
    samples_per_prompt: int = setting(4, "samples per prompt", minimum=1)
    temperature: float = setting(1.0, "sampling temperature (0: greedy)", minimum=0)
    max_new_tokens: int | None = setting(None, "generation limit (null: rl.max_new_tokens)", minimum=1)
    modes: list[Literal["bf16", "fp4"]] = setting(["bf16", "fp4"], "deployments evaluated", minItems=1)
    seed: int = setting(1234, "sampling seed")
    split: Literal["test", "validation"] = setting(
        "test", "the split; `validation` for choices of configuration, which never read the test split")


@dataclass
class WandbSettings:
    """The Weights & Biases mirror of metrics.jsonl."""
    mode: Literal["offline", "disabled", "online"] = setting("disabled", "wandb mode")
    project: str = setting("trace-fp4-rl", "wandb project")
    name: str | None = setting(None, "run name (null: the run directory's)")


@dataclass
class EngineSettings:
    """Which kernels compute (speed only: every choice computes the same codes)."""
    backend: Literal["auto", "torch", "triton"] = setting(
        "auto", "the engine's FP4 path: auto = Triton on CUDA; torch everywhere; triton also on a CPU "
        "(TRITON_INTERPRET=1)")
    fp4_kernels: Literal["off", "on", "auto"] = setting(
        "off", "RTN on the Triton quantize kernel (auto: CUDA tensors)")
    fp4_align: Literal["off", "on", "auto"] = setting(
        "off", "the alignment term on the fused kernels (auto: CUDA tensors)")
    fp4_attn: Literal["mma", "triton"] = setting("mma", "the FP4-KV decode attention kernel")
    fp4_crossover: str | None = setting(
        None, "'ROWS,LOAD': the largest dense rows / rows per expert on the decode kernels (null: measured)",
        pattern=r"^\s*[0-9.eE+inf]+\s*,\s*[0-9.eE+inf]+\s*$")


@dataclass
class RunSettings:
    """One run's settings."""
    model: str = setting("qwen3_moe-tiny", "the flavor (trace/models/registry.py)")
    seed: int = setting(0, "the run's seed")
    device: str = setting("cpu", "torch device")
    threads: int | None = setting(None, "torch.set_num_threads (null: torch's default)", minimum=1)
    task: TaskSettings = section(TaskSettings)
    sft: SFTSettings = section(SFTSettings)
    rl: RLSettings = section(RLSettings)
    eval: EvalSettings = section(EvalSettings)
    wandb: WandbSettings = section(WandbSettings)
    engine: EngineSettings = section(EngineSettings)

    @classmethod
    def from_dict(cls, cfg: dict) -> RunSettings:
        """The typed view of a resolved config (every key present)."""
        kw = {}
        for f in dataclasses.fields(cls):
            v = cfg[f.name]
            sub = _section_type(cls, f.name)
            kw[f.name] = sub(**v) if sub is not None else v
        return cls(**kw)


@functools.cache
def _hints(cls) -> dict:
    """The evaluated annotations of a settings class (once: the schema and the docs read them field by field)."""
    return typing.get_type_hints(cls, globalns=vars(sys.modules[__name__]))


def _section_type(cls, name: str):
    t = _hints(cls)[name]
    return t if dataclasses.is_dataclass(t) else None


def defaults() -> dict:
    """The default resolved config: every section's fields at their defaults."""
    return dataclasses.asdict(RunSettings())


# ------------------------------------------------------------------------------------ JSON schema
_JSON = {int: "integer", float: "number", bool: "boolean", str: "string", dict: "object", list: "array"}


def _type_schema(t) -> dict:
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"unsupported settings type {t!r}")
        s = _type_schema(inner[0])
        if "enum" in s:
            return {"enum": [None, *s["enum"]]}
        return {**s, "type": [s["type"], "null"]}
    if origin is list:
        return {"type": "array", "items": _type_schema(args[0])} if args else {"type": "array"}
    if t in _JSON:
        return {"type": _JSON[t]}
    raise TypeError(f"unsupported settings type {t!r}")


def schema_of(cls) -> dict:
    """The JSON schema of a settings dataclass: its fields' types and keywords, no key beyond them."""
    props = {}
    for f in dataclasses.fields(cls):
        t = _hints(cls)[f.name]
        if dataclasses.is_dataclass(t):
            props[f.name] = schema_of(t)
            continue
        s = _type_schema(t)
        extra = dict(f.metadata["schema"])
        if "items" in extra and "items" in s:
            extra["items"] = {**s["items"], **extra["items"]}
        props[f.name] = {**s, **extra}
    return {"type": "object", "properties": props, "additionalProperties": False, "required": []}


def fields_doc(cls=RunSettings, prefix: str = ""):
    """(dotted key, default, doc) of every setting, in declaration order."""
    for f in dataclasses.fields(cls):
        t = _hints(cls)[f.name]
        if dataclasses.is_dataclass(t):
            yield from fields_doc(t, f"{prefix}{f.name}.")
        else:
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            yield f"{prefix}{f.name}", default, f.metadata["doc"]


# ------------------------------------------------------------------------------------ environment switches
ENV = {
    "engine.backend": "TRACE_ROLLOUT_BACKEND",
    "engine.fp4_kernels": "TRACE_FP4_KERNELS",
    "engine.fp4_align": "TRACE_FP4_ALIGN",
    "engine.fp4_attn": "TRACE_FP4_ATTN",
    "engine.fp4_crossover": "TRACE_FP4_CROSSOVER",
    "sft.determinism": "TRACE_SFT_DETERMINISM",
}
_active: dict[str, Any] = {}


def _switch_spec(key: str) -> tuple[Any, list | None]:
    sec, name = key.split(".")
    cls = _section_type(RunSettings, sec)
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    return f.default, _type_schema(_hints(cls)[name]).get("enum")


# (default, allowed values) of each switch, computed once: `switch` runs on every quantization call
_SWITCHES = {key: _switch_spec(key) for key in ENV}


def use(cfg: dict) -> None:
    """Make a resolved config's switches (ENV's keys) the process's: an entry point calls it once it has its config."""
    _active.clear()
    for key in ENV:
        sec, name = key.split(".")
        if name in (cfg.get(sec) or {}):
            _active[key] = cfg[sec][name]


def switch(key: str):
    """The value of switch `key` (one of ENV's) in this process: its environment variable where set and not empty,
    else the value `use` made the process's, else its default. A bad value names the variable or the key."""
    env = os.environ.get(ENV[key], "")
    default, allowed = _SWITCHES[key]
    if env:
        value, where = env, ENV[key]
    else:
        value, where = _active.get(key, default), f"config key '{key}'"
    if allowed is not None and value not in allowed:
        raise ValueError(f"{where} must be one of {[a for a in allowed if a is not None]}, got {value!r}")
    return value


# ------------------------------------------------------------------------------------ migration
# keys that resolved configs lacked before they had a default, with the value their absence meant then (the
# alignment term had its scale part and the experts kept their activations before those two keys existed)
ADDED = {
    "rl.align_scales": True, "rl.recompute_experts": False,
    "task.train_jsonl": None, "task.test_jsonl": None, "task.validation_jsonl": None,
    "task.prompt_key": "prompt", "task.label_key": "label",
    "sft.determinism": "strict",
    "rl.micro_batch": None, "rl.experts": "auto",
    "eval.split": "test",
    **{f"engine.{f.name}": f.default for f in dataclasses.fields(EngineSettings)},
}


def migrate(cfg: dict) -> dict:
    """A resolved config written before ADDED's keys had defaults, with them filled in (a copy); an explicit
    `rl.experts: null` (the old spelling of auto) becomes 'auto'."""
    out = copy.deepcopy(cfg)
    for key, value in ADDED.items():
        sec, name = key.split(".")
        node = out.setdefault(sec, {})
        if isinstance(node, dict) and name not in node:
            node[name] = copy.deepcopy(value)
    if isinstance(out.get("rl"), dict) and out["rl"].get("experts", "auto") is None:
        out["rl"]["experts"] = "auto"
    return out


def main() -> None:
    """Print every setting: dotted key, default, meaning (and its environment variable, for the switches)."""
    for key, default, doc in fields_doc():
        env = f" [${ENV[key]}]" if key in ENV else ""
        print(f"{key:<24} {default!r:<18} {doc}{env}")


if __name__ == "__main__":
    main()


__all__ = ["ADDED", "ADVANTAGES", "ENV", "EngineSettings", "EvalSettings", "RLSettings", "RunSettings", "SFTSettings",
           "TASK_NAMES", "TaskSettings", "WandbSettings", "defaults", "fields_doc", "migrate", "schema_of", "setting",
           "switch", "use"]
