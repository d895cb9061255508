"""The settings dataclasses (trace/settings.py): the one source of defaults and of the config schema, the kernel
switches with their environment overrides, and the migration of resolved configs written before keys had defaults."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import jsonschema
import pytest
import yaml

from trace import config as C
from trace import settings as S

ROOT = Path(__file__).resolve().parent.parent
LEAVES = {k: d for k, d, _ in S.fields_doc()}
NAMES: dict[str, list] = {}
for _k, _d in LEAVES.items():
    NAMES.setdefault(_k.rsplit(".", 1)[-1], []).append(_d)
# names that settings share with library parameters of their own meaning (an engine's `temperature`, a tensor's
# `fmt`, a generator's `seed` or `difficulty`): a default there is the library's, not a second default of the run's
LIBRARY_WORDS = {"model", "seed", "device", "threads", "name", "difficulty", "steps", "lr", "mode", "modes", "fmt",
                 "temperature", "max_new_tokens", "max_turns", "split", "method", "backend", "warmup", "init_ckpt",
                 "n_test", "project", "knobs"}


def test_defaults_are_the_dataclasses_and_validate():
    assert C.DEFAULTS == dataclasses.asdict(S.RunSettings())
    assert C.validate(C.DEFAULTS) == C.DEFAULTS
    assert all(doc.strip() for _, _, doc in S.fields_doc()), "every setting says what it sets"
    # one default of the alignment weight, and the typed view round-trips
    assert LEAVES["rl.align_coef"] == C.DEFAULTS["rl"]["align_coef"]
    assert dataclasses.asdict(S.RunSettings.from_dict(C.DEFAULTS)) == C.DEFAULTS


def test_schema_comes_from_the_annotations():
    rl = C.SCHEMA["properties"]["rl"]["properties"]
    assert rl["tis_cap"] == {"type": ["number", "null"], "exclusiveMinimum": 0}
    assert rl["experts"] == {"enum": ["auto", "loop", "grouped"]}
    assert C.SCHEMA["properties"]["eval"]["properties"]["modes"]["items"] == {"enum": ["bf16", "fp4"]}
    assert set(C.SCHEMA["properties"]) == {f.name for f in dataclasses.fields(S.RunSettings)}
    jsonschema.Draft202012Validator.check_schema(C.SCHEMA)
    with pytest.raises(C.ConfigError, match="config key 'engine.fp4_kernels'"):
        C.load_config(None, ["engine.fp4_kernels=sometimes"])


def _literal(node):
    try:
        return True, ast.literal_eval(node)
    except ValueError:
        return False, None


def _defaults_outside(path: Path):
    """(line, what) of every literal default of a setting written in `path`."""
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("get", "setdefault") \
                and len(n.args) == 2 and isinstance(n.args[0], ast.Constant) and n.args[0].value in NAMES:
            ok, value = _literal(n.args[1])
            if ok and value is not None and value in NAMES[n.args[0].value]:
                out.append((n.lineno, f".{n.func.attr}({n.args[0].value!r}, {value!r})"))
        pairs = []
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            pos = n.args.posonlyargs + n.args.args
            pairs = [(a.arg, d) for a, d in zip(pos[len(pos) - len(n.args.defaults):], n.args.defaults)]
            pairs += [(a.arg, d) for a, d in zip(n.args.kwonlyargs, n.args.kw_defaults) if d is not None]
        elif isinstance(n, ast.ClassDef):
            pairs = [(b.target.id, b.value) for b in n.body if isinstance(b, ast.AnnAssign)
                     and isinstance(b.target, ast.Name) and b.value is not None]
        for name, d in pairs:
            ok, value = _literal(d)
            if name in NAMES and name not in LIBRARY_WORDS and ok and value is not None:
                out.append((d.lineno, f"{name} = {value!r}"))
    return out


def test_no_setting_default_outside_the_settings():
    """A setting's default is written once, in trace/settings.py; code elsewhere refers to it (`RLSettings.x`) or
    reads the resolved config. Mirrors of outside classes (the OpenRLHF stand-ins) keep their libraries' defaults."""
    bad = []
    for top in ("trace", "workflow", "analysis", "benchmarks"):
        for p in sorted((ROOT / top).rglob("*.py")):
            if p.name in ("settings.py", "stand_ins.py"):
                continue
            bad += [f"{p.relative_to(ROOT)}:{line}: {what}" for line, what in _defaults_outside(p)]
    assert bad == []


def test_the_scan_finds_a_second_default(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("from dataclasses import dataclass\n@dataclass\nclass M:\n    align_coef: float = 0.1\n"
                 "def f(rl, clip_eps=0.2):\n    return rl.get('fmt', 'nvfp4')\n")
    assert [w for _, w in _defaults_outside(p)] == ["align_coef = 0.1", "clip_eps = 0.2", ".get('fmt', 'nvfp4')"]


def test_switch_reads_config_then_environment(monkeypatch):
    for var in S.ENV.values():
        monkeypatch.delenv(var, raising=False)
    try:
        S.use({})
        assert S.switch("engine.fp4_kernels") == "off" and S.switch("engine.fp4_crossover") is None
        S.use(C.load_config(None, ["engine.fp4_kernels=on", "engine.fp4_crossover='0,0'"]))
        assert S.switch("engine.fp4_kernels") == "on" and S.switch("engine.fp4_crossover") == "0,0"
        monkeypatch.setenv("TRACE_FP4_KERNELS", "auto")  # the variable overrides the run's value
        assert S.switch("engine.fp4_kernels") == "auto"
        monkeypatch.setenv("TRACE_FP4_KERNELS", "")  # empty = not set
        assert S.switch("engine.fp4_kernels") == "on"
        monkeypatch.setenv("TRACE_FP4_ATTN", "flash")
        with pytest.raises(ValueError, match="TRACE_FP4_ATTN must be one of"):
            S.switch("engine.fp4_attn")
    finally:
        S.use({})


def test_every_committed_run_config_migrates():
    """Each resolved config.yaml under results/ (written before some keys had defaults) migrates to a config that
    validates and lacks nothing of today's resolution."""
    paths = sorted(ROOT.glob("results/runs/**/config.yaml"))
    assert len(paths) > 100
    for p in paths:
        old = yaml.safe_load(p.read_text())
        new = C.validate(S.migrate(old))
        assert sorted(C.diff_keys(C.deep_merge(C.DEFAULTS, new), new)) == [], p
        assert set(S.migrate(new)) == set(new) and S.migrate(new) == new  # idempotent


def test_migration_fills_only_added_keys():
    cfg = C.load_config(None, ["rl.method=trace"])
    old = yaml.safe_load(C.dump_config(cfg))
    del old["engine"], old["rl"]["experts"], old["eval"]["split"]
    assert S.migrate(old) == cfg
    del old["rl"]["lr"]  # a key that always had its default: missing means a different config, not an old one
    assert "lr" not in S.migrate(old)["rl"]


def test_an_old_run_dir_resumes(tmp_path):
    """A run directory whose config.yaml predates the added keys is the same run (no 'different config' refusal)."""
    from trace import rundir

    cfg = C.load_config(None, ["rl.steps=1"])
    d = tmp_path / "run"
    d.mkdir()
    old = yaml.safe_load(C.dump_config(cfg))
    for key in S.ADDED:
        sec, name = key.split(".")
        old[sec].pop(name, None)
    old = {k: v for k, v in old.items() if v != {}}
    (d / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    rundir.prepare_run_dir(d, cfg, "rl")
    with pytest.raises(C.ConfigError, match="different config"):
        rundir.prepare_run_dir(d, C.deep_merge(cfg, {"rl": {"lr": 0.5}}), "rl")
