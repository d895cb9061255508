"""Run configuration (one YAML file per run): defaults, JSON schema, loading and `--set` overrides.

Every entry point (`python -m trace.sft`, `python -m trace.rl`, `python -m trace.eval`) reads one
YAML file plus `--set key=value` overrides (dotted keys, YAML-parsed values), merges it over the
defaults of the settings dataclasses (trace/settings.py, the only place a default is written), validates it with jsonschema and names the offending key in every error, e.g.
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

from trace import settings as S
from trace.arms import ARMS, METHODS
from trace.settings import ADVANTAGES, TASK_NAMES

# the defaults and the schema are the settings dataclasses' (trace/settings.py); the arms come from trace/arms.py
DEFAULTS: dict[str, Any] = S.defaults()
SCHEMA: dict = S.schema_of(S.RunSettings)
SCHEMA["required"] = ["model"]
SCHEMA["properties"]["rl"]["properties"]["method"]["enum"] = list(METHODS)


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
    if rl.get("advantage") == "rloo" and rl["group_size"] < 2:
        raise ConfigError("config key 'rl.group_size': rloo needs group_size >= 2")
    # bool is a subclass of int in Python; jsonschema treats it separately, so nothing to do here.


def deep_merge(base: dict, over: dict) -> dict:
    """`over` merged into a copy of `base`, section by section; `task.knobs` (a task's own generator settings) is
    replaced whole, never merged, so a config's knobs are all the knobs there are."""
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


def _fix_yaml_switches(user: dict) -> dict:
    """PyYAML (YAML 1.1) parses a bare on/off as true/false; a switch whose values are 'on' and 'off' means them."""
    for key in S.ENV:
        sec, name = key.split(".")
        node = user.get(sec)
        enum = SCHEMA["properties"][sec]["properties"][name].get("enum", [])
        if isinstance(node, dict) and isinstance(node.get(name), bool) and "on" in enum:
            node[name] = "on" if node[name] else "off"
    return user


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
    user = _fix_yaml_switches(_fix_yaml_floats(apply_overrides(user, overrides)))
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
        cfg = load_config(a.config, a.set)
    except ConfigError as e:
        fail(e)
    except OSError as e:
        fail(f"config file {a.config!r}: {e.strerror or e}")
    S.use(cfg)  # the process's kernel switches are the run's (trace/settings.py `switch`)
    return a, cfg


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
