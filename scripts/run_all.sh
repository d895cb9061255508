#!/usr/bin/env bash
# Reproduce the default (smoke) profile from a fresh clone: install the pinned environment, then run
# the whole Snakemake pipeline (sft -> rl -> eval -> bench -> tables -> figures).
#   bash scripts/run_all.sh                          # smoke, CORES=2 (about 10 min on 2 CPU cores)
#   CORES=8 bash scripts/run_all.sh --configfile experiments/profiles/small.yaml --resources gpu=1
# Extra arguments go to snakemake. Results: results/runs/<profile>/, results/tables/<profile>/,
# figures/<profile>/; logs: logs/<profile>/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export PATH="$PWD/.venv/bin:$PATH"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec snakemake all --cores "${CORES:-2}" "$@"
