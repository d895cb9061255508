"""Long-format benchmark tables: one CSV per benchmark that every run appends to.

    results/kernels/kernels.csv   (benchmarks/bench_kernels.py)
    results/rollout/rollout.csv   (benchmarks/bench_rollout.py)

Each row is one measurement (or one correctness check) of one run; `version` (the kernel / engine
version under test), `commit`, `gpu` and `date` say which run it came from, so runs are compared by
filtering, never by file name. A run on the GPU machine appends to a fresh table there; bring it home
with `python benchmarks/results_table.py RUN.csv --into results/kernels/kernels.csv` (appends; a column
the older rows lack is added to them, empty).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import subprocess

KERNEL_FIELDS = ("version", "commit", "gpu", "date", "op", "shape", "provider", "median_us", "p20_us", "p80_us",
                 "ratio_vs_bf16", "ratio_vs_anchor", "gb_per_s", "pct_copy_bw", "ok", "config", "note")
ROLLOUT_FIELDS = ("version", "commit", "gpu", "date", "op", "shape", "provider", "batch", "prompt", "gen", "layers",
                  "dtype", "tokens_per_s", "ratio_vs_bf16", "elapsed_s", "ms_per_step", "prefill_s",
                  "decode_ms_per_step", "setup_s", "note")


def git_commit() -> str:
    """GIT_COMMIT when set (the GPU machine gets a copy of the tree without its git state), else HEAD."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip() or "unknown"
    except Exception:  # no git on the machine, or not a checkout
        return "unknown"


def today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def read(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def append(path: str, rows: list[dict], fields: tuple[str, ...] | list[str]) -> None:
    """Append rows to the table at `path` (created with `fields` as header if absent). A row key outside the
    header, or a header column outside `fields`, widens the table: it is rewritten once with the union of
    columns (old rows empty in the new ones). Existing rows are never dropped or reordered."""
    if not rows:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    old_header: list[str] = []
    if os.path.exists(path) and os.path.getsize(path) > 0:
        with open(path, newline="") as f:
            old_header = next(csv.reader(f), [])
    want = list(old_header) or list(fields)
    for k in list(fields) + [k for r in rows for k in r]:
        if k not in want:
            want.append(k)
    if old_header and want != old_header:
        old = read(path)
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=want)
            w.writeheader()
            w.writerows(old)
    new = not old_header
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=want, restval="")
        if new:
            w.writeheader()
        w.writerows(rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="append the rows of run tables to a long-format results table")
    ap.add_argument("src", nargs="+", help="run tables (CSV with a header) to append, in order")
    ap.add_argument("--into", required=True, help="the long table, e.g. results/kernels/kernels.csv")
    a = ap.parse_args(argv)
    for s in a.src:
        rows = read(s)
        # the run table's own columns (a row's keys, in its header's order): only those widen the long table
        append(a.into, rows, list(rows[0]) if rows else [])
        print(f"appended {len(rows)} rows of {s} to {a.into}")


if __name__ == "__main__":
    main()
