#!/usr/bin/env bash
# The short learning run at the Qwen3-30B-A3B layer shape (experiments/profiles/medium.yaml: qwen3_moe-medium's
# SFT base on reasoning, then bf16, qat-independent and trace for 50 RL steps, seed 0, with their evaluations),
# on one H200 in one go: the chunk runs on the machine it starts on (its checkpoints never leave it), so every
# call on that machine goes on with it, through scripts/gpu/remote_call.sh, until a call prints "finished".
#   WHEELS=.whl-pipe bash scripts/gpu/medium_learning.sh      # device tool: carry .whl-pipe; 3 calls expected
# GPU time: ~20-25 min by the ESTIMATES of medium.yaml's header (SFT ~6 min, 3 runs one at a time ~8 min,
# evaluations ~4 min, installation and the fast GPU suite ~2 min): within a machine held for 30 minutes, so start it
# on a fresh machine and run nothing else there. Each call's OUT/chunk.tgz holds the run dirs without
# checkpoints; unpack the last one with `bash scripts/gpu/unpack_chunk.sh OUT/chunk.tgz`, then
# `.venv/bin/snakemake figures --cores 2 --configfile experiments/profiles/medium.yaml` draws
# results/tables/medium/ and figures/medium/; commit them with results/runs/medium/.
# GPU_SUITE (default here: fast) and SKIP_GPU_TESTS as in remote_call.sh; LIMIT (default 575) is each call's budget.
set -uo pipefail
export GPU_SUITE=${GPU_SUITE:-fast}
exec bash scripts/gpu/remote_call.sh "${WHEELS:-.whl-pipe}" experiments/profiles/medium.yaml qwen3_moe-medium reasoning
