#!/usr/bin/env bash
# Unpack what a GPU chunk brought back (scripts/gpu/profile_chunk.sh's OUT.tgz) into the repository: the
# run dirs that are complete and not here yet, and the generated run configs that are new. Complete: an
# RL run with `done` and `eval.json` (its checkpoint stayed on the GPU machine, so a run without its
# evaluation could never be evaluated: it is left out and reruns), an SFT base with `done` (the next chunk
# rebuilds its checkpoint and checks it against these logged losses). Run dirs already here are never
# overwritten; a base here without its evaluation gains the one that came back, if its logged losses match.
#   bash scripts/gpu/unpack_chunk.sh OUT/chunk.tgz
# then `.venv/bin/snakemake figures --cores 2 --configfile experiments/profiles/PROFILE.yaml` and commit.
set -euo pipefail
tgz=${1:?usage: unpack_chunk.sh CHUNK.tgz}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
tar xzf "$tgz" -C "$tmp"
new=0; skipped=0; present=0
while IFS= read -r d; do
  d=${d#"$tmp"/}; d=${d%/done}
  if [ -e "$d/done" ]; then
    present=$((present + 1))
    # a base committed before its evaluation ran gets the evaluation of that same base (same logged losses)
    if [ "$(basename "$d")" = sft ] && [ ! -e "$d/eval.json" ] && [ -e "$tmp/$d/eval.json" ] \
        && cmp -s "$d/metrics.jsonl" "$tmp/$d/metrics.jsonl"; then
      cp "$tmp/$d/eval.json" "$d/eval.json"; echo "added the base evaluation: $d/eval.json"
    fi
    continue
  fi
  if [ "$(basename "$d")" != sft ] && [ ! -e "$tmp/$d/eval.json" ]; then
    echo "left out (no evaluation): $d"; skipped=$((skipped + 1)); continue
  fi
  mkdir -p "$d" && cp -a "$tmp/$d/." "$d/"
  new=$((new + 1))
done < <(find "$tmp/results/runs" -name done | sort)
configs=0
if [ -d "$tmp/results/runs" ]; then
  while IFS= read -r f; do
    f=${f#"$tmp"/}
    [ -e "$f" ] && continue
    mkdir -p "$(dirname "$f")" && cp "$tmp/$f" "$f"; configs=$((configs + 1))
  done < <(find "$tmp/results/runs" -path '*/configs/*' -type f | sort)
fi
echo "unpacked $new run dirs and $configs configs; $present already here; $skipped left out"
