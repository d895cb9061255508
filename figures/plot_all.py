"""Every figure of one profile from its logged runs, tables and the committed benchmark CSVs.

    python -m figures.plot_all --runs results/runs/smoke --tables results/tables/smoke \
        --kernels results/kernels --rollout results/rollout --out figures/smoke

Runs figures.plot_runs (curves_reward, curves_mismatch, flip_rates, mismatch_vs_bytes, final_accuracy,
paired_differences)
figures.plot_speedups (speedups) and figures.plot_rollout (rollout); PNG + PDF each. This is what the pipeline's `plot` rule and the
`figures` target call; no GPU and no training needed.

FIGURES_INJECT_FAILURE=1 in the environment makes it fail after the run figures are written (before the
speedup and rollout figures): the check that a failed plotting job keeps every committed figure
(.ci/run).
"""
from __future__ import annotations

import argparse
import os

from figures.plot_rollout import plot_rollout
from figures.plot_runs import plot_all_runs
from figures.plot_speedups import plot_speedups


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", required=True)
    ap.add_argument("--tables")
    ap.add_argument("--manifest")
    ap.add_argument("--kernels", default="results/kernels")
    ap.add_argument("--rollout", default="results/rollout")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    written = plot_all_runs(a.runs, a.tables, a.out, a.manifest)
    if os.environ.get("FIGURES_INJECT_FAILURE"):
        raise RuntimeError("FIGURES_INJECT_FAILURE is set: failing after the run figures")
    written += plot_speedups(a.kernels, a.rollout, a.tables, a.out)
    written += plot_rollout(a.rollout, a.out)
    for p in written:
        print("wrote", p)


if __name__ == "__main__":
    main()
