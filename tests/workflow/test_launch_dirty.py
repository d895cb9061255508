"""workflow/scripts/launch.py and a dirty tree: a pipeline run from tracked files that differ from HEAD stops with one
line before its run dir exists; TRACE_ALLOW_DIRTY=1 runs it and keeps the diff beside it; a copy that names its
launching commit (TRACE_GIT_COMMIT, a GPU machine's) is not checked."""
from __future__ import annotations

import sys

import pytest

from workflow.scripts import launch

DIFF = "diff --git a/x.py b/x.py\n-a\n+b\ndiff --git a/y.py b/y.py\n-c\n+d\n"


def _run(tmp_path, monkeypatch, capsys, diff=DIFF, **env):
    for k in ("TRACE_ALLOW_DIRTY", "TRACE_GIT_COMMIT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    calls = []
    monkeypatch.setattr(launch, "tracked_diff", lambda: calls.append(1) or diff)
    (tmp_path / "rl.yaml").write_text("seed: 0\n")
    out = tmp_path / "run"
    trainer = f"{sys.executable} -c 'import sys; open(sys.argv[sys.argv.index(\"--out\") + 1] + \"/done\", \"w\")'"
    rc = launch.main(["--stage", "rl", "--cmd", trainer, "--config", str(tmp_path / "rl.yaml"), "--out", str(out)])
    return rc, out, capsys.readouterr().err, calls


def test_a_dirty_tree_stops_the_launch_with_one_line(tmp_path, monkeypatch, capsys):
    rc, out, err, _ = _run(tmp_path, monkeypatch, capsys)
    assert rc == 1 and not out.exists()
    assert err.count("\n") == 1 and "tracked files differ from HEAD (2 file(s))" in err and "TRACE_ALLOW_DIRTY" in err


@pytest.mark.parametrize("env,kept", [({"TRACE_ALLOW_DIRTY": "1"}, True), ({}, False)])
def test_override_keeps_the_patch_and_a_clean_tree_runs(tmp_path, monkeypatch, capsys, env, kept):
    rc, out, _, _ = _run(tmp_path, monkeypatch, capsys, diff=DIFF if kept else "", **env)
    assert rc == 0 and (out / "done").exists()
    assert (out / "dirty.patch").exists() == kept
    if kept:
        assert (out / "dirty.patch").read_text() == DIFF


def test_a_copy_that_names_its_commit_is_not_checked(tmp_path, monkeypatch, capsys):
    rc, out, _, calls = _run(tmp_path, monkeypatch, capsys, TRACE_GIT_COMMIT="0" * 40)
    assert rc == 0 and not calls and not (out / "dirty.patch").exists()
