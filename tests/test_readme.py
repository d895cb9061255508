"""README checks: what a new user reads must hold in the checkout.

- no tracked text file points outside the repository at the design notes' private copy (the design
  document is docs/DESIGN.md);
- every repository path the README names in backticks exists (braces and globs expanded, ``<...>``
  placeholders cut off; paths under folders that only runs create, such as ``runs/`` or ``_fresh/``,
  are skipped);
- the two commands are in the README and their scripts parse; ``run_all.sh --fresh`` writes under a
  git-ignored folder;
- shell blocks call the project's interpreter (``.venv/bin/...``), never a bare ``python`` or
  ``snakemake`` that only works with the virtualenv activated.
"""
from __future__ import annotations

import glob
import itertools
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
FORBIDDEN = "../" + "shared"  # spelled in two parts so this file does not match itself


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p]


def test_test_module_names_are_unique():
    names = [os.path.basename(p) for p in _tracked() if p.startswith("tests/")
             and os.path.basename(p).startswith("test_") and p.endswith(".py")]
    clashes = sorted({n for n in names if names.count(n) > 1})
    assert not clashes, f"test modules with the same file name: {clashes}"


def test_no_reference_outside_the_repository():
    bad = []
    for path in _tracked():
        full = os.path.join(ROOT, path)
        if not os.path.isfile(full) or os.path.getsize(full) > 5_000_000:
            continue
        with open(full, "rb") as f:
            data = f.read()
        if b"\0" in data[:8192]:
            continue  # binary
        if FORBIDDEN.encode() in data:
            bad.append(path)
    assert not bad, f"{FORBIDDEN} referenced in {bad}"


def _expand_braces(s: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", s)
    if not m:
        return [s]
    return list(itertools.chain.from_iterable(
        _expand_braces(s[: m.start()] + alt + s[m.end():]) for alt in m.group(1).split(",")))


def _readme_paths() -> list[str]:
    roots = {p.split("/")[0] for p in _tracked()}
    paths = []
    blocks = re.findall(r"```bash\n(.*?)```", README, re.S)
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", README, flags=re.S))
    for span in inline + blocks:
        for tok in span.split():
            tok = tok.lstrip("(").rstrip(".,;:)")
            head = tok.split("<")[0]  # results/runs/<profile>/... -> results/runs/
            if "/" not in head and head not in roots:
                continue
            if head.split("/")[0] not in roots or "://" in tok:
                continue
            paths.append(head)
    return sorted(set(paths))


def test_readme_paths_exist():
    paths = _readme_paths()
    assert len(paths) > 20  # the extraction finds the README's paths at all
    missing = [p for p in paths if not any(glob.glob(os.path.join(ROOT, q)) for q in _expand_braces(p))]
    assert not missing, f"README names paths that do not exist: {missing}"


def test_the_two_commands():
    for cmd, script in (("bash scripts/run_all.sh", "scripts/run_all.sh"), ("bash scripts/test.sh", "scripts/test.sh")):
        assert f"\n{cmd} " in README, cmd
        r = subprocess.run(["bash", "-n", os.path.join(ROOT, script)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    assert "bash scripts/run_all.sh --fresh" in README
    r = subprocess.run(["git", "check-ignore", "-q", "_fresh/runs/x"], cwd=ROOT)
    assert r.returncode == 0, "_fresh/ (run_all.sh --fresh) must be git-ignored"


def test_shell_blocks_use_the_project_interpreter():
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in block.splitlines():
            cmd = line.strip()
            assert not re.match(r"(python3?|snakemake|pytest)\b", cmd), f"needs .venv/bin/: {cmd}"


def test_readme_is_for_users():
    """At most 300 lines, and no user command needs PYTHONPATH (commands run from the root as python -m)."""
    assert len(README.splitlines()) <= 300
    assert "PYTHONPATH" not in README
