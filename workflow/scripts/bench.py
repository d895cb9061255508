"""Run a speed benchmark when a CUDA GPU is present, otherwise skip it and point at the committed CSVs.

    python -m workflow.scripts.bench --what kernels --mode auto \
        --cmd "python benchmarks/bench_kernels.py --out results/kernels/kernels.csv" \
        --csv-dir results/kernels --status results/bench/smoke/kernels.json

Modes: ``auto`` runs the command only if ``torch.cuda.is_available()``; ``force`` always runs it (fails
without a GPU); ``skip`` never runs it. The status JSON says whether it ran, why not, and which CSVs the figures will
read (the long tables of benchmarks/results_table.py, which a run appends to).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import subprocess
import sys
import time


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # torch missing or broken: no GPU benchmark possible
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", required=True)
    ap.add_argument("--mode", choices=["auto", "force", "skip"], default="auto")
    ap.add_argument("--cmd", required=True)
    ap.add_argument("--csv-dir", required=True)
    ap.add_argument("--status", required=True)
    a = ap.parse_args(argv)

    gpu = cuda_available()
    run = a.mode == "force" or (a.mode == "auto" and gpu)
    status = {"what": a.what, "mode": a.mode, "cuda": gpu, "ran": run, "cmd": a.cmd}
    if run:
        print(f"[bench] {a.what}: running {a.cmd}", flush=True)
        t0 = time.time()
        rc = subprocess.call(shlex.split(a.cmd))
        if rc != 0:
            print(f"[bench] {a.what}: benchmark failed with exit status {rc}", file=sys.stderr)
            return rc
        status["seconds"] = round(time.time() - t0, 1)
    else:
        why = "bench.mode is skip" if a.mode == "skip" else "no CUDA GPU on this machine"
        status["reason"] = why
        print(f"[bench] SKIPPED {a.what} benchmark ({why}); using the committed CSVs in {a.csv_dir}/",
              flush=True)
    csvs = sorted(glob.glob(os.path.join(a.csv_dir, "*.csv")))
    status["csvs"] = csvs
    if not csvs:
        print(f"[bench] note: no CSVs in {a.csv_dir}/ yet; the speedup figure will say so", flush=True)
    os.makedirs(os.path.dirname(a.status) or ".", exist_ok=True)
    with open(a.status, "w") as f:
        json.dump(status, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
