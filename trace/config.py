"""Run configuration (one YAML file per run), its JSON schema, and the run-directory utilities.

Every entry point (`python -m trace.sft`, `python -m trace.rl`, `python -m trace.eval`) reads one
YAML file plus `--set key=value` overrides (dotted keys, YAML-parsed values), merges it over the
defaults below, validates it with jsonschema and names the offending key in every error, e.g.
``config key 'rl.lr': expected number, got 'fast'``. Unknown keys are errors (typos must not pass).

Run directory layout (the contract with the Snakemake pipeline):

    DIR/config.yaml      resolved config (defaults filled in)
    DIR/meta.json        git commit, library versions, host, CPU/GPU, python, start time (+ resumes)
    DIR/metrics.jsonl    one JSON object per step; the source of truth (wandb only mirrors it)
    DIR/ckpt/step_XXXXXX model (safetensors) + tokenizer + trainer_state.pt (optimizer, RNG, step)
    DIR/ckpt/latest      name of the newest complete checkpoint (written atomically, last)
    DIR/done             written when the run finished

Resume: `MetricsLog.open(dir, upto_step)` drops lines after the checkpoint's step (and a torn last
line from a kill -9), so the restarted run appends without duplicates or gaps.
Compared against: nothing upstream; tests/test_config.py covers schema errors and resume truncation.
"""
from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import yaml

METHODS = ("bf16", "fp4-naive", "qat-independent", "qat-weight-only", "trace", "trace-fullcodes",
           "trace-noalign", "trace-noroutingreplay")
ADVANTAGES = ("group_norm", "reinforce_baseline", "rloo")

DEFAULTS: dict[str, Any] = {
    "model": "qwen3_moe-tiny",
    "seed": 0,
    "device": "cpu",
    "threads": None,  # torch.set_num_threads; None leaves torch's default
    "task": {"name": "reasoning", "difficulty": "easy", "n_train": 512, "n_test": 128, "seed": 0, "knobs": {}},
    "sft": {
        "steps": 400, "batch_size": 32, "lr": 3.0e-3, "weight_decay": 0.0, "warmup": 20, "grad_clip": 1.0,
        "ckpt_every": 100, "log_every": 10, "eval_every": 0, "init_seed": 0, "label_smoothing": 0.0,
    },
    "rl": {
        "method": "bf16", "steps": 20, "prompts_per_step": 8, "group_size": 8, "max_new_tokens": 8,
        "temperature": 1.0, "lr": 1.0e-4, "weight_decay": 0.0, "grad_clip": 1.0, "clip_eps": 0.2,
        "kl_coef": 0.0, "advantage": "group_norm", "tis_cap": 2.0, "icepop": None, "ppo_ratio": "trainer",
        "rho": 0.5, "align_coef": 0.1, "fmt": "nvfp4", "autocast": "bf16", "init_ckpt": None,
        "ckpt_every": 5, "eval_every": 0, "max_turns": 8, "diag_flips": True,
    },
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
        "name": {"enum": ["reasoning", "coding", "long_horizon"]},
        "difficulty": {"enum": ["easy", "medium", "hard"]},
        "n_train": _pos_int, "n_test": _pos_int, "seed": _int,
        "knobs": {"type": "object"},
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
        "fmt": {"enum": ["nvfp4", "mxfp4"]}, "autocast": {"enum": ["bf16", "none"]},
        "init_ckpt": {"type": ["string", "null"]}, "ckpt_every": _pos_int, "eval_every": _nonneg_int,
        "max_turns": _pos_int, "diag_flips": {"type": "boolean"},
    }),
    "eval": _obj({
        "n_test": {"oneOf": [{"type": "null"}, _pos_int]}, "samples_per_prompt": _pos_int,
        "temperature": _nonneg_num, "max_new_tokens": {"oneOf": [{"type": "null"}, _pos_int]},
        "modes": {"type": "array", "items": {"enum": ["bf16", "fp4"]}, "minItems": 1}, "seed": _int,
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
    rl = cfg.get("rl", {})
    ice = rl.get("icepop")
    if ice is not None and not ice[0] < ice[1]:
        raise ConfigError(f"config key 'rl.icepop': expected [lo, hi] with lo < hi, got {ice!r}")
    if ice is not None and rl.get("tis_cap") is not None:
        raise ConfigError("config key 'rl.icepop': ICEPOP replaces TIS; set rl.tis_cap to null with it")
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


# ----------------------------------------------------------------------------------------------
# Run directory
# ----------------------------------------------------------------------------------------------
def _git_commit() -> str | None:
    try:
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        if out.returncode != 0:
            return None
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except Exception:  # noqa: BLE001 - meta data is best effort, never fatal
        return None


def _version(mod: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(mod)
    except Exception:  # noqa: BLE001
        return None


def collect_meta() -> dict:
    import torch
    gpu = None
    if torch.cuda.is_available():
        gpu = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "git_commit": _git_commit(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "triton": _version("triton"),
        "python": sys.version.split()[0],
        "hostname": socket.gethostname(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": gpu,
        "argv": sys.argv,
        "start_time": _dt.datetime.now(_dt.timezone.utc).isoformat(),
    }


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def prepare_run_dir(out: str | os.PathLike, cfg: dict, kind: str) -> Path:
    """Create DIR, write config.yaml (or check it matches on a restart) and meta.json."""
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    cfg_path = d / "config.yaml"
    text = dump_config(cfg)
    if cfg_path.exists():
        old = yaml.safe_load(cfg_path.read_text())
        if old != yaml.safe_load(text):
            diff = sorted(_diff_keys(old, cfg))
            raise ConfigError(f"{d} holds a run with a different config (keys {diff}); use a new --out")
    else:
        _atomic_write(cfg_path, text)
    meta_path = d / "meta.json"
    meta = collect_meta()
    meta["kind"] = kind
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        old.setdefault("resumes", []).append(meta["start_time"])
        meta = old
    _atomic_write(meta_path, json.dumps(meta, indent=2))
    return d


def _diff_keys(a, b, prefix=""):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in set(a) | set(b):
            yield from _diff_keys(a.get(k), b.get(k), f"{prefix}{k}.")
    elif a != b:
        yield prefix.rstrip(".")


class MetricsLog:
    """Append-only JSONL of per-step metrics with resume truncation; mirrors to wandb if enabled."""

    def __init__(self, path: Path, wandb_run=None):
        self.path = path
        self.wandb = wandb_run
        self._f = open(path, "a")

    @classmethod
    def open(cls, run_dir: str | os.PathLike, upto_step: int | None, wandb_cfg: dict | None = None,
             cfg: dict | None = None, name: str = "metrics.jsonl") -> MetricsLog:
        """Keep lines with step <= upto_step (None: keep nothing) and drop a torn last line."""
        path = Path(run_dir) / name
        keep: list[str] = []
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    break  # a line torn by kill -9; everything after it is not trustworthy
                if upto_step is not None and int(rec.get("step", -1)) <= upto_step:
                    keep.append(line)
            _atomic_write(path, "".join(k + "\n" for k in keep))
        return cls(path, _wandb_init(run_dir, wandb_cfg, cfg))

    def log(self, rec: dict) -> None:
        self._f.write(json.dumps(_jsonable(rec), sort_keys=False) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        if self.wandb is not None:
            flat = {k: v for k, v in _flatten(rec).items() if isinstance(v, (int, float))}
            self.wandb.log(flat, step=int(rec.get("step", 0)))

    def close(self) -> None:
        self._f.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def read_metrics(path: str | os.PathLike) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "/"))
        else:
            out[key] = v
    return out


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and callable(x.item):
        return x.item()
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return None  # JSON has no NaN; a null is explicit
    return x


def _wandb_init(run_dir, wandb_cfg, cfg):
    """wandb mirrors the JSONL; offline by default in configs, disabled in tests. Never fatal."""
    if not wandb_cfg or wandb_cfg.get("mode", "disabled") == "disabled":
        return None
    try:
        import wandb
        return wandb.init(project=wandb_cfg.get("project"), name=wandb_cfg.get("name") or Path(run_dir).name,
                          mode=wandb_cfg["mode"], dir=str(run_dir), config=cfg, resume="allow",
                          id=Path(run_dir).resolve().name.replace("/", "_")[:64])
    except Exception as e:  # noqa: BLE001
        print(f"[trace] wandb disabled: {e}", file=sys.stderr)
        return None


# ----------------------------------------------------------------------------------------------
# Checkpoint directory bookkeeping (model files via trace.models.save_checkpoint)
# ----------------------------------------------------------------------------------------------
def ckpt_root(run_dir) -> Path:
    return Path(run_dir) / "ckpt"


def latest_checkpoint(run_dir) -> Path | None:
    root = ckpt_root(run_dir)
    ptr = root / "latest"
    if not ptr.exists():
        return None
    p = root / ptr.read_text().strip()
    return p if (p / "config.json").exists() else None


def commit_checkpoint(run_dir, step_dir: Path, keep: int = 1) -> None:
    """Point `latest` at step_dir (atomic), then delete older step dirs beyond `keep`."""
    root = ckpt_root(run_dir)
    _atomic_write(root / "latest", step_dir.name)
    olds = sorted(p for p in root.glob("step_*") if p.is_dir() and p.name != step_dir.name)
    for p in olds[: max(0, len(olds) - (keep - 1))]:
        shutil.rmtree(p, ignore_errors=True)


def resolve_checkpoint(path) -> Path:
    """A model directory from: a model dir (has config.json), a run dir or its ckpt/ dir (latest)."""
    p = Path(path)
    if (p / "config.json").exists():
        return p
    for cand in (p, p.parent):
        latest = latest_checkpoint(cand)
        if latest is not None:
            return latest
    raise FileNotFoundError(f"no checkpoint at {str(p)!r} (need config.json, or a run dir with ckpt/latest)")


def save_run_checkpoint(run_dir, step: int, model, tokenizer, state: dict, keep: int = 1) -> Path:
    """Model (safetensors) + tokenizer + `trainer_state.pt` (optimizer, RNG, step, ...) into
    ckpt/step_XXXXXX, then the atomic `latest` pointer. A kill -9 before the pointer moves leaves the
    previous checkpoint as the resume point."""
    import torch

    from trace.models import save_checkpoint
    d = ckpt_root(run_dir) / f"step_{step:06d}"
    if d.exists():
        shutil.rmtree(d)
    save_checkpoint(model, tokenizer, d)
    torch.save({**state, "step": step}, d / "trainer_state.pt")
    commit_checkpoint(run_dir, d, keep=keep)
    return d


def load_trainer_state(ckpt_dir) -> dict:
    import torch
    return torch.load(Path(ckpt_dir) / "trainer_state.pt", weights_only=False)


def rng_state() -> dict:
    import random

    import torch
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(st: dict) -> None:
    import random

    import torch
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])


def mark_done(run_dir, info: dict | None = None) -> None:
    _atomic_write(Path(run_dir) / "done", json.dumps(info or {}) + "\n")


def set_threads(cfg: dict) -> None:
    import torch
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg["threads"]))


__all__ = [
    "ADVANTAGES", "DEFAULTS", "METHODS", "SCHEMA", "ConfigError", "MetricsLog", "apply_overrides",
    "base_parser", "ckpt_root", "collect_meta", "commit_checkpoint", "deep_merge", "dump_config",
    "latest_checkpoint", "load_config", "load_trainer_state", "mark_done", "prepare_run_dir", "read_metrics", "resolve_checkpoint",
    "rng_state", "save_run_checkpoint", "set_rng_state", "set_threads", "validate",
]
