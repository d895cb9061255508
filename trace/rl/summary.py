"""Summarize RL run directories: mean mismatch metrics per run (for quick arm comparisons).

    python -m trace.rl.summary runs/smoke/rl_* [--last N]

Prints one row per run: method, steps, mean accuracy, k1, k3, mean/max |dlp|, ratio-outside fraction,
chi2, mean code-flip rate over logged layers, guidance bytes/token, and the last eval accuracy.
The JSONL files are the source; analysis/ builds the real tables from the same files.
"""
from __future__ import annotations

import argparse
import statistics as st
import sys
from pathlib import Path

from trace.config import read_metrics

COLS = ("accuracy", "k1", "k3", "dlp_abs_mean", "dlp_abs_max", "ratio_out_frac", "chi2", "guidance_bytes_per_token")


def summarize(run_dir, last: int | None = None) -> dict:
    recs = [r for r in read_metrics(Path(run_dir) / "metrics.jsonl") if "k3" in r]
    if last:
        recs = recs[-last:]
    out = {"run": str(run_dir), "method": recs[0]["method"] if recs else None, "steps": len(recs)}
    for c in COLS:
        vals = [r[c] for r in recs if r.get(c) is not None]
        out[c] = st.mean(vals) if vals else None
    flips = [st.mean(r["code_flip_rate"].values()) for r in recs if r.get("code_flip_rate")]
    out["code_flip_rate_mean"] = st.mean(flips) if flips else None
    evs = [r["eval_accuracy"] for r in read_metrics(Path(run_dir) / "metrics.jsonl") if "eval_accuracy" in r]
    out["eval_accuracy_last"] = evs[-1] if evs else None
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m trace.rl.summary")
    p.add_argument("runs", nargs="+")
    p.add_argument("--last", type=int, default=None, help="average over the last N steps only")
    a = p.parse_args(argv)
    rows = [summarize(r, a.last) for r in a.runs]
    keys = ["method", "steps", *COLS, "code_flip_rate_mean", "eval_accuracy_last"]
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        cells = []
        for k in keys:
            v = r[k]
            cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
