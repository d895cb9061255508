"""workflow/scripts/gpu_plan.py and experiments/gpu_plan.yaml: the plan loads and every unit that is not blocked can
run (its scripts exist, its chunk's model and arms are the profile's), the dry run works, the selection keeps the
plan's order, the machine's kind, the budget and `after`, the queue lines are queue.sh's and hold a unit back when a
unit it waits for failed in the batch, and an unpack turns a queue pack into ledger rows and results exactly once."""
from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import yaml

from workflow.scripts import gpu_plan as gp
from workflow.scripts.runplan import Plan

ROOT = Path(__file__).resolve().parents[2]


def test_the_plan_loads_and_its_units_can_run():
    cfg, units = gp.load()
    assert units[0].name == "gpu-suite" and units[0].done == {"suite": "full"}
    assert [u.stage for u in units] == sorted(u.stage for u in units)  # the plan's order is issue 60's
    profile = Plan(yaml.safe_load((ROOT / gp.CHUNK_PROFILE).read_text()))
    arms = set(profile.arms) | set(profile.ablation_arms)
    chunks = 0
    for u in units:
        assert 0 < u.minutes and u.basis and u.collect or u.blocked, u.name
        if u.blocked:
            continue
        for limit, name, cmd in u.jobs:
            assert limit > 0 and re.fullmatch(r"[A-Za-z0-9_]+", name), (u.name, name)
            for path in re.findall(r"(?:scripts/gpu|benchmarks)/[\w/]+\.(?:sh|py)", cmd):
                assert (ROOT / path).exists(), (u.name, path)
        if m := re.search(r"ARMS='([^']+)' .*profile_chunk\.sh start " + gp.CHUNK_PROFILE, u.jobs[0][2]):
            assert set(m.group(1).split()) <= arms, u.name
            chunks += 1
    assert chunks >= 12  # the decisive comparison's units (c) at least


def test_dry_run_prints_every_unit_and_the_next_ones():
    r = subprocess.run([sys.executable, "-m", "workflow.scripts.gpu_plan", "status"], cwd=ROOT, capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert r.returncode == 0, r.stderr
    _, units = gp.load()
    assert all(u.name in r.stdout for u in units)
    assert "next on an h100 within 25 min:" in r.stdout and "next on an h200 within 25 min:" in r.stdout


def test_tree_hash_is_the_gpu_suites():
    """gpu_tests.sh stamps a passing suite with this hash; the plan's suite unit is done for that tree only."""
    sh = ("find trace kernels tests benchmarks \\( -name '*.py' -o -name '*.yaml' \\) -type f | LC_ALL=C sort "
          "| xargs cat | sha256sum | cut -c1-16")
    assert subprocess.run(["bash", "-c", sh], cwd=ROOT, capture_output=True, text=True).stdout.strip() == gp.tree_hash()


def _unit(name, minutes, machine="h100", after=(), blocked="", done=None, jobs=None, collect=()):
    return gp.Unit(name=name, stage="a", machine=machine, minutes=minutes, basis="test",
                   jobs=jobs or [(60, "j", "true")], collect=list(collect), done=done or {"files": [f"nope/{name}"]},
                   after=list(after), blocked=blocked)


def test_next_units_keep_order_kind_budget_and_after(tmp_path):
    units = [_unit("suite", 12, done={"suite": "full"}), _unit("big", 30), _unit("h200", 5, machine="h200"),
             _unit("needs", 10, after=["suite"]), _unit("blocked", 1, blocked="why"), _unit("later", 8, after=["x"]),
             _unit("x", 3), _unit("fill", 2)]
    pick = lambda machine, ledger=(): [u.name for u in gp.next_units(units, list(ledger), "T", machine, 25,  # noqa: E731
                                                                       tmp_path)]
    assert pick("h100") == ["suite", "needs", "x"]  # big is too big, h200 not on an H100, later waits for x
    assert pick("h200") == ["suite", "h200", "x", "fill"]  # needs (10) no longer fits after h200 (5)
    passed = [{"unit": "suite", "tree": "T", "rc": "0", "attempt": "1", "seconds": "600"}]
    assert pick("h100", passed) == ["needs", "x", "fill"]
    failed_elsewhere = [{"unit": "suite", "tree": "OTHER", "rc": "0", "attempt": "1", "seconds": "600"}]
    assert pick("h100", failed_elsewhere)[0] == "suite"  # a pass for another tree does not count
    # measured minutes replace the estimate: the suite's 10 measured leave room for fill
    assert gp.minutes(units[0], failed_elsewhere) == (10.0, "measured")
    # a failed attempt does not measure the unit: a quick failure leaves the estimate, a long one raises it
    quick = failed_elsewhere + [{"unit": "suite", "tree": "T", "rc": "1", "attempt": "2", "seconds": "6"}]
    assert gp.minutes(units[0], quick) == (10.0, "measured")
    assert gp.minutes(units[0], quick[1:]) == (12.0, "estimate")
    assert gp.minutes(units[0], [{**quick[1], "rc": "124", "seconds": "900"}]) == (15.0, "estimate")


def test_queue_lines_are_queue_sh_lines_and_hold_back_after_a_failure(tmp_path):
    units = [_unit("suite", 12, jobs=[(900, "suite", "exit 1")]), _unit("needs", 5, after=["suite"],
                                                                      jobs=[(60, "run", "echo ran > $OUT/r")])]
    lines = gp.queue_lines(units, str(tmp_path))
    for line in lines:
        limit, name, cmd = line.split(None, 2)
        assert int(limit) > 0 and "__" in name and f"export OUT={tmp_path}/out/" in cmd
    cmd = lines[1].split(None, 2)[2]
    (tmp_path / "jobs.txt").write_text("suite__suite 1 600\n")
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True)
    assert r.returncode == 3 and "held back" in r.stdout and not (tmp_path / "out/needs/r").exists()
    (tmp_path / "jobs.txt").write_text("suite__suite 0 600\n")
    assert subprocess.run(["bash", "-c", cmd]).returncode == 0 and (tmp_path / "out/needs/r").read_text() == "ran\n"


def _pack(tmp_path, meta, jobs, files) -> Path:
    q = tmp_path / "pack" / "trace-queue"
    q.mkdir(parents=True)
    (q / "plan_meta.json").write_text(json.dumps(meta))
    (q / "jobs.txt").write_text("".join(f"{j}\n" for j in jobs))
    for rel, text in files.items():
        (q / rel).parent.mkdir(parents=True, exist_ok=True)
        (q / rel).write_text(text)
    out = tmp_path / "queue.tgz"
    with tarfile.open(out, "w:gz") as t:
        t.add(q, arcname="trace-queue")
    return out


def test_unpack_records_every_job_and_applies_only_finished_units(tmp_path):
    root = tmp_path / "repo"
    (root / "experiments").mkdir(parents=True)
    plan = {"version": 1, "budget_minutes": 25, "wheels": ".whl-pipe", "units": [
        {"name": "rows", "stage": "a", "machine": "h100", "minutes": 5, "basis": "t", "jobs": [[60, "a", "true"]],
         "collect": [{"from": "t.csv", "how": "rows", "to": "results/t.csv"},
                     {"from": "line.txt", "how": "lines", "to": "results/lines.txt"}],
         "done": {"rows": {"file": "results/t.csv", "where": {"v": "m9"}}}},
        {"name": "fails", "stage": "b", "machine": "h100", "minutes": 5, "basis": "t", "jobs": [[60, "a", "true"]],
         "collect": [{"from": "x.json", "how": "copy", "to": "results/x.json"}], "done": {"files": ["results/x.json"]}},
        {"name": "cut", "stage": "c", "machine": "h100", "minutes": 5, "basis": "t",
         "jobs": [[60, "a", "true"], [60, "b", "true"]],
         "collect": [{"from": "y.json", "how": "copy", "to": "results/y.json"}], "done": {"files": ["results/y.json"]}},
    ]}
    (root / gp.PLAN).write_text(yaml.safe_dump(plan))
    (root / "results").mkdir()
    (root / "results/t.csv").write_text("v,x\nm1,1\n")
    meta = {"attempt": "2026-01-01T00:00:00Z", "commit": "c0ffee", "tree": "T", "gpu": "NVIDIA H100",
            "units": ["rows", "fails", "cut"]}
    pack = _pack(tmp_path, meta, ["rows__a 0 100", "fails__a 1 50", "cut__a 0 70"],
                 {"out/rows/t.csv": "v,x\nm1,1\nm9,2\n", "out/rows/line.txt": "suite passed\n",
                  "out/fails/x.json": "{}", "out/cut/y.json": "{}"})
    report = gp.unpack([pack], root=root, redraw=False)
    assert report[0].startswith("rows: ok") and "FAILED" in report[1] and "unfinished (1 of 2" in report[2]
    assert (root / "results/t.csv").read_text() == "v,x\nm1,1\nm9,2\n"  # the row already there is not repeated
    assert (root / "results/lines.txt").read_text() == "suite passed\n"
    assert not (root / "results/x.json").exists() and not (root / "results/y.json").exists()
    with open(root / gp.LEDGER) as f:
        ledger = list(csv.DictReader(f))
    assert [(r["unit"], r["job"], r["rc"], r["seconds"]) for r in ledger] == [
        ("rows", "a", "0", "100"), ("fails", "a", "1", "50"), ("cut", "a", "0", "70")]
    assert all(r["commit"] == "c0ffee" and r["tree"] == "T" for r in ledger)
    gp.unpack([pack], root=root, redraw=False)  # the same pack again: no new ledger rows, no new result rows
    with open(root / gp.LEDGER) as f:
        assert len(list(csv.DictReader(f))) == 3
    assert (root / "results/t.csv").read_text().count("m9") == 1
    text = (root / gp.TABLE).read_text()
    assert "| a | rows | h100 | 1.7 | measured | done |" in text and "| b | fails | h100 | 5.0 | estimate | ready |" in text  # a failure measures nothing


def test_rows_widen_a_table_that_lacks_a_column(tmp_path):
    """A benchmark that gained a column (bench_rlstep's mfu) still comes home: the table is widened once, its rows
    empty in the new column, a row already there is not repeated, and a source without the column still appends;
    the table keeps its line ending."""
    dest, src, older = tmp_path / "t.csv", tmp_path / "s.csv", tmp_path / "o.csv"
    dest.write_bytes(b"v,x\r\nm1,1\r\n")
    src.write_text("v,x,mfu\nm1,1,\nm2,2,0.3\n")
    assert gp._append_rows(src, dest) == 1
    assert dest.read_bytes() == b"v,x,mfu\r\nm1,1,\r\nm2,2,0.3\r\n"
    older.write_text("v,x\nm3,3\nm2,2\n")
    assert gp._append_rows(older, dest) == 1
    assert dest.read_bytes() == b"v,x,mfu\r\nm1,1,\r\nm2,2,0.3\r\nm3,3,\r\n"


def test_start_hands_the_wheels_to_the_queue_and_reads_the_budget_in_minutes(monkeypatch, tmp_path, capsys):
    """The jobs import trace.config (jsonschema): `start` names the plan's carried wheel folder to queue.sh, which
    installs it for the jobs; a budget beyond one machine's minutes (e.g. seconds given for minutes) is refused."""
    calls = []

    def fake_run(argv, cwd=None, env=None, **kw):
        calls.append((argv, env))
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(gp, "_gpu_name", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setenv("TRACE_GIT_COMMIT", "0" * 40)
    monkeypatch.setenv("QDIR", str(tmp_path / "q"))
    monkeypatch.setenv("SITE", str(tmp_path / "site"))
    (tmp_path / "q").mkdir()
    monkeypatch.setattr(gp.subprocess, "run", fake_run)
    assert gp.cmd_start(type("A", (), {"budget": 1700})()) == 2
    assert "in minutes" in capsys.readouterr().err and calls == []
    monkeypatch.setattr(gp, "load", lambda: ({"budget_minutes": 25, "wheels": "scripts"}, []))
    assert gp.cmd_start(type("A", (), {"budget": None})()) == 0  # nothing ready: nothing installed either
    monkeypatch.setattr(gp, "next_units", lambda *a: [gp.Unit("x", "a", "h100", 1.0, "test")])
    monkeypatch.setattr(gp, "queue_lines", lambda picked, qdir: ["1 x true"])
    assert gp.cmd_start(type("A", (), {"budget": None})()) == 0
    ((queue, env),) = calls
    assert queue[-2] == "start" and env["WHEELS"] == "scripts"
