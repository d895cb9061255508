#!/usr/bin/env bash
# The table made through OpenRLHF and its embedded-trainer counterpart, on one GPU machine, through the pipeline:
# experiments/profiles/openrlhf-small.yaml as committed (RL launcher: trace.integrations.openrlhf.launch) and its
# twin with launcher.rl = python -m trace.rl (everything else equal, its own runs_dir), from one SFT base.
#   bash scripts/gpu/openrlhf_table.sh start                 # returns at once; the work goes on in the background
#   bash scripts/gpu/openrlhf_table.sh wait SECONDS OUT.tgz  # waits up to SECONDS, packs what is done (no ckpt/)
#   bash scripts/gpu/openrlhf_table.sh status                # one line: running / finished, runs done
# Unpack OUT.tgz in the repository root: results/openrlhf/small-table/{openrlhf,embedded}/<model>/<task>/<arm>/seed<k>
# (run dirs as analysis/ reads them), their tables ({openrlhf,embedded}-tables/), the side-by-side
# openrlhf_vs_embedded.{csv,md} (analysis/openrlhf_compare.py), the pipelines' logs and run.log.
# Order: the SFT base and its evaluation (stage sft is our trainer on both sides), copied into the twin's tree,
# then both run sets at once under the GPU slots of workflow/scripts/launch.py (profile gpu_slots_per_device per
# GPU, shared by both pipelines), then the tables. Checkpoints stay on the machine, so one `start` must finish on
# the machine it started on: STEPS=N shortens both profiles alike (rl.steps), for a probe of the step times.
# The GPU test suite runs first when GPU_SUITE is set (full|fast; scripts/gpu/gpu_tests.sh), its line in every
# run's meta.json (env TRACE_GPU_TESTS). WORK (default /tmp/trace-orl-table) holds the profiles, the pipelines'
# working directories and run.log; CORES (default nproc) caps snakemake's cores; SNAKEMAKE_EXTRA adds snakemake options
# (`-n`: a dry run of the whole sequence, the run.sh plumbing included).
set -euo pipefail
work=${WORK:-/tmp/trace-orl-table}
py=${PYTHON:-python3}
prof=experiments/profiles/openrlhf-small.yaml
case ${1:-} in
start)
  if [ -e "$work/pid" ] && kill -0 "$(cat "$work/pid")" 2>/dev/null; then echo "already running ($work)" >&2; exit 1; fi
  rm -rf "$work"; mkdir -p "$work/orl" "$work/emb"
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [ "$gpus" -gt 0 ] || { echo "no GPU visible" >&2; exit 1; }
  if [ -n "${GPU_SUITE:-}" ]; then
    TRACE_GPU_TESTS=$(OUT=$work bash scripts/gpu/gpu_tests.sh "$GPU_SUITE") || { echo "GPU tests failed; not started" >&2; exit 1; }
    export TRACE_GPU_TESTS
  fi
  # the two profiles: the committed one and its embedded twin (STEPS shortens both alike)
  "$py" - "$prof" "$work" "${STEPS:-}" <<'EOF'
import sys

import yaml

prof, work, steps = sys.argv[1:4]
c = yaml.safe_load(open(prof))
if steps:
    c["defaults"]["rl"]["steps"] = int(steps)
yaml.safe_dump(c, open(f"{work}/openrlhf.yaml", "w"), sort_keys=False)
root = c["runs_dir"].rsplit("/", 1)[0]
c["launcher"] = {"sft": "python -m trace.sft", "rl": "python -m trace.rl", "eval": "python -m trace.eval"}
c.pop("openrlhf_flags", None)  # train_ppo_ray flags: the embedded trainer has none
c.update(runs_dir=f"{root}/embedded", tables_dir=f"{root}/embedded-tables", figures_dir=f"{root}/embedded-figures")
yaml.safe_dump(c, open(f"{work}/embedded.yaml", "w"), sort_keys=False)
EOF
  read -r root < <("$py" -c "import yaml, sys; print(yaml.safe_load(open(sys.argv[1]))['runs_dir'].rsplit('/', 1)[0])" "$prof")
  slots=$("$py" -c "import yaml, sys; print(yaml.safe_load(open(sys.argv[1])).get('gpu_slots_per_device', 1))" "$prof")
  cores=${CORES:-$(nproc)}
  cat > "$work/run.sh" <<EOF
set -euo pipefail
cd "$PWD"
export PYTHONPATH=$PWD\${PYTHONPATH:+:\$PYTHONPATH} PYTHONUNBUFFERED=1 TRACE_GPU_TESTS="${TRACE_GPU_TESTS:-}"
sm() { d=\$1; shift; "$py" -m snakemake --snakefile "$PWD/Snakefile" --directory "$work/\$d" --configfile "$work/\$d.yaml" \\
  --cores $cores --resources gpu=$((gpus * slots)) --scheduler greedy --rerun-incomplete --retries 2 ${SNAKEMAKE_EXTRA:-} "\$@"; }
ln -sf "$work/openrlhf.yaml" "$work/orl.yaml"; ln -sf "$work/embedded.yaml" "$work/emb.yaml"
sft=\$("$py" -c "import sys, yaml; sys.path.insert(0, 'workflow/scripts'); from runplan import Plan
print(Plan(yaml.safe_load(open(sys.argv[1]))).sft_dir('qwen3_moe-small', 'reasoning', 0))" "$work/openrlhf.yaml")
echo "[table] SFT base and its evaluation: \$sft"; date -u
sm orl "\$sft/eval.json"
# the SFT base, its evaluation and its generated config are the twin's too (same profile values, same trainer)
rel=\${sft#$root/openrlhf/}
mkdir -p "$work/emb/$root/embedded"
if [ -d "$work/orl/\$sft" ]; then  # (absent in a dry run)
  ( cd "$work/orl/$root/openrlhf" && tar cf - "\$rel" "configs/\$rel.yaml" ) | tar xf - -C "$work/emb/$root/embedded"
fi
echo "[table] RL runs, both sides"; date -u
sm orl \$("$py" workflow/scripts/runplan.py "$work/openrlhf.yaml" --targets qwen3_moe-small reasoning) > "$work/orl.log" 2>&1 &
o=\$!
sm emb \$("$py" workflow/scripts/runplan.py "$work/embedded.yaml" --targets qwen3_moe-small reasoning) > "$work/emb.log" 2>&1 &
e=\$!
status=0; wait \$o || status=1; wait \$e || status=1
echo "[table] tables"; date -u
for s in openrlhf:orl embedded:emb; do
  "$py" -m analysis.tables --runs "$work/\${s#*:}/$root/\${s%%:*}" --out "$work/\${s#*:}/$root/\${s%%:*}-tables" || status=1
done
mkdir -p "$work/orl/$root/embedded"
for d in embedded embedded-tables; do
  [ -d "$work/emb/$root/\$d" ] && { ( cd "$work/emb/$root" && tar cf - --exclude=ckpt "\$d" ) | tar xf - -C "$work/orl/$root" || status=1; }
done
"$py" -m analysis.openrlhf_compare --openrlhf "$work/orl/$root/openrlhf" --embedded "$work/orl/$root/embedded" \\
  --out "$work/orl/$root" || status=1
date -u; echo "[table] finished, status \$status"
echo \$status > "$work/finished"
EOF
  setsid nohup bash "$work/run.sh" > "$work/run.log" 2>&1 < /dev/null &
  echo $! > "$work/pid"
  echo "started on $gpus GPU(s) x $slots slots; log $work/run.log";;
status)
  n=$(find "$work" -path '*/seed*/done' 2>/dev/null | wc -l)
  if [ -e "$work/finished" ]; then echo "finished (status $(cat "$work/finished")), $n runs done"
  elif [ -e "$work/pid" ] && kill -0 "$(cat "$work/pid")" 2>/dev/null; then echo "running, $n runs done"
  else echo "not running, $n runs done"; fi;;
wait)
  secs=${2:?usage: openrlhf_table.sh wait SECONDS OUT.tgz}; out=$(realpath -m "${3:?OUT.tgz}")
  end=$((SECONDS + secs))
  while [ ! -e "$work/finished" ] && [ $SECONDS -lt $end ] && kill -0 "$(cat "$work/pid")" 2>/dev/null; do sleep 10; done
  root=$("$py" -c "import yaml, sys; print(yaml.safe_load(open(sys.argv[1]))['runs_dir'].rsplit('/', 1)[0])" "$prof")
  stage=$work/pack; rm -rf "$stage"; mkdir -p "$stage/$root" "$stage/$root/logs"
  ( cd "$work/orl" && tar cf - --exclude=ckpt "$root" 2>/dev/null || true ) | tar xf - -C "$stage"
  [ -d "$work/emb/$root/embedded" ] && ( cd "$work/emb" && tar cf - --exclude=ckpt "$root/embedded" ) | tar xf - -C "$stage"
  for d in orl emb; do [ -d "$work/$d/logs" ] && cp -r "$work/$d/logs" "$stage/$root/logs/$d"; done
  cp "$work"/*.log "$stage/$root/logs/" 2>/dev/null || true
  tar czf "$out" -C "$stage" "$root"
  echo "packed $(tar tzf "$out" | grep -c -E '/seed[0-9]+/done$') done runs into $out ($(bash "$0" status))";;
*)
  echo "usage: openrlhf_table.sh start | status | wait SECONDS OUT.tgz" >&2; exit 2;;
esac
