#!/usr/bin/env bash
# Install the pinned environment, then bring the Snakemake pipeline of a profile up to date
# (sft -> rl -> eval -> bench -> tables -> figures; default profile: smoke).
#
#   bash scripts/run_all.sh            # up to date against results/: on a clone with the committed
#                                      # smoke results nothing is trained; tables and figures are
#                                      # redrawn (byte-identical to the committed ones)
#   bash scripts/run_all.sh --fresh    # every job from scratch into _fresh/ (git-ignored, wiped first):
#                                      # _fresh/runs, _fresh/tables, _fresh/figures; compare
#                                      # _fresh/tables/main.md with results/tables/smoke/main.md
#   CORES=8 bash scripts/run_all.sh --configfile experiments/profiles/small.yaml --resources gpu=1
#
# Other arguments go to snakemake (e.g. -n for a dry run). FRESH_ROOT overrides _fresh.
# Logs: logs/<profile>/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
fresh=()
if [ "${1:-}" = "--fresh" ]; then
  shift
  root=${FRESH_ROOT:-_fresh}
  case " $* " in *" -n "*|*" --dry-run "*|*" --dryrun "*) ;; *) rm -rf "$root" ;; esac
  fresh=(--config "runs_dir=$root/runs" "tables_dir=$root/tables" "figures_dir=$root/figures")
  echo "[run_all] fresh run of every job into $root/ (the committed results/ stay untouched)"
fi
bash scripts/install.sh
export PATH="$PWD/.venv/bin:$PATH"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec snakemake all --cores "${CORES:-2}" "${fresh[@]}" "$@"
