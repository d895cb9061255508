"""No module of trace/ or kernels/ uses another module's private (underscore) names.

A name that starts with one underscore (or two, without the trailing pair of a dunder) belongs to the module
that defines it. Read with ast, every .py file under trace/ and kernels/ is checked for three kinds of use:

  (a) import      `from trace.rollout.decode import _StopText`, where the source module is one of ours;
  (b) module      `decode._StopText`, where `decode` is a name bound to one of our modules by an import;
  (c) attribute   `eng._chunk(...)` (or `getattr(eng, "_chunk")`) on anything but `self`, `cls` or `super()`,
                  where `_chunk` is not defined in the module that uses it but is defined in another module of
                  ours (as a function, class, method, class attribute, module-level name or `self._x =`).

Names that only third-party code defines (`tensor._version`, `torch._dynamo`) are not ours and pass; a module
whose own name is private (kernels/_common.py, shared by the kernels) may be imported from, but its private
names may not.
"""
from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("trace", "kernels")

def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def module_name(path: str) -> str:
    parts = path[: -len(".py")].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(current: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module name of a (possibly relative) `from ... import`."""
    if not node.level:
        return node.module or ""
    base = current.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _defined(tree: ast.Module) -> set[str]:
    """The private names a module defines: module-level names, functions and classes at any depth, class
    attributes, and attributes assigned on `self`/`cls`."""
    names: set[str] = set()

    def targets(t: ast.AST) -> Iterable[ast.AST]:
        if isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                yield from targets(e)
        elif isinstance(t, ast.Starred):
            yield from targets(t.value)
        else:
            yield t

    def body_names(body: list[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]:
                    for n in targets(t):
                        if isinstance(n, ast.Name):
                            names.add(n.id)
            elif isinstance(stmt, (ast.If, ast.Try, ast.With, ast.For)):
                for field in ("body", "orelse", "finalbody"):
                    body_names(getattr(stmt, field, []) or [])
                for h in getattr(stmt, "handlers", []):
                    body_names(h.body)

    body_names(tree.body)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            body_names(node.body)
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for n in targets(t):
                    if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                        names.add(n.attr)
    return {n for n in names if is_private(n)}


def _is_own(node: ast.AST) -> bool:
    """`self`, `cls` or `super()`: access to the object's own (possibly inherited) members."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def violations(sources: dict[str, str]) -> list[tuple[str, int, str, str]]:
    """(path, line, name, kind) for every cross-module use of a private name among `sources`, a map of
    repository-relative paths (trace/x/y.py) to their text."""
    trees = {path: ast.parse(text, filename=path) for path, text in sources.items()}
    modules = {module_name(p): p for p in trees}
    defined = {p: _defined(t) for p, t in trees.items()}
    found: list[tuple[str, int, str, str]] = []
    for path, tree in trees.items():
        here = module_name(path)
        is_package = path.endswith("__init__.py")
        elsewhere = set().union(*(d for p, d in defined.items() if p != path))
        module_aliases: set[str] = set()  # names bound to one of our modules in this file
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _resolve(here, is_package, node)
                if source not in modules or modules[source] == path:
                    continue
                for alias in node.names:
                    if f"{source}.{alias.name}" in modules:  # a submodule: `from kernels import gemv`
                        module_aliases.add(alias.asname or alias.name)
                    elif is_private(alias.name):
                        found.append((path, node.lineno, alias.name, "import"))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules and alias.asname:
                        module_aliases.add(alias.asname)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and is_private(node.attr):
                if isinstance(node.value, ast.Name) and node.value.id in module_aliases:
                    found.append((path, node.lineno, node.attr, "module"))
                elif _dotted(node.value) in modules and modules[_dotted(node.value)] != path:
                    found.append((path, node.lineno, node.attr, "module"))
                elif not _is_own(node.value) and node.attr not in defined[path] and node.attr in elsewhere:
                    found.append((path, node.lineno, node.attr, "attribute"))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
                name = node.args[1].value
                if (is_private(name) and not _is_own(node.args[0]) and name not in defined[path]
                        and name in elsewhere):
                    found.append((path, node.lineno, name, "attribute"))
    return sorted(found)


def _dotted(node: ast.AST) -> str:
    """`a.b.c` for a chain of attribute accesses on a name, else ''."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    return ".".join([node.id, *reversed(parts)])


def _sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for d in PACKAGES for p in sorted((ROOT / d).rglob("*.py"))}


def test_no_module_uses_another_modules_private_names():
    sources = _sources()
    assert len(sources) > 50
    found = violations(sources)
    assert found == [], "cross-module use of private names:\n" + "\n".join(
        f"  {p}:{line}: {name} ({kind})" for p, line, name, kind in found)


def test_the_checker_flags_each_kind_of_use():
    engine = (
        "_LIMIT = 3\n"
        "class Engine:\n"
        "    def __init__(self):\n"
        "        self._cache = {}\n"
        "    def _chunk(self, n):\n"
        "        return self._cache.get(n)\n"
        "    def step(self, n):\n"
        "        return self._chunk(n)\n"
    )
    decode = (
        "import pkg.engine as eng_mod\n"
        "from pkg.engine import _LIMIT, Engine\n"
        "from pkg import engine\n"
        "def run(eng: Engine, t):\n"
        "    eng.step(1)\n"
        "    eng._chunk(1)\n"
        "    getattr(eng, '_cache')\n"
        "    t._version\n"
        "    eng.__class__\n"
        "    return eng_mod._LIMIT, engine._LIMIT\n"
        "class Sub(Engine):\n"
        "    def go(self):\n"
        "        return self._chunk(1), super()._chunk(2), self._cache\n"
    )
    found = violations({"pkg/__init__.py": "", "pkg/engine.py": engine, "pkg/decode.py": decode})
    assert [(line, name, kind) for _, line, name, kind in found] == [
        (2, "_LIMIT", "import"), (6, "_chunk", "attribute"), (7, "_cache", "attribute"),
        (10, "_LIMIT", "module"), (10, "_LIMIT", "module")]
    assert violations({"pkg/__init__.py": "", "pkg/engine.py": engine}) == []


def test_relative_imports_resolve():
    found = violations({"pkg/__init__.py": "", "pkg/a.py": "_X = 1\n", "pkg/b.py": "from .a import _X\n",
                        "pkg/sub/__init__.py": "from ..a import _X\n"})
    assert [(p, n) for p, _, n, _ in found] == [("pkg/b.py", "_X"), ("pkg/sub/__init__.py", "_X")]
