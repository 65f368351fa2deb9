#!/usr/bin/env bash
# One single-threaded `ranmt experiment` worker per CPU core, each pinned to its core, all
# sharing one grid (the workers claim cells with lock files, docs/EXPERIMENTS.md). On a
# 2-core AMD EPYC Zen 3 two such workers trained the `student` preset 1.15-1.17x faster in
# sum than one worker with both cores (benchmarks/parallel_workers.py,
# docs/performance/students/parallel_workers_ran-d.txt): each cell takes about twice as
# long, the grid less time.
#
#   scripts/grid_workers.sh CONFIG.yaml [ranmt experiment options ...]
#
# Every worker gets the same options and walks the grid seed by seed (--seeds 1, then 2,
# ...: the grid's seeds, read from the file), so every variant's first seed finishes before
# any second one. Ctrl-C (or SIGINT/SIGTERM to this script) stops every worker the way a
# signal stops `ranmt experiment`: the running cells save their checkpoints; rerun the
# script to resume. A worker stopped by a signal of its own ends its chain too. Started in
# the background by another script (`nohup scripts/grid_workers.sh ... &` inside a script),
# this script has SIGINT ignored (POSIX: a non-interactive shell's background commands),
# and an ignored signal cannot be trapped: stop it with SIGTERM there
# (`pkill -TERM -f grid_workers.sh`), which it forwards to the workers as SIGINT.
# Variables: WORKERS (default: the cores this process may use), BIN (default: the
# checkout's .venv/bin), LOG (default grid_workers; worker N writes LOG.N.log). Run it where
# you would run `ranmt experiment`: paths are read from the current folder.
set -euo pipefail -m  # -m: each worker its own process group, signalled as one
REPO="$(cd "$(dirname "$0")/.." && pwd)"
LOG="${LOG:-grid_workers}"
CONFIG="$1"
shift
BIN="${BIN:-$REPO/.venv/bin}"
mapfile -t CORES < <("$BIN/python" -c 'import os; print(*sorted(os.sched_getaffinity(0)), sep="\n")')
WORKERS="${WORKERS:-${#CORES[@]}}"
SEEDS=$("$BIN/python" -c 'import sys, yaml; print(*(yaml.safe_load(open(sys.argv[1])) or {}).get("seeds", [1, 2, 3]))' "$CONFIG")

pids=()
stopping=0
stop() {
  stopping=1
  for pid in "${pids[@]}"; do kill -INT -- "-$pid" 2>/dev/null || true; done
}
trap stop INT TERM  # before the first worker: a signal at any point reaches every one
for ((worker = 0; worker < WORKERS && !stopping; worker++)); do
  core="${CORES[$((worker % ${#CORES[@]}))]}"
  (
    for seed in $SEEDS; do  # "ranmt experiment" exits 130 when stopped by a signal
      OMP_NUM_THREADS=1 taskset -c "$core" "$BIN/ranmt" experiment "$CONFIG" --seeds "$seed" "$@" \
        || exit $?
    done
  ) >> "$LOG.$worker.log" 2>&1 &
  pids+=($!)
  echo "worker $worker on core $core: pid $!, log $LOG.$worker.log"
  if ((worker + 1 < WORKERS)); then
    sleep 5 || true  # the first claims its cell before the next starts
  fi
done
status=0
for pid in "${pids[@]}"; do
  while true; do
    wait "$pid" && break
    rc=$?
    kill -0 "$pid" 2>/dev/null && continue  # the wait was cut short by a signal: wait on
    status=$rc                               # until the worker has saved and exited
    break
  done
done
exit "$status"
