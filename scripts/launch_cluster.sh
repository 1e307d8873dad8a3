#!/usr/bin/env bash
# Start (or stop) one xllm-py process per device: node 0 is the master (HTTP API,
# scheduler, coordination service on MASTER_NODE_ADDR), nodes 1..NNODES-1 are workers.
#
#   scripts/launch_cluster.sh           # start; waits for /health, prints the URL
#   scripts/launch_cluster.sh stop      # stop every process it started (recorded pids)
#   scripts/launch_cluster.sh status    # which recorded processes are alive
#
# Every setting comes from the environment; the defaults serve the bundled model on
# CPU with 2 nodes and MTP on:
#   MODEL_PATH (empty: bundled)   DRAFT_MODEL_PATH (empty: the MTP layer in MODEL_PATH)
#   NNODES=2  DEVICE_TYPE=cpu|cuda|npu  START_DEVICE=0  START_PORT=13222  HOST=127.0.0.1
#   MASTER_NODE_ADDR=127.0.0.1:42123  NUM_SPECULATIVE_TOKENS=1  EP_SIZE=1  DP_SIZE=1 (tensor parallel over all nodes)
#   MAX_MEMORY_UTILIZATION=0.90  MAX_TOKENS_PER_BATCH=10000  MAX_SEQS_PER_BATCH=256
#   BLOCK_SIZE=128  ENABLE_PREFIX_CACHE=true  ENABLE_CHUNKED_PREFILL=true
#   LOG_DIR=log (node_$i.log, cluster.pids)  HEALTH_TIMEOUT=300  STOP_TIMEOUT=60  EXTRA_ARGS=""
#   PYTHON (default: .venv/bin/python of this checkout, else python3)
# Node i listens on START_PORT + i and uses device START_DEVICE + i.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
MODEL_PATH="${MODEL_PATH:-}"
DRAFT_MODEL_PATH="${DRAFT_MODEL_PATH:-}"
NNODES="${NNODES:-2}"
DEVICE_TYPE="${DEVICE_TYPE:-cpu}"
START_DEVICE="${START_DEVICE:-0}"
START_PORT="${START_PORT:-13222}"
HOST="${HOST:-127.0.0.1}"
MASTER_NODE_ADDR="${MASTER_NODE_ADDR:-127.0.0.1:42123}"
NUM_SPECULATIVE_TOKENS="${NUM_SPECULATIVE_TOKENS:-1}"
EP_SIZE="${EP_SIZE:-1}"
DP_SIZE="${DP_SIZE:-1}"
MAX_MEMORY_UTILIZATION="${MAX_MEMORY_UTILIZATION:-0.90}"
MAX_TOKENS_PER_BATCH="${MAX_TOKENS_PER_BATCH:-10000}"
MAX_SEQS_PER_BATCH="${MAX_SEQS_PER_BATCH:-256}"
BLOCK_SIZE="${BLOCK_SIZE:-128}"
ENABLE_PREFIX_CACHE="${ENABLE_PREFIX_CACHE:-true}"
ENABLE_CHUNKED_PREFILL="${ENABLE_CHUNKED_PREFILL:-true}"
LOG_DIR="${LOG_DIR:-log}"
HEALTH_TIMEOUT="${HEALTH_TIMEOUT:-300}"
STOP_TIMEOUT="${STOP_TIMEOUT:-60}"  # > the master's --shutdown_timeout (30 s) + its cleanup
EXTRA_ARGS="${EXTRA_ARGS:-}"
PID_FILE="$LOG_DIR/cluster.pids"

alive() { kill -0 "$1" 2>/dev/null; }

signal_node() {  # signal a node's process group (it leads one, see setsid), else the pid
  kill "-$1" -- "-$2" 2>/dev/null || kill "-$1" "$2" 2>/dev/null || true
}

wait_gone() {  # wait_gone SECONDS PID...: 0 once all are gone
  local deadline=$((SECONDS + $1)) pid left
  shift
  while (( SECONDS <= deadline )); do
    left=0
    for pid in "$@"; do alive "$pid" && left=1; done
    [[ $left == 0 ]] && return 0
    sleep 0.5
  done
  return 1
}

stop_cluster() {
  [[ -f "$PID_FILE" ]] || { echo "no cluster recorded in $PID_FILE"; return 0; }
  local pids master workers
  pids=$(cat "$PID_FILE")
  master=$(echo "$pids" | head -n 1)
  workers=$(echo "$pids" | tail -n +2)
  # The master first: it drains in-flight requests (--shutdown_timeout) and then tells
  # its workers to exit; stopping the workers first would fail those requests.
  alive "$master" && signal_node TERM "$master"
  wait_gone "$STOP_TIMEOUT" "$master" || {
    echo "master pid $master still running after ${STOP_TIMEOUT}s; killing it"
    signal_node KILL "$master"
  }
  for pid in $workers; do alive "$pid" && signal_node TERM "$pid"; done
  # shellcheck disable=SC2086
  wait_gone 15 $workers || for pid in $workers; do
    if alive "$pid"; then
      echo "worker pid $pid ignored SIGTERM for 15 s; killing it"
      signal_node KILL "$pid"
    fi
  done
  rm -f "$PID_FILE"
  echo "stopped $(echo "$pids" | wc -w) processes"
}

status_cluster() {
  [[ -f "$PID_FILE" ]] || { echo "no cluster recorded in $PID_FILE"; return 1; }
  local i=0 down=0
  for pid in $(cat "$PID_FILE"); do
    if alive "$pid"; then echo "node $i: pid $pid running"; else echo "node $i: pid $pid gone"; down=1; fi
    i=$((i + 1))
  done
  return $down
}

start_cluster() {
  mkdir -p "$LOG_DIR"
  if [[ -f "$PID_FILE" ]]; then
    for pid in $(cat "$PID_FILE"); do
      if alive "$pid"; then
        echo "a cluster from $PID_FILE is still running (pid $pid); run '$0 stop' first" >&2
        exit 1
      fi
    done
    rm -f "$PID_FILE"
  fi
  local common=(
    --master_node_addr="$MASTER_NODE_ADDR" --nnodes="$NNODES"
    --num_speculative_tokens "$NUM_SPECULATIVE_TOKENS"
    --max_memory_utilization="$MAX_MEMORY_UTILIZATION"
    --max_tokens_per_batch="$MAX_TOKENS_PER_BATCH" --max_seqs_per_batch="$MAX_SEQS_PER_BATCH"
    --enable_mla=true --block_size="$BLOCK_SIZE" --ep_size="$EP_SIZE" --dp_size="$DP_SIZE"
    --enable_prefix_cache="$ENABLE_PREFIX_CACHE"
    --enable_chunked_prefill="$ENABLE_CHUNKED_PREFILL" --host "$HOST"
  )
  [[ -n "$MODEL_PATH" ]] && common+=(--model "$MODEL_PATH")
  for (( i = 0; i < NNODES; i++ )); do
    local port=$((START_PORT + i)) device
    if [[ "$DEVICE_TYPE" == cpu ]]; then device=cpu; else device="$DEVICE_TYPE:$((START_DEVICE + i))"; fi
    local draft=()
    if [[ -n "$DRAFT_MODEL_PATH" && "$NUM_SPECULATIVE_TOKENS" != 0 ]]; then
      draft=(--draft_model "$DRAFT_MODEL_PATH" --draft_devices="$device")
    fi
    # setsid: each node leads its own process group, so `stop` can signal the whole group
    # shellcheck disable=SC2086
    setsid nohup "$PYTHON" -m xllm_py "${common[@]}" "${draft[@]}" --devices="$device" \
      --port "$port" --node_rank="$i" $EXTRA_ARGS > "$LOG_DIR/node_$i.log" 2>&1 < /dev/null &
    echo $! >> "$PID_FILE"
    sleep 0.5
  done
  local url="http://$HOST:$START_PORT"
  local deadline=$((SECONDS + HEALTH_TIMEOUT)) i
  until curl -sf --max-time 5 "$url/health" > /dev/null 2>&1; do
    i=0
    for pid in $(cat "$PID_FILE"); do
      if ! alive "$pid"; then
        echo "node $i (pid $pid) exited during start-up; last lines of $LOG_DIR/node_$i.log:" >&2
        tail -n 20 "$LOG_DIR/node_$i.log" >&2 || true
        stop_cluster > /dev/null
        exit 1
      fi
      i=$((i + 1))
    done
    if (( SECONDS > deadline )); then
      echo "no healthy master at $url after ${HEALTH_TIMEOUT}s; see $LOG_DIR/" >&2
      stop_cluster > /dev/null
      exit 1
    fi
    sleep 1
  done
  echo "cluster of $NNODES nodes is up: $url/v1 (logs in $LOG_DIR/, stop with '$0 stop')"
}

case "${1:-start}" in
  start) start_cluster ;;
  stop) stop_cluster ;;
  status) status_cluster ;;
  *) echo "usage: $0 [start|stop|status]" >&2; exit 2 ;;
esac
