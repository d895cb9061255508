#!/usr/bin/env bash
# A queue of GPU jobs that runs in the background on one machine while short calls of the device tool (each under
# its 10-minute limit) wait on it and bring back what is done: one machine's time spent on work, not on restarts.
#   bash scripts/gpu/queue.sh start JOBS       # copies JOBS to $QDIR/pending and returns at once
#   bash scripts/gpu/queue.sh wait SECONDS     # waits up to SECONDS (or until the queue is empty), then packs
#                                              # $QDIR (logs, jobs.txt) and the COLLECT files into $OUT/queue.tgz
#   bash scripts/gpu/queue.sh add 'LIMIT NAME COMMAND'   # appends a job to a running queue
#   bash scripts/gpu/queue.sh status           # jobs.txt and the running job
# JOBS: one job per line, `LIMIT_S NAME COMMAND...` (blank lines and # comments skipped). The jobs run one after
# another in the order of $QDIR/pending, re-read before each job (so `add` and edits reach a running queue), each
# under `timeout LIMIT_S`, its output in $QDIR/NAME.log; a failing job does not stop the queue. jobs.txt gets one
# line per finished job: NAME rc seconds. The environment of `start` is the jobs' environment, with the carried
# wheel folder WHEELS (default .whl-pipe) installed and on PYTHONPATH (scripts/gpu/env.sh): the jobs import
# trace.config, which needs jsonschema.
# QDIR default /tmp/trace-queue; COLLECT (space-separated paths, default /tmp/rlstep/rlstep.csv) go into the pack
# under collect/.
set -uo pipefail
qdir=${QDIR:-/tmp/trace-queue}
case ${1:-} in
start)
  jobs=${2:?usage: queue.sh start JOBS}
  if [ -e "$qdir/pid" ] && kill -0 "$(cat "$qdir/pid")" 2>/dev/null; then echo "a queue runs already ($qdir)" >&2; exit 1; fi
  rm -rf "$qdir"; mkdir -p "$qdir"
  . "$(dirname "$0")/env.sh" || exit 1
  grep -v -e '^[[:space:]]*#' -e '^[[:space:]]*$' "$jobs" > "$qdir/pending"
  : > "$qdir/jobs.txt"
  setsid nohup bash "$0" run > "$qdir/queue.log" 2>&1 < /dev/null &
  echo $! > "$qdir/pid"
  echo "queue started: $(wc -l < "$qdir/pending") jobs ($qdir)";;
run)
  while [ -s "$qdir/pending" ]; do
    line=$(head -n 1 "$qdir/pending"); sed -i 1d "$qdir/pending"
    read -r limit name cmd <<< "$line"
    echo "$name" > "$qdir/current"; t=$(date +%s)
    echo "== $(date -u +%H:%M:%S) $name (limit ${limit} s): $cmd"
    timeout "$limit" bash -c "$cmd" > "$qdir/$name.log" 2>&1 < /dev/null
    rc=$?
    echo "$name $rc $(( $(date +%s) - t ))" | tee -a "$qdir/jobs.txt"
  done
  rm -f "$qdir/current"; touch "$qdir/finished";;
add)
  echo "${2:?usage: queue.sh add 'LIMIT NAME COMMAND'}" >> "$qdir/pending"; echo "added; pending: $(wc -l < "$qdir/pending")";;
status)
  cat "$qdir/jobs.txt" 2>/dev/null
  if [ -e "$qdir/current" ]; then
    cur=$(cat "$qdir/current"); echo "running: $cur; last lines:"; tail -n 5 "$qdir/$cur.log" 2>/dev/null
  elif [ -e "$qdir/finished" ]; then echo "finished"; fi
  echo "pending: $(wc -l < "$qdir/pending" 2>/dev/null || echo 0)";;
wait)
  secs=${2:?usage: queue.sh wait SECONDS}; out=${OUT:?the device tool sets OUT}
  end=$((SECONDS + secs))
  while [ ! -e "$qdir/finished" ] && [ $SECONDS -lt $end ] && kill -0 "$(cat "$qdir/pid")" 2>/dev/null; do sleep 5; done
  mkdir -p "$qdir/collect"
  for f in ${COLLECT:-/tmp/rlstep/rlstep.csv}; do [ -e "$f" ] && cp "$f" "$qdir/collect/"; done
  tar czf "$out/queue.tgz" -C "$(dirname "$qdir")" "$(basename "$qdir")"
  bash "$0" status;;
*)
  echo "usage: queue.sh start JOBS | wait SECONDS | add 'LIMIT NAME COMMAND' | status" >&2; exit 2;;
esac
