"""The GPU plan (experiments/gpu_plan.yaml): which unit of GPU work runs next, on a lent machine, and what came back.

    python -m workflow.scripts.gpu_plan status [--machine h100|h200] [--budget MIN]   # dry run, CPU
    TRACE_GIT_COMMIT=SHA python -m workflow.scripts.gpu_plan start [--budget MIN]       # on the GPU machine
    python -m workflow.scripts.gpu_plan unpack QUEUE.tgz [...] [--no-redraw]            # here, after a call
    python -m workflow.scripts.gpu_plan held --held-s S --gpu NAME [--note TEXT]         # a GPU machine's held time
    python -m workflow.scripts.gpu_plan table                                           # results/gpu/plan.md

`start` picks, in the plan's order, the units not done whose `after` units are done, that are not blocked, that the
machine can hold (h200 units need an H200) and that fit the budget together, prepends nothing else, and starts them
through scripts/gpu/queue.sh with OUT set per unit; plan_meta.json in the queue's folder says what was started, at
which commit and source tree. `unpack` reads a queue pack (queue.sh wait): every finished job becomes a ledger row
(results/gpu/ledger.csv: its seconds, exit code, commit, tree, GPU), every unit whose jobs all exited 0 has its
`collect` entries applied, then its `redraw` commands run and results/gpu/plan.md is written again.
"""
from __future__ import annotations

import argparse
import csv
import datetime as dt
import glob
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
PLAN = "experiments/gpu_plan.yaml"
LEDGER = "results/gpu/ledger.csv"
MACHINES_HELD = "results/gpu/machines.csv"
TABLE = "results/gpu/plan.md"
LEDGER_FIELDS = ["attempt", "date", "commit", "tree", "gpu", "unit", "job", "rc", "seconds"]
HELD_FIELDS = ["date", "gpu", "held_s", "note"]
STAGES = {"a": "GPU test suite", "b": "small-v2: SFT recipe and calibration", "c": "small-v2: decisive comparison",
          "d": "RL-step rows and the exact unit", "e": "OpenRLHF table", "f": "small-v2: the rest",
          "g": "medium learning run", "h": "kernels and cost per unit"}
MACHINES = ("h100", "h200")
CHUNK_PROFILE = "experiments/profiles/small-v2.yaml"
TREE_DIRS = ("trace", "kernels", "tests", "benchmarks")


def tree_hash(root: Path = ROOT) -> str:
    """scripts/gpu/gpu_tests.sh's source-tree hash: the *.py and *.yaml files under trace/ kernels/ tests/
    benchmarks/, concatenated in byte order of their paths, sha256, 16 hex digits."""
    paths = sorted(str(p.relative_to(root)) for d in TREE_DIRS for p in (root / d).rglob("*")
                   if p.is_file() and p.suffix in (".py", ".yaml"))
    h = hashlib.sha256()
    for p in sorted(paths, key=lambda s: s.encode()):
        h.update((root / p).read_bytes())
    return h.hexdigest()[:16]


@dataclass
class Unit:
    name: str
    stage: str
    machine: str
    minutes: float
    basis: str
    jobs: list[tuple[int, str, str]] = field(default_factory=list)
    collect: list[dict] = field(default_factory=list)
    done: dict = field(default_factory=dict)
    after: list[str] = field(default_factory=list)
    blocked: str = ""
    redraw: list[str] = field(default_factory=list)


def _queue_lines(path: Path, names: list[str]) -> list[tuple[int, str, str]]:
    found = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            limit, name, cmd = line.split(None, 2)
            found[name] = (int(limit), name, cmd.replace("/tmp/rlstep/", "$OUT/"))
    missing = [n for n in names if n not in found]
    if missing:
        raise ValueError(f"{path}: no job named {missing}")
    return [found[n] for n in names]


def _chunk(u: dict, root: Path) -> None:
    """A profile chunk unit (model, arms, seeds[, task]): profile_chunk.sh narrowed to them; done when every run's
    eval.json is there."""
    from workflow.scripts.runplan import Plan
    plan = Plan(yaml.safe_load((root / CHUNK_PROFILE).read_text()))
    task = u.get("task", "reasoning")
    arms, seeds = u["arms"], [int(s) for s in u["seeds"]]
    limit = int(u["minutes"] * 60)
    env = f"ARMS={shlex.quote(' '.join(arms))} SEEDS={shlex.quote(' '.join(map(str, seeds)))}"
    u.setdefault("jobs", [[limit, "chunk", f"{env} bash scripts/gpu/profile_chunk.sh start {CHUNK_PROFILE} "
                                           f"{u['model']} {task} && bash scripts/gpu/profile_chunk.sh wait "
                                           f"{limit} $OUT/chunk.tgz"]])
    u.setdefault("collect", [{"from": "chunk.tgz", "how": "chunk", "to": "."}])
    u.setdefault("done", {"files": [f"{plan.run_dir(u['model'], task, a, s)}/eval.json" for a in arms for s in seeds]})
    u.setdefault("redraw", [f"snakemake figures --cores 2 --configfile {CHUNK_PROFILE}"])


def load(root: Path = ROOT, path: str = PLAN) -> tuple[dict, list[Unit]]:
    cfg = yaml.safe_load((root / path).read_text())
    units = []
    for u in cfg["units"]:
        u = dict(u)
        if "model" in u:
            _chunk(u, root)
        elif "arms" in u or "seeds" in u:
            raise ValueError(f"unit {u['name']}: arms / seeds without a model")
        if "jobs_from" in u:
            src = u.pop("jobs_from")
            u["jobs"] = _queue_lines(root / src["file"], src["names"])
        if u.get("machine") not in MACHINES:
            raise ValueError(f"unit {u['name']}: machine must be one of {MACHINES}")
        keys = {f for f in Unit.__dataclass_fields__}
        extra = set(u) - keys - {"model", "arms", "seeds", "task"}
        if extra:
            raise ValueError(f"unit {u['name']}: unknown keys {sorted(extra)}")
        u["jobs"] = [(int(j[0]), str(j[1]), str(j[2])) for j in u.get("jobs", [])]
        units.append(Unit(**{k: v for k, v in u.items() if k in keys}))
    names = [u.name for u in units]
    if len(set(names)) != len(names):
        raise ValueError("unit names must be unique")
    for u in units:
        if unknown := [a for a in u.after if a not in names]:
            raise ValueError(f"unit {u.name}: after names unknown units {unknown}")
        if not u.jobs and not u.blocked:
            raise ValueError(f"unit {u.name}: no jobs and not blocked")
    return cfg, units


def read_csv(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def measured_s(unit: Unit, ledger: list[dict]) -> float | None:
    """The seconds of the unit's latest attempt whose jobs all passed (the sum over its jobs), None if none did: a
    failed job's seconds (a missing package, a unit held back) say nothing of what the unit takes."""
    rows = [r for r in ledger if r["unit"] == unit.name]
    passed = [a for a in {r["attempt"] for r in rows} if all(r["rc"] == "0" for r in rows if r["attempt"] == a)]
    if not passed:
        return None
    last = max(passed)
    return sum(float(r["seconds"]) for r in rows if r["attempt"] == last)


def minutes(unit: Unit, ledger: list[dict]) -> tuple[float, str]:
    """(minutes, "measured" | "estimate"): the latest passing attempt's, else the plan's estimate, raised to the
    longest failed attempt where one ran longer (a job stopped at its limit needs at least that)."""
    s = measured_s(unit, ledger)
    if s is not None:
        return s / 60, "measured"
    failed: dict[str, float] = {}
    for r in ledger:
        if r["unit"] == unit.name:
            failed[r["attempt"]] = failed.get(r["attempt"], 0.0) + float(r["seconds"])
    return max([float(unit.minutes), *(v / 60 for v in failed.values())]), "estimate"


def is_done(unit: Unit, ledger: list[dict], tree: str, root: Path = ROOT) -> bool:
    d = unit.done
    if "suite" in d:
        return any(r["unit"] == unit.name and r["tree"] == tree and r["rc"] == "0" for r in ledger)
    if "files" in d:
        return all(glob.glob(str(root / g)) for g in d["files"])
    if "rows" in d:
        want = d["rows"]["where"]
        return any(all(str(r.get(k, "")) == str(v) for k, v in want.items())
                   for r in read_csv(root / d["rows"]["file"]))
    raise ValueError(f"unit {unit.name}: done needs suite, files or rows")


def status_of(unit: Unit, done: dict[str, bool], budget: float, ledger: list[dict]) -> str:
    """done, blocked, waits for (an `after` unit not done: in `done`, a unit picked earlier in the same batch
    counts as done), too big for one machine, or ready."""
    if done[unit.name]:
        return "done"
    if unit.blocked:
        return f"blocked: {unit.blocked}"
    if waits := [a for a in unit.after if not done[a]]:
        return f"waits for {', '.join(waits)}"
    m, _ = minutes(unit, ledger)
    if m > budget:
        return f"too big for one machine ({m:.0f} > {budget:.0f} min): cut it or speed it up"
    return "ready"


def next_units(units: list[Unit], ledger: list[dict], tree: str, machine: str, budget: float,
               root: Path = ROOT) -> list[Unit]:
    """The units a machine of this kind runs next: in plan order, the first that are ready, on its kind, and fit
    what is left of the budget. A unit picked earlier in the batch satisfies a later one's `after` (the queue runs
    them in order, and `queue_lines` holds a unit back when one it waits for failed in the batch)."""
    done = {u.name: is_done(u, ledger, tree, root) for u in units}
    out, left = [], budget
    for u in units:
        if status_of(u, done, budget, ledger) != "ready" or (u.machine == "h200" and machine != "h200"):
            continue
        m, _ = minutes(u, ledger)
        if m <= left:
            out.append(u)
            left -= m
            done[u.name] = True
    return out


def queue_lines(units: list[Unit], qdir: str) -> list[str]:
    """scripts/gpu/queue.sh's `LIMIT NAME COMMAND` lines; each command runs with OUT = the unit's folder, and not at
    all (exit 3) when a unit it waits for (`after`) ran earlier in the batch and one of its jobs failed."""
    lines, batch = [], {u.name for u in units}
    for u in units:
        d = f"{qdir}/out/{u.name}"
        gate = ""
        if deps := [a for a in u.after if a in batch]:
            pat = "|".join(deps)
            gate = (f"awk -v p='^({pat})__' '$1 ~ p && $2 != 0 {{bad = 1}} END {{exit bad}}' {qdir}/jobs.txt "
                    f"|| {{ echo 'held back: {pat} failed in this batch'; exit 3; }}; ")
        for limit, name, cmd in u.jobs:
            lines.append(f"{limit} {u.name}__{name} {gate}mkdir -p {d} && export OUT={d} && {cmd}")
    return lines


def _gpu_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, check=True).stdout.splitlines()[0].strip()
    except (OSError, subprocess.CalledProcessError, IndexError):
        return ""


MAX_BUDGET_MINUTES = 60


def cmd_start(args) -> int:
    gpu = _gpu_name()
    if not gpu:
        print("no GPU visible: nothing started (the dry run is `status`)", file=sys.stderr)
        return 1
    machine = "h200" if "H200" in gpu else "h100"
    commit = os.environ.get("TRACE_GIT_COMMIT") or os.environ.get("GIT_COMMIT")
    if not commit:  # a copy's .git may be older than its files: the caller names the commit it sent
        print("error: set TRACE_GIT_COMMIT to the commit whose files this copy holds (git rev-parse HEAD where it "
              "was sent from, with a clean tree)", file=sys.stderr)
        return 2
    cfg, units = load()
    budget = args.budget or cfg["budget_minutes"]
    if budget > MAX_BUDGET_MINUTES:
        print(f"error: --budget is in minutes of one lent machine (held at most 30); got {budget:g}", file=sys.stderr)
        return 2
    ledger = read_csv(ROOT / LEDGER)
    tree = tree_hash()
    picked = next_units(units, ledger, tree, machine, budget)
    if not picked:
        print(f"no unit of the plan is ready for an {machine} within {args.budget or cfg['budget_minutes']} min")
        return 0
    qdir = os.environ.get("QDIR", "/tmp/trace-queue")
    jobs = Path(tempfile.mkstemp(suffix=".jobs")[1])
    jobs.write_text("\n".join(queue_lines(picked, qdir)) + "\n")
    # queue.sh installs the plan's carried wheel folder for the jobs (scripts/gpu/env.sh)
    env = dict(os.environ, QDIR=qdir, TRACE_GIT_COMMIT=commit, GIT_COMMIT=commit, WHEELS=cfg.get("wheels", ""))
    passed = [r for r in ledger if r["unit"] == "gpu-suite" and r["tree"] == tree and r["rc"] == "0"]
    if passed:  # the suite passed for this source tree on a machine of the ledger: chunks record that, not run it
        p = passed[-1]
        env["TRACE_GPU_TESTS"] = (f"GPU tests (full) passed for tree {tree} at commit {p['commit']} on {p['gpu']} "
                                  f"({p['date']}, results/gpu/ledger.csv)")
    r = subprocess.run(["bash", str(ROOT / "scripts/gpu/queue.sh"), "start", str(jobs)], cwd=ROOT, env=env)
    if r.returncode:
        return r.returncode
    meta = {"attempt": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "commit": commit,
            "tree": tree, "gpu": gpu, "units": [u.name for u in picked]}
    (Path(qdir) / "plan_meta.json").write_text(json.dumps(meta, indent=1))
    for u in picked:
        print(f"started {u.name} ({minutes(u, ledger)[0]:.0f} min, {len(u.jobs)} job(s))")
    return 0


def _append_rows(src: Path, dest: Path) -> int:
    """CSV rows of src appended to dest (header from src if dest is new); rows already in dest are skipped. A column
    of src that dest lacks widens dest: it is rewritten once with the new columns after its own, empty in its rows,
    as benchmarks/results_table.py's append does (a benchmark that gained a column still comes home); a column of
    dest that src lacks is empty in src's rows. dest keeps its line ending."""
    with open(src, newline="") as f:
        rows = list(csv.reader(f))
    if not rows:
        return 0
    head, body = rows[0], [dict(zip(rows[0], r, strict=True)) for r in rows[1:]]
    dest.parent.mkdir(parents=True, exist_ok=True)
    old_head, old, end = [], [], "\n"
    if dest.exists() and dest.stat().st_size:
        with open(dest, newline="") as f:
            first = f.readline()
            end = "\r\n" if first.endswith("\r\n") else "\n"
            f.seek(0)
            old_rows = list(csv.reader(f))
        old_head = old_rows[0]
        old = [dict(zip(old_head, r, strict=True)) for r in old_rows[1:]]
    want = old_head + [c for c in head if c not in old_head]
    have = {tuple(o.get(c, "") for c in head) for o in old}
    new = [r for r in body if tuple(r[c] for c in head) not in have]
    if old_head and want != old_head:
        with open(dest, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=want, restval="", lineterminator=end)
            w.writeheader()
            w.writerows(old)
    with open(dest, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=want, restval="", lineterminator=end)
        if not old_head:
            w.writeheader()
        w.writerows(new)
    return len(new)


def _collect(entry: dict, unit_out: Path, root: Path) -> str:
    src, how = unit_out / entry["from"], entry["how"]
    if not src.exists():
        raise FileNotFoundError(f"{src.name} did not come back")
    dest = root / entry["to"]
    if how == "rows":
        return f"{_append_rows(src, dest)} rows -> {entry['to']}"
    if how == "copy":
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)
        return f"-> {entry['to']}"
    if how == "lines":
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(dest, "a") as f:
            f.write(src.read_text().rstrip("\n") + "\n")
        return f"appended -> {entry['to']}"
    if how == "chunk":
        r = subprocess.run(["bash", str(root / "scripts/gpu/unpack_chunk.sh"), str(src)], cwd=root,
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"unpack_chunk.sh {src.name}: {r.stderr.strip()[-300:]}")
        return f"unpacked {src.name}"
    raise ValueError(f"collect how must be rows, copy, lines or chunk, not {how!r}")


def unpack(packs: list[Path], root: Path = ROOT, redraw: bool = True) -> list[str]:
    """Apply queue packs to `root`: ledger rows, collected results, plan.md. -> the report's lines."""
    _, units = load(root)
    by_name = {u.name: u for u in units}
    out = []
    for pack in packs:
        with tempfile.TemporaryDirectory() as tmp, tarfile.open(pack) as t:
            t.extractall(tmp, filter="data")
            qdirs = [p.parent for p in Path(tmp).rglob("plan_meta.json")]
            if len(qdirs) != 1:
                raise ValueError(f"{pack}: not a plan queue's pack (plan_meta.json)")
            q = qdirs[0]
            meta = json.loads((q / "plan_meta.json").read_text())
            finished = [line.split() for line in (q / "jobs.txt").read_text().splitlines() if line.strip()]
            ledger = read_csv(root / LEDGER)
            seen = {(r["attempt"], r["unit"], r["job"]) for r in ledger}
            before = {u for a, u, _ in seen if a == meta["attempt"]}  # units this pack's unpack applied already
            rows = []
            for name, rc, secs in finished:
                unit, job = name.split("__", 1)
                if (meta["attempt"], unit, job) not in seen:
                    rows.append({"attempt": meta["attempt"], "date": meta["attempt"][:10], "commit": meta["commit"],
                                 "tree": meta["tree"], "gpu": meta["gpu"], "unit": unit, "job": job, "rc": rc,
                                 "seconds": secs})
            _write_rows(root / LEDGER, LEDGER_FIELDS, rows)
            ran = {}
            for name, rc, _ in finished:
                ran.setdefault(name.split("__", 1)[0], []).append(rc)
            for name in meta["units"]:
                u = by_name.get(name)
                rcs = ran.get(name, [])
                if u is None:
                    out.append(f"{name}: not in the plan any more; ledger rows only")
                elif name in before and len(rcs) == len(u.jobs):
                    out.append(f"{name}: unpacked before")
                elif len(rcs) < len(u.jobs):
                    out.append(f"{name}: unfinished ({len(rcs)} of {len(u.jobs)} jobs came back)")
                elif any(rc != "0" for rc in rcs):
                    out.append(f"{name}: FAILED (exit codes {rcs}); logs in the pack: {name}__*.log")
                else:
                    done = [_collect(e, q / "out" / name, root) for e in u.collect]
                    out.append(f"{name}: ok; " + "; ".join(done))
                    if redraw:
                        for c in u.redraw:
                            _run_here(c, root)
    table(root)
    return out


def _run_here(command: str, root: Path) -> None:
    """A redraw command with this interpreter (`python` -> sys.executable, `snakemake` -> its module)."""
    argv = shlex.split(command)
    if argv[0] == "python":
        argv[0] = sys.executable
    elif argv[0] == "snakemake":
        argv = [sys.executable, "-m", "snakemake", *argv[1:]]
    subprocess.run(argv, cwd=root, check=True, env=dict(os.environ, PYTHONPATH=str(root)))


def _write_rows(path: Path, fields: list[str], rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, lineterminator="\n")
        if new:
            w.writeheader()
        w.writerows(rows)


def table(root: Path = ROOT) -> str:
    cfg, units = load(root)
    ledger = read_csv(root / LEDGER)
    held = read_csv(root / MACHINES_HELD)
    tree = tree_hash(root)
    budget = float(cfg["budget_minutes"])
    done = {u.name: is_done(u, ledger, tree, root) for u in units}
    lines = ["# GPU plan", "", "Generated by `python -m workflow.scripts.gpu_plan table` from experiments/gpu_plan.yaml, "
             "results/gpu/ledger.csv (one row per job that ran: its seconds) and results/gpu/machines.csv (GPU machine "
             "time held, starts and installs included). Minutes: measured where the ledger has the unit's latest attempt, "
             "else the plan's estimate. Status at the current source tree.", "",
             "| stage | unit | machine | minutes | from | status |", "|---|---|---|---|---|---|"]
    for u in units:
        m, src = minutes(u, ledger)
        lines.append(f"| {u.stage} | {u.name} | {u.machine} | {m:.1f} | {src} | "
                     f"{status_of(u, done, budget, ledger)} |")
    lines += ["", "| stage | what | units | done | minutes measured | minutes still to go |", "|---|---|---|---|---|---|"]
    total_left = 0.0
    for s, what in STAGES.items():
        us = [u for u in units if u.stage == s]
        if not us:
            continue
        meas = sum(measured_s(u, ledger) or 0 for u in us) / 60
        left = sum(minutes(u, ledger)[0] for u in us if not done[u.name])
        total_left += left
        lines.append(f"| {s} | {what} | {len(us)} | {sum(done[u.name] for u in us)} | {meas:.1f} | {left:.0f} |")
    jobs_s = sum(float(r["seconds"]) for r in ledger)
    held_s = sum(float(r["held_s"]) for r in held)
    lines += ["", f"GPU time spent: {jobs_s / 60:.1f} min in the ledger's jobs; {held_s / 60:.1f} min held by "
                  f"{len(held)} GPU machine(s). Still to go by the plan: {total_left / 60:.1f} GPU-hours "
                  f"({sum(not d for d in done.values())} units)."]
    text = "\n".join(lines) + "\n"
    (root / TABLE).parent.mkdir(parents=True, exist_ok=True)
    (root / TABLE).write_text(text)
    return text


def cmd_status(args) -> int:
    cfg, units = load()
    ledger = read_csv(ROOT / LEDGER)
    tree = tree_hash()
    budget = float(args.budget or cfg["budget_minutes"])
    done = {u.name: is_done(u, ledger, tree) for u in units}
    print(f"source tree {tree}; {sum(done.values())} of {len(units)} units done")
    for u in units:
        m, src = minutes(u, ledger)
        print(f"  {u.stage} {u.name:34s} {u.machine} {m:5.1f} min ({src:8s}) {status_of(u, done, budget, ledger)}")
    for machine in ([args.machine] if args.machine else MACHINES):
        picked = next_units(units, ledger, tree, machine, budget)
        names = ", ".join(f"{u.name} ({minutes(u, ledger)[0]:.0f} min)" for u in picked) or "nothing"
        print(f"next on an {machine} within {budget:.0f} min: {names}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workflow.scripts.gpu_plan", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("status")
    s.add_argument("--machine", choices=MACHINES)
    s.add_argument("--budget", type=float)
    s = sub.add_parser("start")
    s.add_argument("--budget", type=float)
    s = sub.add_parser("unpack")
    s.add_argument("packs", nargs="+", type=Path)
    s.add_argument("--no-redraw", action="store_true")
    s = sub.add_parser("held")
    s.add_argument("--held-s", type=float, required=True)
    s.add_argument("--gpu", required=True)
    s.add_argument("--note", default="")
    sub.add_parser("table")
    a = ap.parse_args(argv)
    if a.cmd == "status":
        return cmd_status(a)
    if a.cmd == "start":
        return cmd_start(a)
    if a.cmd == "unpack":
        for line in unpack(a.packs, redraw=not a.no_redraw):
            print(line)
        return 0
    if a.cmd == "held":
        _write_rows(ROOT / MACHINES_HELD, HELD_FIELDS, [{"date": dt.date.today().isoformat(), "gpu": a.gpu,
                                                    "held_s": a.held_s, "note": a.note}])
        table()
        return 0
    print(table(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
