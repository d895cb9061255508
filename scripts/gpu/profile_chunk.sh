#!/usr/bin/env bash
# One stretch of a GPU profile that has to finish on the machine it starts on (its checkpoints stay on that
# machine; only the run dirs without checkpoints come back): the runs of one model (and task) through the
# pipeline, in a copy of the repository and in a process group of its own (setsid), so it outlives the
# command that started it; then a later command waits for it and packs the run dirs without checkpoints.
#   bash scripts/gpu/profile_chunk.sh start PROFILE MODEL[,MODEL...] [TASK[,TASK...]]   # returns at once
#   bash scripts/gpu/profile_chunk.sh wait SECONDS OUT.tgz         # waits up to SECONDS, packs what is done
# e.g. `start experiments/profiles/small.yaml qwen3_moe-small reasoning` on two H200s runs its SFT base, the
# 12 runs and 13 evaluations with 8 at a time (gpu = GPUs x the profile's gpu_slots_per_device); `qwen3_moe-small
# coding,long_horizon` trains both tasks' SFT bases side by side, then their runs. Unpack
# OUT.tgz in the repository root, then `snakemake figures --configfile PROFILE`. An SFT base committed
# without its checkpoint is trained again first and checked against its logged losses. WORK (default
# /tmp/trace-chunk) holds the copy and snakemake.log; SLOTS overrides the profile's gpu_slots_per_device
# (runs per GPU; the tables' speed columns are ratios within one run, so they hold either way); CORES (default nproc)
# overrides snakemake's cores, which with the profile's 4 threads per run also cap the runs at a time (16 cores: 4).
# Peak GPU memory per run (olmoe-small trace: 17 GB; 12 olmoe runs on one H200 ran out of memory; 10 mixtral-small
# ablation runs failed again and again where 6 ran clean) bounds SLOTS; a failed attempt's log is kept in LOG.failed;
# a run that fails (e.g. out of memory next to others) is tried twice more and resumes from its checkpoint.
# ARMS (space-separated arm names, e.g. "trace-rho0 trace-alignelements") narrows the chunk to those arms' runs,
# so a machine held for a short time spends it on them first (snakemake's --prioritize did not); SEEDS (e.g. "0")
# narrows it to those seeds' runs and bases (experiments/gpu_plan.yaml's units: two arms of one seed). Within a chunk the rules'
# priorities order the jobs: evaluations before new runs, the longest arms first (workflow/rules/train.smk).
# SNAKEMAKE_EXTRA adds snakemake options (`-n`: a dry run, as tests/workflow/test_profile_chunk.py does). Snakemake runs with the greedy scheduler, so
# PuLP's solver binaries are not needed (scripts/gpu/offline_wheels.sh SET all leaves them out).
# `start` runs the GPU test suite first (scripts/gpu/gpu_tests.sh, GPU_SUITE default full, once per machine and
# source tree; SKIP_GPU_TESTS=1 skips it) unless the caller ran it and passes its line in TRACE_GPU_TESTS
# (remote_call.sh does); that line goes into every run's meta.json (env TRACE_GPU_TESTS).
set -euo pipefail
work=${WORK:-/tmp/trace-chunk}
py=${PYTHON:-python3}
case ${1:-} in
start)
  profile=${2:?usage: profile_chunk.sh start PROFILE MODEL[,MODEL...] [TASK[,TASK...]]}; models=${3:?model}; tasks=${4:-}
  read -r name slots < <("$py" -c "import yaml, sys; c = yaml.safe_load(open(sys.argv[1]))
print(c['profile'], c.get('gpu_slots_per_device', 1))" "$profile")
  slots=${SLOTS:-$slots}
  # models whose committed SFT base lacks its checkpoint (rebuilt first) and the others (started at once)
  now=""; later=""; sfts=""; n=0
  for mt in $(for m in ${models//,/ }; do for k in ${tasks:-ALL}; do for tk in ${k//,/ }; do echo "$m:$tk"; done; done; done); do
    m=${mt%%:*}; task=${mt#*:}; [ "$task" = ALL ] && task=""
    # a model or task the profile lacks stops the start (runplan.py exits non-zero)
    t=$(PYTHONPATH=$PWD "$py" workflow/scripts/runplan.py "$profile" --targets "$m" $task) || exit 1
    if [ -n "${ARMS:-}" ]; then   # only these arms' runs (and the SFT base's evaluation they share)
      keep=""
      for x in $t; do
        for a in $ARMS sft; do case $x in */"$a"/*) keep="$keep $x";; esac; done
      done
      t=$keep
    fi
    if [ -n "${SEEDS:-}" ]; then  # only these seeds' runs and SFT bases (per-seed bases: sft/seed<k>/)
      keep=""
      for x in $t; do
        case $x in */sft/eval.json) keep="$keep $x"; continue;; esac  # one base for every seed
        for k in $SEEDS; do case $x in */seed"$k"/*) keep="$keep $x";; esac; done
      done
      t=$keep
    fi
    n=$((n + $(echo $t | wc -w)))
    need=""; need_dirs=""
    for d in results/runs/$name/$m/${task:-*}/sft results/runs/$name/$m/${task:-*}/sft/seed*; do
      [ -e "$d/done" ] && [ ! -e "$d/ckpt" ] && { need=1; sfts="$sfts $d"; need_dirs="$need_dirs $d"; }
    done
    # one line per model (and task) waiting for rebuilds: its SFT dirs, a tab, its targets
    if [ -n "$need" ]; then later="$later$(echo $need_dirs)	$(echo $t)
"; else now="$now $(echo $t)"; fi
  done
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [ "$gpus" -gt 0 ] || { echo "no GPU visible" >&2; exit 1; }
  if [ -z "${TRACE_GPU_TESTS:-}" ]; then
    bash scripts/gpu/gpu_tests.sh "${GPU_SUITE:-full}" || { echo "the chunk is not started" >&2; exit 1; }
    TRACE_GPU_TESTS=$(cat "${RECORD:-${OUT:-/tmp}/gpu_tests.txt}")
  fi
  rm -rf "$work" && mkdir -p "$work"
  printf '%s' "$later" > "$work/later.list"
  # .git travels: meta.json records the commit. GNU tar exits 1 when a file changed while it read it (a git
  # command refreshing .git/index beside it): the copy is still whole, so only 2 (fatal) stops the start
  { tar cf - --warning=no-file-changed --exclude='./.whl*' --exclude='./.venv' . || [ $? -eq 1 ]; } | tar xf - -C "$work"
  cd "$work"
  # An SFT base that came back from an earlier chunk without its checkpoint (done, no ckpt) is trained again
  # first, into a side dir; its logged losses must equal the committed ones bit for bit, then the checkpoint
  # goes in place and snakemake, whose runs depend on ancient(sft/done), starts only what is missing.
  # SFT_REBUILD_TOL (relative, default 0) accepts a base whose losses differ by at most that much
  # (workflow/scripts/rebuild_check.py): for bases trained before the SFT was deterministic on a GPU.
  # The rebuilds run before any other job, one at a time per GPU (GPUs side by side), each in the determinism
  # mode its base trained in (trace/sft.py): bases trained with PyTorch's own choices did not train again to
  # their losses on other machines, alone on the GPU or not (trace/sft.py), and a base that differs would start
  # its arms from another model than the committed runs'. A mismatch prints where the losses part and holds
  # back only the runs on that base; the rebuild's metrics are packed.
  # Then the models that need no rebuild and the rebuilt ones run together (--nolock: two snakemakes, each
  # with its own targets); GPU slots are flocks (workflow/scripts/launch.py), so both share the GPUs' slots.
  # targets go before the options: --config takes every word after it
  sm="$py -m snakemake"; smo="--cores ${CORES:-$(nproc)} --resources gpu=$((gpus * slots)) --scheduler greedy --keep-going --retries 2 ${SNAKEMAKE_EXTRA:-} --configfile $profile --config gpu_slots_per_device=$slots"
  cat > run.sh <<EOS
echo "GPU tests: \$TRACE_GPU_TESTS"
rebuild() {
  local log="rebuild/\$1.log"
  mkdir -p "\$(dirname "\$log")"
  # trained as the committed base was: its determinism mode (trace/sft.py rebuild_determinism)
  local mode
  mode=\$($py -c "import json, sys; from trace.sft import rebuild_determinism; print(rebuild_determinism(json.load(open(sys.argv[1]))))" "\$1/meta.json")
  echo "rebuilding the SFT checkpoint of \$1 on GPU \$2 (determinism \$mode)"
  TRACE_SFT_DETERMINISM=\$mode CUDA_VISIBLE_DEVICES=\$2 $py -m trace.sft --config "\$1/config.yaml" --out "rebuild/\$1" > "\$log" 2>&1 \\
    || { tail -20 "\$log"; return 1; }
  local line
  line=\$($py workflow/scripts/rebuild_check.py "\$1" "rebuild/\$1" --tol "${SFT_REBUILD_TOL:-0}")
  local ok=\$?
  echo "\$line"
  [ \$ok -eq 0 ] || return 1
  echo "\$line" >> rebuild/notes
  mv "rebuild/\$1/ckpt" "\$1/ckpt"
  echo "rebuilt \$1"
}
rebuild_on() {  # rebuild_on GPU DIR...: one after another on that GPU
  local g=\$1 ok=0; shift
  for d in "\$@"; do rebuild "\$d" "\$g" || ok=1; done
  return \$ok
}
status=0; pids=""
if [ -n "$sfts" ]; then
  set -- $sfts
  for g in \$(seq 0 \$(($gpus - 1))); do
    mine=""; i=0
    for d in "\$@"; do [ \$((i % $gpus)) -eq "\$g" ] && mine="\$mine \$d"; i=\$((i + 1)); done
    [ -n "\$mine" ] && { rebuild_on "\$g" \$mine & pids="\$pids \$!"; }
  done
  for p in \$pids; do wait \$p || true; done  # a failed rebuild leaves no checkpoint: see below
fi
first=""
if [ -n "$now" ]; then $sm $now $smo & first=\$!; fi
# the models (and tasks) whose bases are all in place run; a failed rebuild holds back only its own
ready=""
while IFS=\$'\t' read -r dirs targets; do
  [ -n "\$dirs" ] || continue
  ok=1; for d in \$dirs; do [ -e "\$d/ckpt" ] || ok=""; done
  if [ -n "\$ok" ]; then ready="\$ready \$targets"; else echo "an SFT rebuild failed: not starting \$targets"; status=1; fi
done < later.list
if [ -n "\$ready" ]; then
  # the runs on rebuilt bases record how each base matched (meta.json env, trace/rundir.py ENV_KEYS)
  TRACE_SFT_REBUILD="\$(cat rebuild/notes 2>/dev/null)" $sm \$ready --nolock $smo || status=1
fi
if [ -n "\$first" ]; then wait \$first || status=1; fi
exit \$status
EOS
  TRACE_GPU_TESTS=$TRACE_GPU_TESTS PYTHONPATH=$work${PYTHONPATH:+:$PYTHONPATH} setsid nohup bash run.sh > "$work/snakemake.log" 2>&1 < /dev/null &
  echo $! > "$work/pid"
  echo "$name" > "$work/profile_name"
  echo "started $n targets on $gpus GPU(s) x $slots slots ($(echo $sfts | wc -w) SFT checkpoints to rebuild first); log $work/snakemake.log";;
wait)
  secs=${2:?usage: profile_chunk.sh wait SECONDS OUT.tgz}; out=${3:?OUT.tgz}
  pid=$(cat "$work/pid"); t0=$(date +%s)
  while kill -0 "$pid" 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt "$secs" ]; do sleep 5; done
  cd "$work"
  if kill -0 "$pid" 2>/dev/null; then echo "still running after ${secs} s"; else echo "finished"; fi
  grep -E "Finished jobid|Error in rule" snakemake.log | sed 's/ jobid: [0-9]*//' | sort | uniq -c || true
  # how each SFT rebuild matched its committed losses, and what a failed one held back (a chunk that ends at
  # once after a failed rebuild says why here, not only in the packed log)
  grep -E "^SFT rebuild of|^an SFT rebuild failed" snakemake.log | cut -c1-300 || true
  name=$(cat profile_name)
  # rebuild/: the metrics and logs of SFT bases trained again (their checkpoints stay)
  tar czf "$out" --exclude=ckpt "results/runs/$name" "logs/$name" snakemake.log $(ls -d rebuild 2>/dev/null) 2>/dev/null || true
  echo "packed $(tar tzf "$out" | grep -c -E '/(done|eval.json)$') done/eval.json files into $out";;
*) sed -n 2,12p "$0"; exit 2;;
esac
