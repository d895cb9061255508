"""Run configuration (one YAML file per run): defaults, JSON schema, loading and `--set` overrides.

Every entry point (`python -m trace.sft`, `python -m trace.rl`, `python -m trace.eval`) reads one
YAML file plus `--set key=value` overrides (dotted keys, YAML-parsed values), merges it over the
defaults below, validates it with jsonschema and names the offending key in every error, e.g.
``config key 'rl.lr': expected number, got 'fast'``. Unknown keys are errors (typos must not pass).
The arms allowed in `rl.method` come from trace/arms.py; the run directory a config is run in is
trace/rundir.py's.

Compared against: nothing upstream; tests/test_config.py covers schema errors and overrides.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import Any, NoReturn

import jsonschema
import yaml

from trace.arms import ARMS, METHODS

ADVANTAGES = ("group_norm", "reinforce_baseline", "rloo")
# the task registry's names (trace/tasks), listed here so that validating a config imports no task code
TASK_NAMES = ("reasoning", "reasoning-short", "coding", "program", "long_horizon")

DEFAULTS: dict[str, Any] = {
    "model": "qwen3_moe-tiny",
    "seed": 0,
    "device": "cpu",
    "threads": None,  # torch.set_num_threads; None leaves torch's default
    # task.train_jsonl / validation_jsonl / test_jsonl / prompt_key / label_key have no defaults: absent =
    # generated splits (and resolved configs of existing runs stay as they were). The default task is the short
    # arithmetic one, whose answers fit the default rl.max_new_tokens; `reasoning` (worked answers of 40-200
    # tokens) needs rl.max_new_tokens >= its longest gold response (trace/tasks/reasoning.py).
    "task": {"name": "reasoning-short", "difficulty": "easy", "n_train": 512, "n_test": 128, "seed": 0,
             "knobs": {}},
    "sft": {
        "steps": 400, "batch_size": 32, "lr": 3.0e-3, "weight_decay": 0.0, "warmup": 20, "grad_clip": 1.0,
        "ckpt_every": 100, "log_every": 10, "eval_every": 0, "init_seed": 0, "label_smoothing": 0.0,
    },
    "rl": {
        "method": "bf16", "steps": 20, "prompts_per_step": 8, "group_size": 8, "max_new_tokens": 8,
        "temperature": 1.0, "lr": 1.0e-4, "weight_decay": 0.0, "grad_clip": 1.0, "clip_eps": 0.2,
        "kl_coef": 0.0, "advantage": "group_norm", "tis_cap": 2.0, "icepop": None, "ppo_ratio": "trainer",
        # align_coef: DESIGN.md §3's rule (step-1 gradient ratio 0.2) on qwen3_moe-tiny, the defaults' flavor
        # (results/guidance/align_calibration.md); the small and paper profiles set their own, calibrated on GPU
        "rho": 0.5, "align_coef": 5.0, "align_scales": True, "fmt": "nvfp4", "autocast": "bf16", "init_ckpt": None,
        "ckpt_every": 5, "eval_every": 0, "max_turns": 8, "diag_flips": True, "recompute_experts": False,
    },
    # rl.micro_batch (sequences per trainer forward/backward, gradients accumulated; trace/rl/trainstep.py) has
    # no default either: absent, null or 0 = the whole batch in one forward, so resolved configs of existing runs
    # stay as they were. Nor has rl.experts (the QAT experts' implementation, trace/qat/experts.py PATHS: absent or
    # null = "auto"): a setting of speed, the loop and the grouped path compute the same
    # eval.split ("test" | "validation") has no default: absent = "test" (trace/episode.py), so resolved configs
    # of existing runs stay as they were; "validation" is for choices of configuration, so that choosing never
    # reads the test split (trace/tasks/base.py)
    "eval": {"n_test": None, "samples_per_prompt": 4, "temperature": 1.0, "max_new_tokens": None,
             "modes": ["bf16", "fp4"], "seed": 1234},
    "wandb": {"mode": "disabled", "project": "trace-fp4-rl", "name": None},
}

_num = {"type": "number"}
_int = {"type": "integer"}
_pos_int = {"type": "integer", "minimum": 1}
_nonneg_int = {"type": "integer", "minimum": 0}
_pos_num = {"type": "number", "exclusiveMinimum": 0}
_nonneg_num = {"type": "number", "minimum": 0}


def _obj(props: dict, required: tuple = ()) -> dict:
    return {"type": "object", "properties": props, "additionalProperties": False, "required": list(required)}


SCHEMA: dict = _obj({
    "model": {"type": "string"},
    "seed": _int,
    "device": {"type": "string"},
    "threads": {"type": ["integer", "null"], "minimum": 1},
    "task": _obj({
        "name": {"enum": list(TASK_NAMES)},
        "difficulty": {"enum": ["easy", "medium", "hard"]},
        "n_train": _pos_int, "n_test": _pos_int, "seed": _int,
        "knobs": {"type": "object"},
        # local JSONL files replacing the generated splits (trace/tasks/datasets.py); the names are the
        # paper profile's, and the OpenRLHF launcher passes train_jsonl on as its prompt dataset
        "train_jsonl": {"type": ["string", "null"]}, "test_jsonl": {"type": ["string", "null"]},
        "validation_jsonl": {"type": ["string", "null"]},
        "prompt_key": {"type": "string"}, "label_key": {"type": "string"},
    }),
    "sft": _obj({
        "steps": _nonneg_int, "batch_size": _pos_int, "lr": _pos_num, "weight_decay": _nonneg_num,
        "warmup": _nonneg_int, "grad_clip": _pos_num, "ckpt_every": _pos_int, "log_every": _pos_int,
        "eval_every": _nonneg_int, "init_seed": _int,
        "label_smoothing": {"type": "number", "minimum": 0, "maximum": 0.9},
    }),
    "rl": _obj({
        "method": {"enum": list(METHODS)},
        "steps": _nonneg_int, "prompts_per_step": _pos_int, "group_size": _pos_int, "max_new_tokens": _pos_int,
        "temperature": _pos_num, "lr": _pos_num, "weight_decay": _nonneg_num, "grad_clip": _pos_num,
        "clip_eps": _pos_num, "kl_coef": _nonneg_num, "advantage": {"enum": list(ADVANTAGES)},
        "tis_cap": {"oneOf": [{"type": "null"}, _pos_num]},
        "icepop": {"oneOf": [{"type": "null"},
                             {"type": "array", "items": _nonneg_num, "minItems": 2, "maxItems": 2}]},
        "ppo_ratio": {"enum": ["rollout", "trainer"]},
        "rho": {"type": "number", "minimum": 0, "maximum": 1}, "align_coef": _nonneg_num,
        "align_scales": {"type": "boolean"},
        "fmt": {"enum": ["nvfp4", "mxfp4"]}, "autocast": {"enum": ["bf16", "none"]},
        "init_ckpt": {"type": ["string", "null"]}, "ckpt_every": _pos_int, "eval_every": _nonneg_int,
        "max_turns": _pos_int, "diag_flips": {"type": "boolean"}, "recompute_experts": {"type": "boolean"},
        "micro_batch": {"oneOf": [{"type": "null"}, _nonneg_int]},
        "experts": {"enum": [None, "auto", "loop", "grouped"]},
    }),
    "eval": _obj({
        "n_test": {"oneOf": [{"type": "null"}, _pos_int]}, "samples_per_prompt": _pos_int,
        "temperature": _nonneg_num, "max_new_tokens": {"oneOf": [{"type": "null"}, _pos_int]},
        "modes": {"type": "array", "items": {"enum": ["bf16", "fp4"]}, "minItems": 1}, "seed": _int,
        "split": {"enum": ["test", "validation"]},
    }),
    "wandb": _obj({
        "mode": {"enum": ["offline", "disabled", "online"]}, "project": {"type": "string"},
        "name": {"type": ["string", "null"]},
    }),
}, required=("model",))


class ConfigError(ValueError):
    """A config that does not match the schema; the message names the key."""


def _key_name(path) -> str:
    return ".".join(str(p) for p in path) or "<root>"


def _describe(err: jsonschema.ValidationError) -> str:
    path = list(err.absolute_path)
    if err.validator == "additionalProperties":
        extra = sorted(set(err.instance) - set(err.schema.get("properties", {})))
        keys = ", ".join(f"'{_key_name(path + [k])}'" for k in extra)
        return f"config key {keys}: unknown key (allowed: {sorted(err.schema.get('properties', {}))})"
    if err.validator == "required":
        return f"config key '{_key_name(path)}': {err.message}"
    key = _key_name(path)
    sch = err.schema
    if err.validator == "type":
        want = sch["type"] if isinstance(sch["type"], str) else " or ".join(sch["type"])
        return f"config key '{key}': expected {want}, got {err.instance!r}"
    if err.validator == "enum":
        return f"config key '{key}': expected one of {sch['enum']}, got {err.instance!r}"
    if err.validator == "oneOf":
        kinds = []
        for s in sch["oneOf"]:
            kinds.append("null" if s.get("type") == "null" else
                         (f"{s.get('type')} > 0" if "exclusiveMinimum" in s else str(s.get("type"))))
        return f"config key '{key}': expected {' or '.join(kinds)}, got {err.instance!r}"
    return f"config key '{key}': {err.message}"


def validate(cfg: dict) -> dict:
    """Raise ConfigError naming the offending key (the shallowest error first), else return cfg."""
    v = jsonschema.Draft202012Validator(SCHEMA)
    errors = sorted(v.iter_errors(cfg), key=lambda e: (len(e.absolute_path), _key_name(e.absolute_path)))
    if errors:
        raise ConfigError(_describe(errors[0]))
    _semantic_checks(cfg)
    return cfg


def _semantic_checks(cfg: dict) -> None:
    if "model" in cfg:
        from trace.models.registry import FLAVORS  # imports transformers: only when a config is validated

        if cfg["model"] not in FLAVORS:
            raise ConfigError(f"config key 'model': unknown model {cfg['model']!r}; the registered models are "
                              f"{list(FLAVORS)} (trace/models/registry.py)")
    rl = cfg.get("rl", {})
    ice = rl.get("icepop")
    if ice is not None and not ice[0] < ice[1]:
        raise ConfigError(f"config key 'rl.icepop': expected [lo, hi] with lo < hi, got {ice!r}")
    if ice is not None and rl.get("tis_cap") is not None:
        raise ConfigError("config key 'rl.icepop': ICEPOP replaces TIS; set rl.tis_cap to null with it")
    arm = ARMS.get(rl.get("method"))
    err = arm.setting_error(rl) if arm is not None else None
    if err is not None:
        raise ConfigError(f"config key '{err[0]}': {err[1]}")
    if rl.get("advantage") == "rloo" and rl.get("group_size", 2) < 2:
        raise ConfigError("config key 'rl.group_size': rloo needs group_size >= 2")
    # bool is a subclass of int in Python; jsonschema treats it separately, so nothing to do here.


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "knobs":
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def apply_overrides(cfg: dict, sets: list[str] | None) -> dict:
    """`key.sub=value` strings; values are YAML-parsed (so 1e-4 -> float, null -> None, [a, b] -> list)."""
    cfg = copy.deepcopy(cfg)
    for s in sets or []:
        if "=" not in s:
            raise ConfigError(f"override {s!r}: expected key=value")
        key, raw = s.split("=", 1)
        val = yaml.safe_load(raw) if raw != "" else ""
        if isinstance(val, str) and _looks_float(val):
            val = float(val)  # YAML 1.1 reads '1e-4' as a string
        node = cfg
        parts = key.strip().split(".")
        for p in parts[:-1]:
            if not isinstance(node.get(p, {}), dict):
                raise ConfigError(f"config key '{key}': '{p}' is not a section")
            node = node.setdefault(p, {})
        node[parts[-1]] = val
    return cfg


def _looks_float(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return any(c in s.lower() for c in ".e") and s.strip().lower() not in ("nan", "inf", "-inf", "infinity")


def _fix_yaml_floats(node):
    """PyYAML (YAML 1.1) parses '3e-4' as a string; configs mean a number."""
    if isinstance(node, dict):
        return {k: _fix_yaml_floats(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_fix_yaml_floats(v) for v in node]
    if isinstance(node, str) and _looks_float(node):
        return float(node)
    return node


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                base: dict | None = None) -> dict:
    """Defaults <- YAML file (or `base` dict) <- overrides, validated. Returns the resolved dict."""
    user: dict = {}
    if path is not None:
        with open(path) as f:
            user = yaml.safe_load(f) or {}
        if not isinstance(user, dict):
            raise ConfigError(f"config file {path}: top level must be a mapping")
    if base is not None:
        user = deep_merge(base, user)
    user = _fix_yaml_floats(apply_overrides(user, overrides))
    # validate the user's keys first, so errors point at what they wrote, then the merged result
    validate_partial(user)
    cfg = deep_merge(DEFAULTS, user)
    return validate(cfg)


def validate_partial(user: dict) -> None:
    """Schema check of a partial config (no required keys) so typos are reported as the user wrote them."""
    schema = copy.deepcopy(SCHEMA)
    schema["required"] = []
    v = jsonschema.Draft202012Validator(schema)
    errors = sorted(v.iter_errors(user), key=lambda e: (len(e.absolute_path), _key_name(e.absolute_path)))
    if errors:
        raise ConfigError(_describe(errors[0]))


def dump_config(cfg: dict) -> str:
    return yaml.safe_dump(cfg, sort_keys=False)


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------
def base_parser(prog: str, desc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=desc)
    p.add_argument("--config", required=True, help="YAML config file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (dotted), value parsed as YAML; repeatable")
    return p


def parse_cli(p: argparse.ArgumentParser, argv=None) -> tuple[argparse.Namespace, dict]:
    """(arguments, resolved config) of an entry point built on `base_parser`; a bad config prints the
    offending key and exits with status 2."""
    a = p.parse_args(argv)
    try:
        return a, load_config(a.config, a.set)
    except ConfigError as e:
        fail(e)
    except OSError as e:
        fail(f"config file {a.config!r}: {e.strerror or e}")


def fail(msg) -> NoReturn:
    """A start-up error: one `error: ...` line on stderr and exit status 2 (nothing written yet)."""
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def diff_keys(a, b, prefix=""):
    """Dotted keys whose values differ between two configs."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in set(a) | set(b):
            yield from diff_keys(a.get(k), b.get(k), f"{prefix}{k}.")
    elif a != b:
        yield prefix.rstrip(".")


__all__ = [
    "ADVANTAGES", "DEFAULTS", "METHODS", "SCHEMA", "TASK_NAMES", "ConfigError", "apply_overrides", "base_parser", "deep_merge",
    "diff_keys", "dump_config", "fail", "load_config", "parse_cli", "validate",
]
