#!/usr/bin/env bash
# One Prefect process worker per GPU: each worker sees exactly one GPU (CUDA_VISIBLE_DEVICES
# pinned) and runs one flow run at a time (--limit 1), so a GPU stage never shares its GPU.
#
#   infra/gpu-workers.sh plan      # print the worker commands, start nothing
#   infra/gpu-workers.sh start     # start them in the background (PID files, logs)
#   infra/gpu-workers.sh status    # alive/dead per GPU
#   infra/gpu-workers.sh stop      # SIGTERM by PID file, SIGKILL after STOP_TIMEOUT seconds
#   infra/gpu-workers.sh run       # start, stay in the foreground; exit when one dies (containers)
#
# Settings (environment): GPUS (comma-separated indices or UUIDs; default: every GPU that
# `nvidia-smi` lists), POOL (default paperline-gpu), PREFECT_API_URL (the team server),
# STATE_DIR (default .paperline/gpu-workers), STOP_TIMEOUT (default 20). The work pool is created
# (type process) if missing. S3/MLflow settings and credentials are inherited from the
# environment, never passed as arguments.
set -euo pipefail

POOL="${POOL:-paperline-gpu}"
STATE_DIR="${STATE_DIR:-.paperline/gpu-workers}"
STOP_TIMEOUT="${STOP_TIMEOUT:-20}"
HOST_TAG="$(hostname -s 2>/dev/null || echo host)"
PREFECT="${PREFECT:-prefect}"

gpus() {
  if [[ -n "${GPUS:-}" ]]; then
    tr ',' '\n' <<<"$GPUS" | sed 's/ //g' | grep -v '^$'
  elif command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index --format=csv,noheader | sed 's/ //g'
  fi
}

worker_argv() {  # WORKER_ARGV: the command of the worker pinned to GPU $1
  WORKER_ARGV=(env "CUDA_VISIBLE_DEVICES=$1" "$PREFECT" worker start --pool "$POOL"
               --type process --name "$HOST_TAG-gpu$1" --limit 1)
}

list_gpus() {  # GPU_LIST: the GPUs to serve; exits when there are none
  GPU_LIST="$(gpus || true)"
  if [[ -z "$GPU_LIST" ]]; then
    echo "error: no GPUs found (nvidia-smi lists none); set GPUS=0,1,..." >&2
    exit 2
  fi
}

plan() {
  list_gpus
  for gpu in $GPU_LIST; do worker_argv "$gpu"; echo "${WORKER_ARGV[*]}"; done
}

ensure_pool() {
  "$PREFECT" work-pool inspect "$POOL" >/dev/null 2>&1 \
    || "$PREFECT" work-pool create "$POOL" --type process >/dev/null
}

alive() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
  list_gpus
  mkdir -p "$STATE_DIR"
  ensure_pool
  for gpu in $GPU_LIST; do
    local pidfile="$STATE_DIR/gpu$gpu.pid"
    if alive "$pidfile"; then
      echo "gpu $gpu: already running (pid $(cat "$pidfile"))"
      continue
    fi
    # setsid: its own process group, so stop() reaches the worker and its flow-run children
    worker_argv "$gpu"
    setsid "${WORKER_ARGV[@]}" >>"$STATE_DIR/gpu$gpu.log" 2>&1 < /dev/null &
    echo $! >"$pidfile"
    echo "gpu $gpu: started pid $! (log $STATE_DIR/gpu$gpu.log)"
  done
}

stop() {  # every worker at once: SIGTERM to its process group, SIGKILL after STOP_TIMEOUT
  # (an idle `prefect worker` observed here did not exit on SIGTERM/SIGINT alone)
  shopt -s nullglob
  local pids=() pid
  for pidfile in "$STATE_DIR"/gpu*.pid; do
    pid="$(cat "$pidfile")"
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
      pids+=("$pid")
    fi
  done
  for _ in $(seq "$STOP_TIMEOUT"); do
    local left=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && left=1; done
    [[ $left == 0 ]] && break
    sleep 1
  done
  for pid in "${pids[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then
      kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
      echo "pid $pid: killed"
    else
      echo "pid $pid: stopped"
    fi
  done
  rm -f "$STATE_DIR"/gpu*.pid
}

status() {
  shopt -s nullglob
  list_gpus
  for gpu in $GPU_LIST; do
    local pidfile="$STATE_DIR/gpu$gpu.pid"
    if alive "$pidfile"; then echo "gpu $gpu: alive pid $(cat "$pidfile")"; else echo "gpu $gpu: dead"; fi
  done
}

run() {  # foreground: for a container's main process
  trap 'stop; exit 143' TERM INT
  start
  # exit (and let the restart policy act) as soon as any worker exits
  while true; do
    for pidfile in "$STATE_DIR"/gpu*.pid; do
      if ! alive "$pidfile"; then
        echo "$(basename "$pidfile" .pid) exited; stopping the others" >&2
        stop
        exit 1
      fi
    done
    sleep 5
  done
}

case "${1:-}" in
  plan)   plan ;;
  start)  start ;;
  stop)   stop ;;
  status) status ;;
  run)    run ;;
  *) echo "usage: $0 plan|start|status|stop|run" >&2; exit 2 ;;
esac
