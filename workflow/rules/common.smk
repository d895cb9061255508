# Shared definitions: the run plan of the loaded profile, paths, wildcard constraints, helpers.
import json
import os
import sys

sys.path.insert(0, os.path.join(workflow.basedir, "workflow", "scripts"))
from runplan import EVAL_PRIORITY, CalibrationMissing, Plan  # noqa: E402

PLAN = Plan(config)
# a profile whose arms read their alignment coefficient from calibration files (align_calibration) stops here, with
# one line naming the first missing file, before any job exists
try:
    PLAN.check_calibration()
except CalibrationMissing as e:
    sys.exit(f"error: {e}")
PROFILE = PLAN.profile
RUNS = PLAN.runs_dir
TABLES = PLAN.tables_dir
FIGS = PLAN.figures_dir
LOGS = f"logs/{PROFILE}"
RES = config["resources"]


def gpu_slots(stage: str) -> int:
    """`--gpu-slots` for a stage's jobs: the profile's runs per GPU when the stage asks for a gpu, else 0
    (workflow/scripts/launch.py pins each job to one GPU; `--resources gpu=GPUs x slots` caps them)."""
    return int(config.get("gpu_slots_per_device", 1)) if RES[stage].get("gpu", 0) > 0 else 0

BENCH = config.get("bench", {}) or {}
# Every rule runs from the repo root with the root on PYTHONPATH (the package `trace` shadows the
# stdlib module only there) and the interpreter running Snakemake first on PATH (so `python` is the
# project's environment); set here in the environment, not in the shell commands, so that the rules'
# code does not depend on where the checkout lives. Threads cap BLAS/OpenMP per job.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
os.environ["PYTHONPATH"] = os.pathsep.join(
    [workflow.basedir] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
)
ENV = "export OMP_NUM_THREADS={threads} MKL_NUM_THREADS={threads} TQDM_DISABLE=1;"

wildcard_constraints:
    model=r"[a-z0-9_]+-(tiny|small|medium|paper)",
    task=r"reasoning-short|reasoning|coding|program|long_horizon",
    arm=r"(?!sft/)[A-Za-z0-9_.]+(-[A-Za-z0-9_.]+)*",  # never the SFT base's folder
    sftdir=r"sft(/seed\d+)?",
    seed=r"\d+",

RUN_DONE = [f"{PLAN.run_dir(r.model, r.task, r.arm, r.seed)}/done" for r in PLAN.runs]
RUN_EVAL = PLAN.run_evals()
MANIFEST = f"{RUNS}/manifest.json"
# The learning check (analysis/learning.py): the arm's final policies against their SFT base, evaluated
# with the arm's first-seed run config (same prompts, samples and sampling seed as every final eval).
LEARNING = PLAN.learning
BASE_EVAL = PLAN.base_evals()
# gputime: the GPU time of the profile's jobs (analysis/gputime.py; no job on a GPU: an empty table);
# compare: arm against arm, paired by seed and prompt, and within prompt groups (analysis/compare.py)
TABLE_FILES = [f"{TABLES}/{name}.{ext}" for name in ("main", "ablation", "gputime", "compare", "compare_groups", "claims")
               for ext in ("csv", "md")] + [f"{TABLES}/runs.csv", f"{TABLES}/REPORT.md"] + ([f"{TABLES}/learning.{ext}" for ext in ("csv", "md")] if LEARNING else [])
FIGURE_NAMES = ["curves_reward", "curves_mismatch", "ablation_mismatch", "flip_rates", "mismatch_vs_bytes", "final_accuracy",
                "paired_differences", "speedups"]
FIGURE_FILES = [f"{FIGS}/{n}.{ext}" for n in FIGURE_NAMES for ext in ("png", "pdf")]
BENCH_STATUS = [f"results/bench/{PROFILE}/{what}.json" for what in ("kernels", "rollout")]
