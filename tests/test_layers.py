"""The import graph of trace/ (every import statement, module level or inside functions, read with ast):

    rank 0  settings                           the run settings (stdlib only: every layer reads its switches)
            fp4, models, tasks, arms, config,  formats, model families, tasks, the arm table, config schema,
            stats, gate, metrics               the clustered standard error, the SFT base gate, the metrics record
    rank 1  guidance                           the method: record, replay, statistics, alignment term
    rank 2  qat, rollout, rundir               adapters (HF model, engine) and run-directory bookkeeping
    rank 3  episode, integrations              one episode step; integrations may use anything below trainers
    rank 4  rl, sft, eval, export              trainers, the evaluator and the FP4 export command

No module imports a module of a higher rank, and there is no import cycle except inside the task
registry (trace/tasks/base.py registers the task modules that import it). fp4 is the bottom (it imports no
other package of trace/ but the settings, for its kernel switches), and guidance sits on fp4, the arm table and the
settings alone.

kernels/ is reached one way (the rule in trace/fp4/__init__.py): its numerics (`kernels.reference`,
`kernels.quantize`, `kernels.align`: formats, tables, quantization, the alignment term) only from trace/fp4; its compute kernels only from the
engine (trace/rollout); nothing else in trace/ imports kernels/.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "trace"
RANK = {"settings": 0, "fp4": 0, "models": 0, "tasks": 0, "arms": 0, "config": 0, "stats": 0, "gate": 0, "quiet": 0, "metrics": 0,
        "guidance": 1, "qat": 2,
        "rollout": 2, "rundir": 2, "episode": 3, "integrations": 3, "rl": 4, "sft": 4, "eval": 4,
        "export": 4}


def _modules() -> dict[str, Path]:
    out = {}
    for p in TRACE.rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _target(name: str) -> str | None:
    """The module file an imported dotted name runs: the longest known module prefix."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in MODULES:
            return ".".join(parts[:k])
    return None


def _imports(mod: str) -> set[str]:
    tree = ast.parse(MODULES[mod].read_text())
    pkg = mod if MODULES[mod].name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            # `from pkg import sub` runs pkg.sub when it is a module, else pkg itself
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for n in names:
            t = _target(n)
            if t is not None and t != mod and t != "trace":
                out.add(t)
    return out


GRAPH = {m: _imports(m) for m in MODULES}


def _kernel_imports(mod: str) -> set[str]:
    """The kernels/ modules `mod` imports (kernels.<module>), module level or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(MODULES[mod].read_text())):
        if isinstance(node, ast.Import):
            out |= {".".join(a.name.split(".")[:2]) for a in node.names if a.name.split(".")[0] == "kernels"}
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "kernels":
            if node.module == "kernels":
                out |= {f"kernels.{a.name}" for a in node.names}
            else:
                out.add(".".join(node.module.split(".")[:2]))
    return out


KERNEL_IMPORTS = {m: k for m in MODULES if (k := _kernel_imports(m))}
# formats, tables, (fake) quantization and the FP4 alignment term: via trace.fp4
NUMERICS = {"kernels.reference", "kernels.quantize", "kernels.align"}
ENGINE = {m for m in MODULES if m.startswith("trace.rollout.")}  # the engine launches the compute kernels


def _layer(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_layer_has_a_rank():
    assert {_layer(m) for m in MODULES} - {None} <= set(RANK), "add the new package to RANK and the layer list"


def test_no_lower_layer_imports_a_higher_one():
    bad = [f"{m} -> {t}" for m, ts in GRAPH.items() for t in ts
           if _layer(m) and _layer(t) and RANK[_layer(m)] < RANK[_layer(t)]]
    assert bad == []


def test_no_cycles_except_the_task_registry():
    import networkx as nx
    g = nx.DiGraph([(m, t) for m, ts in GRAPH.items() for t in ts])
    cycles = [c for c in nx.simple_cycles(g) if not all(_layer(m) == "tasks" for m in c)]
    assert cycles == []


@pytest.mark.parametrize("pair", [("trace.sft", "trace.eval"), ("trace.rollout.weights", "trace.qat")])
def test_known_past_couplings_stay_gone(pair):
    a, b = pair
    assert not any(t == b or t.startswith(b + ".") for t in GRAPH[a])
    assert a not in GRAPH.get(b, set())


def test_fp4_is_the_bottom_and_guidance_sits_on_it():
    allowed = {"settings": set(), "fp4": {"fp4", "settings"}, "guidance": {"guidance", "fp4", "arms", "settings"}}
    bad = [f"{m} -> {t}" for m, ts in GRAPH.items() if _layer(m) in allowed
           for t in ts if _layer(t) not in allowed[_layer(m)]]
    assert bad == []


def test_kernel_numerics_only_through_fp4():
    bad = [f"{m} imports {k}" for m, ks in KERNEL_IMPORTS.items() for k in ks & NUMERICS
           if _layer(m) != "fp4"]
    assert bad == [], "formats and quantization come from trace.fp4 (trace/fp4/__init__.py)"


def test_compute_kernels_only_from_the_engine():
    bad = [f"{m} imports {k}" for m, ks in KERNEL_IMPORTS.items() for k in ks - NUMERICS if m not in ENGINE]
    assert bad == [], "only the engine (trace/rollout) launches kernels/ (trace/fp4/__init__.py)"

