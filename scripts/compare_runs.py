"""Compare the metrics of two trees of runs field by field, exactly: a refactor's check that a run's numbers did not move.

    python scripts/compare_runs.py OLD_DIR NEW_DIR

Every `metrics.jsonl` below OLD_DIR is paired with the file at the same relative path below NEW_DIR. Their lines are
paired in order, and every field of either line is compared by the JSON text of its value (so 0.1 and
0.10000000000000002, 1 and 1.0, -0.0 and 0.0, null and a missing field all differ), except the wall-clock ones: names
starting with `time_` and the throughputs and ratios of times (WALL_CLOCK). Prints one line per run and one per
difference; exits 1 when a field differs, a line count differs or a run is missing on either side, else 0.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

WALL_CLOCK = ("rollout_gen_tokens_per_s", "record_overhead", "tokens_per_s", "steps_per_s")


def wall_clock(name: str) -> bool:
    """Whether a metrics field is a wall-clock measurement (left out of the comparison)."""
    return name.startswith("time_") or name in WALL_CLOCK


def metrics_files(root: str) -> list[str]:
    """Relative paths of the metrics.jsonl files below `root`, sorted."""
    out = []
    for d, _dirs, files in os.walk(root):
        if "metrics.jsonl" in files:
            out.append(os.path.relpath(os.path.join(d, "metrics.jsonl"), root))
    return sorted(out)


def read_lines(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def compare_run(old: list[dict], new: list[dict]) -> tuple[int, list[str]]:
    """(fields compared, differences as text) of two runs' metrics lines."""
    diffs, n = [], 0
    if len(old) != len(new):
        diffs.append(f"{len(old)} lines vs {len(new)}")
    for i, (a, b) in enumerate(zip(old, new, strict=False)):
        step = a.get("step", i)
        for k in sorted(set(a) | set(b)):
            if wall_clock(k):
                continue
            n += 1
            va = json.dumps(a[k], sort_keys=True) if k in a else "<absent>"
            vb = json.dumps(b[k], sort_keys=True) if k in b else "<absent>"
            if va != vb:
                diffs.append(f"step {step} {k}: {va} vs {vb}")
    return n, diffs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    a = ap.parse_args(argv)
    olds, news = metrics_files(a.old), metrics_files(a.new)
    bad = 0
    for rel in sorted(set(news) - set(olds)):
        print(f"only in {a.new}: {rel}")
        bad += 1
    runs = fields = lines = 0
    for rel in olds:
        if rel not in news:
            print(f"only in {a.old}: {rel}")
            bad += 1
            continue
        old, new = read_lines(os.path.join(a.old, rel)), read_lines(os.path.join(a.new, rel))
        n, diffs = compare_run(old, new)
        runs, fields, lines = runs + 1, fields + n, lines + len(old)
        print(f"{os.path.dirname(rel)}: {len(old)} lines, {n} fields, {len(diffs)} differing")
        for d in diffs:
            print(f"  {d}")
        bad += len(diffs)
    print(f"{runs} runs, {lines} lines, {fields} fields compared (wall-clock fields left out), {bad} differences")
    return 1 if bad or not runs else 0


if __name__ == "__main__":
    sys.exit(main())
