"""Does an SFT base trained again match the committed one? Compares the two runs' logged losses.

    python workflow/scripts/rebuild_check.py COMMITTED_RUN_DIR REBUILT_RUN_DIR [--tol REL]

Exit 0 when every logged loss is equal bit for bit, or (with --tol > 0) within that relative difference;
prints one line saying which, or where the two part. scripts/gpu/profile_chunk.sh runs it before putting
a rebuilt checkpoint in place: a chunk's checkpoints stay on its machine, and a base that differs would start its arms
from another model than the committed runs'. Bit-equal is the default; a tolerance is for a base trained
before its SFT was deterministic on a GPU (trace/sft.py), and the chunk hands the line to the runs that
start from it (meta.json env TRACE_SFT_REBUILD).
Compared against: tests/workflow/test_rebuild_check.py.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def losses(run_dir) -> list:
    with open(Path(run_dir) / "metrics.jsonl") as f:
        return [json.loads(line).get("loss") for line in f if line.strip()]


def compare(committed: list, rebuilt: list, tol: float = 0.0) -> tuple[bool, str]:
    """(accepted, one line saying why)."""
    if committed == rebuilt:
        return True, f"identical ({len(committed)} logged losses)"
    if len(committed) != len(rebuilt):
        return False, f"{len(committed)} losses logged, {len(rebuilt)} rebuilt"
    rel = [abs(a - b) / max(abs(a), 1e-30) for a, b in zip(committed, rebuilt, strict=True)]
    first = next(i for i, (a, b) in enumerate(zip(committed, rebuilt, strict=True)) if a != b)
    worst = max(rel)
    what = (f"{sum(r > 0 for r in rel)} of {len(rel)} logged losses differ, first at line {first + 1}, largest "
            f"relative difference {worst:.3g}")
    if tol > 0 and worst <= tol:
        return True, f"within {tol:g}: {what}"
    return False, what


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("committed")
    ap.add_argument("rebuilt")
    ap.add_argument("--tol", type=float, default=0.0, help="accepted relative difference per logged loss (0: bit-equal)")
    a = ap.parse_args(argv)
    ok, why = compare(losses(a.committed), losses(a.rebuilt), a.tol)
    print(f"SFT rebuild of {a.committed}: {why}" + ("" if ok else "; not starting its runs"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
