#!/usr/bin/env bash
# Start (or stop) one xllm-py process per device: node 0 is the master (HTTP API,
# scheduler, coordination service on MASTER_NODE_ADDR), nodes 1..NNODES-1 are workers.
#
#   scripts/launch_cluster.sh           # start; waits for /health, prints the URL
#   scripts/launch_cluster.sh stop      # stop every process it started (recorded pids)
#   scripts/launch_cluster.sh status    # which recorded processes are alive
#   scripts/launch_cluster.sh --help    # this text
#
# Every setting comes from the environment; the defaults serve the bundled model on
# CPU with 2 nodes and MTP on:
#   MODEL_PATH (empty: bundled)   DRAFT_MODEL_PATH (empty: the MTP layer in MODEL_PATH)
#   NNODES=2  DEVICE_TYPE=cpu|cuda|npu  START_DEVICE=0  START_PORT=13222  HOST=127.0.0.1
#   MASTER_NODE_ADDR=127.0.0.1:42123  NUM_SPECULATIVE_TOKENS=1  EP_SIZE=1  DP_SIZE=1 (tensor parallel over all nodes)
#   ENABLE_DP_ATTENTION=false (true: DP attention, each node its own requests and KV cache,
#     the routed experts spread over all nodes; set DP_SIZE and EP_SIZE to NNODES)
#   MAX_MEMORY_UTILIZATION=0.90  MAX_TOKENS_PER_BATCH=10000  MAX_SEQS_PER_BATCH=256
#   BLOCK_SIZE=128  ENABLE_PREFIX_CACHE=true  ENABLE_CHUNKED_PREFILL=true
#   LOG_DIR=log (node_$i.log, cluster.pids)  HEALTH_TIMEOUT=300  STOP_TIMEOUT=60  EXTRA_ARGS=""
#   PYTHON (default: .venv/bin/python of this checkout, else python3)
#   CLUSTER_TOKEN_FILE (empty: a new random token for each start, written to
#     LOG_DIR/cluster.token, mode 0600): the shared secret every cluster RPC must carry;
#     each node gets --cluster_token_file (never the token itself on a command line).
#     For TLS on the gRPC control plane add --cluster_tls_cert/_key/_ca to EXTRA_ARGS.
#   XLLM_API_KEY: the API key of node 0's HTTP API, from this script's environment (the
#     nodes started on this host inherit it). EXTRA_ARGS may not carry a secret
#     (--api_key, --cluster_token): every user of a host sees a command line in `ps`.
#   DRY_RUN=0 (1: print the command that would start each node, or each host's ssh
#     command; start nothing, record nothing)
# Prefill/decode disaggregation (one host): PD_PREFILL=P PD_DECODE=D (both >= 1) start
# independent instances instead of one cluster: node 0 is the router (--pd_role=router,
# on START_PORT, no device), nodes 1..P prefill instances and the next D decode
# instances (--pd_prefill: every prefill instance), each on its own device and port
# (START_PORT + i; device START_DEVICE + i - 1). The cluster settings (MASTER_NODE_ADDR,
# EP_SIZE, DP_SIZE, ENABLE_DP_ATTENTION, HOSTS) do not apply; NNODES is 1 + P + D. Every
# instance reads the same cluster token, which the PD control plane carries. The start
# waits until the router's /health sees every instance live.
# Node i listens on START_PORT + i and uses device START_DEVICE + i (one host), or
# START_DEVICE + its index among its host's nodes (several hosts). On cuda and npu each
# process sees only its own device: CUDA_VISIBLE_DEVICES (cuda) or ASCEND_RT_VISIBLE_DEVICES
# (npu) is set to that device index and the process gets --devices=cuda:0 (npu:0), the one
# device it sees. On cpu no variable is set.
#
# Several hosts: HOSTS="h1:8,h2:8" (host:slots, comma-separated) or HOSTFILE=path (one
# "host slots", "host slots=N" or "host:slots" per line; '#' starts a comment). A slot is
# a node (a device). Ranks go host by host in that order: node 0, the master, is the first
# slot of the first host. NNODES defaults to the sum of the slots (set, it must equal it).
# Every host, this one included, is reached with SSH; each node gets --host <its host>,
# the address its services listen on and the others dial, so name hosts by addresses (or
# names) that every host can reach. HOST is not used. Also:
#   SSH=ssh (the command, options allowed: SSH="ssh -o BatchMode=yes")
#   MASTER_NODE_ADDR=<first host>:42123
#   REMOTE_ROOT (default: this checkout's path): the checkout on every host, the nodes' cwd
#   REMOTE_PYTHON (default: PYTHON if set, else REMOTE_ROOT/.venv/bin/python if this
#     checkout has a .venv, else python3)
#   REMOTE_ENV="" (VAR=value words set for each node started with SSH, e.g.
#     NCCL_SOCKET_IFNAME=eth0; the SSH session's environment is all they get otherwise)
# The token is copied to LOG_DIR/cluster.token (0600) on every host through SSH's
# standard input. MODEL_PATH and DRAFT_MODEL_PATH must be valid on every host. Each host keeps its nodes'
# logs in LOG_DIR made absolute here (e.g. $PWD/log/node_$i.log there); cluster.pids
# ("host pid" per node) stays here, and `stop` and `status` reach the hosts with the SSH
# of their own environment. The master's health is checked at http://<first host>:START_PORT.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON_GIVEN="${PYTHON:-}"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
MODEL_PATH="${MODEL_PATH:-}"
DRAFT_MODEL_PATH="${DRAFT_MODEL_PATH:-}"
NNODES_GIVEN="${NNODES:-}"
NNODES="${NNODES:-2}"
DEVICE_TYPE="${DEVICE_TYPE:-cpu}"
START_DEVICE="${START_DEVICE:-0}"
START_PORT="${START_PORT:-13222}"
HOST="${HOST:-127.0.0.1}"
MASTER_NODE_ADDR_GIVEN="${MASTER_NODE_ADDR:-}"
MASTER_NODE_ADDR="${MASTER_NODE_ADDR:-127.0.0.1:42123}"
NUM_SPECULATIVE_TOKENS="${NUM_SPECULATIVE_TOKENS:-1}"
EP_SIZE="${EP_SIZE:-1}"
DP_SIZE="${DP_SIZE:-1}"
ENABLE_DP_ATTENTION="${ENABLE_DP_ATTENTION:-false}"
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
DRY_RUN="${DRY_RUN:-0}"
HOSTS="${HOSTS:-}"
HOSTFILE="${HOSTFILE:-}"
SSH="${SSH:-ssh}"
REMOTE_ROOT="${REMOTE_ROOT:-$ROOT}"
if [[ -z "${REMOTE_PYTHON:-}" ]]; then
  if [[ -n "$PYTHON_GIVEN" ]]; then REMOTE_PYTHON="$PYTHON_GIVEN"
  elif [[ "$PYTHON" == "$ROOT/.venv/bin/python" ]]; then REMOTE_PYTHON="$REMOTE_ROOT/.venv/bin/python"
  else REMOTE_PYTHON=python3
  fi
fi
REMOTE_ENV="${REMOTE_ENV:-}"
CLUSTER_TOKEN_FILE="${CLUSTER_TOKEN_FILE:-}"
PD_PREFILL="${PD_PREFILL:-0}"
PD_DECODE="${PD_DECODE:-0}"
PID_FILE="$LOG_DIR/cluster.pids"
if [[ "$LOG_DIR" == /* ]]; then LOG_ABS="$LOG_DIR"; else LOG_ABS="$PWD/$LOG_DIR"; fi
TOKEN_SRC="${CLUSTER_TOKEN_FILE:-$LOG_ABS/cluster.token}"  # the token, on this host
read -r -a SSH_CMD <<< "$SSH"

die() { echo "$0: $*" >&2; exit 1; }

usage_text() {  # the header comment above
  sed -n '2,/^set -euo pipefail$/{/^#/{s/^# \{0,1\}//;p;};}' "${BASH_SOURCE[0]}"
}

q() {  # one word quoted for a POSIX shell (left as is when nothing in it needs quoting)
  if [[ "$1" =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then printf '%s' "$1"
  else printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

qjoin() {  # the words, quoted, space-separated
  local w out=""
  for w in "$@"; do out+="${out:+ }$(q "$w")"; done
  printf '%s' "$out"
}

on_host() {  # on_host HOST COMMAND: run a shell command line on HOST with SSH
  "${SSH_CMD[@]}" "$1" "$2" < /dev/null
}

alive() { kill -0 "$1" 2>/dev/null; }

make_token() {  # make_token FILE: a new random token (64 hex digits) only its owner reads
  local tmp="$1.tmp.$$"
  (umask 077 && od -An -tx1 -N32 /dev/urandom | tr -d ' \n' > "$tmp") && mv -f "$tmp" "$1"
}

node_token_file() {  # node_token_file RANK: the --cluster_token_file of node RANK
  if [[ -n "${NODE_HOST[$1]}" ]]; then echo "$LOG_ABS/cluster.token"; else echo "$TOKEN_SRC"; fi
}

signal_node() {  # signal a node's process group (it leads one, see setsid), else the pid
  kill "-$1" -- "-$2" 2>/dev/null || kill "-$1" "$2" 2>/dev/null || true
}

# ---- the recorded processes: PID_FILE has one line per node, in rank order: "pid" (this
# host) or "host pid" (started with SSH); read_pids fills NODE_PID and PID_HOST ("" = here)
read_pids() {
  NODE_PID=() PID_HOST=()
  local a b
  while read -r a b; do
    [[ "${b:-$a}" =~ ^[0-9]+$ ]] || continue  # blank or garbled
    if [[ -n "$b" ]]; then PID_HOST+=("$a"); NODE_PID+=("$b"); else PID_HOST+=(""); NODE_PID+=("$a"); fi
  done < "$PID_FILE"
}

where() {  # where IDX (or IDX? from running): "pid P" or "pid P on HOST"
  local i="${1%\?}"
  printf 'pid %s' "${NODE_PID[i]}"
  [[ -z "${PID_HOST[i]}" ]] || printf ' on %s' "${PID_HOST[i]}"
}

running() {  # running IDX...: prints those of the recorded nodes that still run, one a
  # line (one SSH call per host); "IDX?" for a node on a host SSH cannot reach
  local i host pids out
  local -A by_host=()
  for i in "$@"; do
    if [[ -z "${PID_HOST[i]}" ]]; then
      if alive "${NODE_PID[i]}"; then echo "$i"; fi
    else
      by_host[${PID_HOST[i]}]+=" $i"
    fi
  done
  for host in "${!by_host[@]}"; do
    pids=""
    for i in ${by_host[$host]}; do pids+=" ${NODE_PID[i]}"; done
    out=$(on_host "$host" "for p in$pids; do kill -0 \$p 2>/dev/null && echo \$p; done; echo ok") || true
    for i in ${by_host[$host]}; do
      if [[ "$out" != *ok ]]; then echo "$i?"
      elif [[ " $(echo "$out" | tr '\n' ' ') " == *" ${NODE_PID[i]} "* ]]; then echo "$i"
      fi
    done
  done
  return 0
}

signal_nodes() {  # signal_nodes SIG IDX...: signal each node's process group (else its pid)
  local sig=$1 i host pids
  shift
  local -A by_host=()
  for i in "$@"; do
    i="${i%\?}"
    if [[ -z "${PID_HOST[i]}" ]]; then signal_node "$sig" "${NODE_PID[i]}"
    else by_host[${PID_HOST[i]}]+=" ${NODE_PID[i]}"
    fi
  done
  for host in "${!by_host[@]}"; do
    pids="${by_host[$host]}"
    on_host "$host" "for p in$pids; do kill -$sig -- -\$p 2>/dev/null || kill -$sig \$p 2>/dev/null; done; true" || true
  done
}

wait_gone() {  # wait_gone SECONDS IDX...: 0 once all these nodes are gone
  local deadline=$((SECONDS + $1))
  shift
  while (( SECONDS <= deadline )); do
    [[ -z "$(running "$@")" ]] && return 0
    sleep 0.5
  done
  return 1
}

log_of() {  # log_of IDX: where node IDX writes its log (on its host)
  if [[ -z "${PID_HOST[$1]}" ]]; then echo "$LOG_DIR/node_$1.log"; else echo "$LOG_ABS/node_$1.log"; fi
}

log_name() {  # log_name IDX: node IDX's log, "HOST:PATH" for one on another host
  if [[ -z "${PID_HOST[$1]}" ]]; then log_of "$1"; else echo "${PID_HOST[$1]}:$(log_of "$1")"; fi
}

# Triton's bindings list the objects they never freed when a process exits (the
# "nanobind: leaked ..." report, some forty lines); it would push the cause off the tail.
EXIT_NOISE='^nanobind: |^ *- leaked |^ *- \.\.\. skipped remainder|^See https://nanobind'

tail_log() {  # tail_log IDX: the last lines of node IDX's log, without the exit noise
  if [[ -z "${PID_HOST[$1]}" ]]; then grep -Ev "$EXIT_NOISE" "$(log_of "$1")" | tail -n 20 || true
  else on_host "${PID_HOST[$1]}" "grep -Ev $(q "$EXIT_NOISE") $(q "$(log_of "$1")") | tail -n 20" || true
  fi
}

stop_cluster() {
  [[ -f "$PID_FILE" ]] || { echo "no cluster recorded in $PID_FILE"; return 0; }
  read_pids
  local n=${#NODE_PID[@]} i workers=() left
  for (( i = 1; i < n; i++ )); do workers+=("$i"); done
  if (( n > 0 )); then
    # The master first: it drains in-flight requests (--shutdown_timeout) and then tells
    # its workers to exit; stopping the workers first would fail those requests.
    [[ -n "$(running 0)" ]] && signal_nodes TERM 0
    wait_gone "$STOP_TIMEOUT" 0 || {
      echo "master $(where 0) still running after ${STOP_TIMEOUT}s; killing it"
      signal_nodes KILL 0
    }
  fi
  if (( n > 1 )); then
    # shellcheck disable=SC2046
    signal_nodes TERM $(running "${workers[@]}")
    wait_gone 15 "${workers[@]}" || for i in $(running "${workers[@]}"); do
      echo "worker $(where "$i") ignored SIGTERM for 15 s; killing it"
      signal_nodes KILL "$i"
    done
  fi
  if (( n > 0 )) && ! wait_gone 5 "${workers[@]}" 0; then
    left=""
    for i in $(running "${workers[@]}" 0); do
      if [[ "$i" == *\? ]]; then left+=" node ${i%\?} ($(where "$i"): cannot reach its host)"
      else left+=" node $i ($(where "$i"))"
      fi
    done
    echo "still running after SIGKILL, or unknown:$left; kept $PID_FILE"
    return 1
  fi
  rm -f "$PID_FILE"
  echo "stopped $n processes"
}

status_cluster() {
  [[ -f "$PID_FILE" ]] || { echo "no cluster recorded in $PID_FILE"; return 1; }
  read_pids
  local i down=0 up
  up=" $(running "${!NODE_PID[@]}" | tr '\n' ' ') "
  for i in "${!NODE_PID[@]}"; do
    if [[ "$up" == *" $i "* ]]; then echo "node $i: $(where "$i") running"
    elif [[ "$up" == *" $i? "* ]]; then echo "node $i: $(where "$i") unknown: '$SSH' cannot reach it"; down=1
    else echo "node $i: $(where "$i") gone"; down=1
    fi
  done
  return $down
}

# ---- the plan: which node runs where, on which device
plan_hosts() {  # fills HOST_NAMES / HOST_SLOTS from HOSTS or HOSTFILE (empty: one host)
  HOST_NAMES=() HOST_SLOTS=()
  local entry line n=0 words
  [[ -n "$HOSTS" && -n "$HOSTFILE" ]] && die "set HOSTS or HOSTFILE, not both"
  if [[ -n "$HOSTFILE" ]]; then
    [[ -r "$HOSTFILE" ]] || die "HOSTFILE=$HOSTFILE: cannot read it"
    while IFS= read -r line || [[ -n "$line" ]]; do
      n=$((n + 1))
      line="${line%%#*}"
      read -r -a words <<< "$line"
      case ${#words[@]} in
        0) ;;
        1) add_host "${words[0]}" "HOSTFILE=$HOSTFILE line $n" ;;
        2) add_host "${words[0]}:${words[1]#slots=}" "HOSTFILE=$HOSTFILE line $n" ;;
        *) die "HOSTFILE=$HOSTFILE line $n: '$line': expected 'host slots' or 'host:slots'" ;;
      esac
    done < "$HOSTFILE"
    (( ${#HOST_NAMES[@]} > 0 )) || die "HOSTFILE=$HOSTFILE names no host"
  elif [[ -n "$HOSTS" ]]; then
    IFS=', ' read -r -a words <<< "$HOSTS"
    for entry in "${words[@]}"; do [[ -z "$entry" ]] || add_host "$entry" "HOSTS=$HOSTS"; done
    (( ${#HOST_NAMES[@]} > 0 )) || die "HOSTS=$HOSTS names no host"
  fi
  return 0
}

add_host() {  # add_host HOST:SLOTS WHERE
  local host="${1%:*}" slots="${1##*:}" h
  [[ "$1" == *:* && -n "$host" && "$slots" =~ ^[1-9][0-9]*$ ]] ||
    die "$2: '$1': expected host:slots with slots a positive number"
  for h in ${HOST_NAMES[@]+"${HOST_NAMES[@]}"}; do
    [[ "$h" != "$host" ]] || die "$2: host $host is listed twice; give it all its slots once"
  done
  HOST_NAMES+=("$host") HOST_SLOTS+=("$slots")
}

plan_nodes() {  # NODE_HOST (host, "" = here, unsent), NODE_BIND (--host), NODE_DEV (device index)
  NODE_HOST=() NODE_BIND=() NODE_DEV=()
  local h s total=0
  case "$DEVICE_TYPE" in
    cpu | cuda | npu) ;;
    *) die "DEVICE_TYPE=$DEVICE_TYPE: expected cpu, cuda or npu" ;;
  esac
  plan_hosts
  [[ "$PD_PREFILL" =~ ^[0-9]+$ && "$PD_DECODE" =~ ^[0-9]+$ ]] ||
    die "PD_PREFILL=$PD_PREFILL PD_DECODE=$PD_DECODE: expected numbers of instances"
  if (( PD_PREFILL + PD_DECODE > 0 )); then
    (( PD_PREFILL >= 1 && PD_DECODE >= 1 )) ||
      die "PD_PREFILL=$PD_PREFILL PD_DECODE=$PD_DECODE: a PD deployment needs at least one of each"
    (( ${#HOST_NAMES[@]} == 0 )) ||
      die "PD over several hosts (HOSTS, HOSTFILE) is not implemented: start each instance there with 'xllm --pd_role=...' (docs/pd.md)"
    if [[ -n "$NNODES_GIVEN" && "$NNODES_GIVEN" != $((1 + PD_PREFILL + PD_DECODE)) ]]; then
      die "NNODES=$NNODES_GIVEN but PD_PREFILL=$PD_PREFILL PD_DECODE=$PD_DECODE start $((1 + PD_PREFILL + PD_DECODE)) (the router too); unset NNODES"
    fi
    NNODES=$((1 + PD_PREFILL + PD_DECODE))
  fi
  if (( ${#HOST_NAMES[@]} == 0 )); then
    MULTI=0
    for (( h = 0; h < NNODES; h++ )); do
      NODE_HOST+=("") NODE_BIND+=("$HOST") NODE_DEV+=("$((START_DEVICE + h - (PD_DECODE > 0)))")
    done
    return 0
  fi
  MULTI=1
  for h in "${!HOST_NAMES[@]}"; do
    for (( s = 0; s < HOST_SLOTS[h]; s++ )); do
      NODE_HOST+=("${HOST_NAMES[h]}") NODE_BIND+=("${HOST_NAMES[h]}") NODE_DEV+=("$((START_DEVICE + s))")
    done
    total=$((total + HOST_SLOTS[h]))
  done
  local source="HOSTS=$HOSTS"
  [[ -n "$HOSTFILE" ]] && source="HOSTFILE=$HOSTFILE"
  if [[ -n "$NNODES_GIVEN" && "$NNODES_GIVEN" != "$total" ]]; then
    die "NNODES=$NNODES_GIVEN but $source has $total slots (nodes); make them agree or unset NNODES"
  fi
  NNODES=$total
  [[ -n "$MASTER_NODE_ADDR_GIVEN" ]] || MASTER_NODE_ADDR="${HOST_NAMES[0]}:42123"
  return 0
}

pd_urls() {  # pd_urls FIRST COUNT: the URLs of COUNT PD instances from node FIRST on
  local j
  for (( j = $1; j < $1 + $2; j++ )); do printf 'http://%s:%s\n' "$HOST" "$((START_PORT + j))"; done
}

pd_role_words() {  # pd_role_words RANK: sets ROLE, the PD flags of node RANK (PD mode)
  local prefill=()
  mapfile -t prefill < <(pd_urls 1 "$PD_PREFILL")
  if (( $1 <= PD_PREFILL )); then ROLE=(--pd_role=prefill)
  else ROLE=(--pd_role=decode --pd_prefill "${prefill[@]}")
  fi
}

node_words() {  # node_words RANK PYTHON: sets WORDS, the command line of node RANK
  local i=$1 py=$2 device extra=() draft=() common cluster
  if [[ "$DEVICE_TYPE" == cpu ]]; then device=cpu; else device="$DEVICE_TYPE:0"; fi
  if (( PD_DECODE > 0 && i == 0 )); then  # the router: no model, no device
    local decode=() prefill=()
    mapfile -t decode < <(pd_urls $((1 + PD_PREFILL)) "$PD_DECODE")
    mapfile -t prefill < <(pd_urls 1 "$PD_PREFILL")
    WORDS=(setsid nohup "$py" -m xllm_py --pd_role=router --host "$HOST" --port "$START_PORT"
           --pd_decode "${decode[@]}" --pd_prefill "${prefill[@]}"
           --cluster_token_file="$(node_token_file "$i")")
    return 0
  fi
  cluster=(--master_node_addr="$MASTER_NODE_ADDR" --nnodes="$NNODES" --ep_size="$EP_SIZE"
           --dp_size="$DP_SIZE" --enable_dp_attention="$ENABLE_DP_ATTENTION" --node_rank="$i")
  if (( PD_DECODE > 0 )); then pd_role_words "$i"; cluster=("${ROLE[@]}"); fi
  common=(
    "${cluster[@]}"
    --num_speculative_tokens "$NUM_SPECULATIVE_TOKENS"
    --max_memory_utilization="$MAX_MEMORY_UTILIZATION"
    --max_tokens_per_batch="$MAX_TOKENS_PER_BATCH" --max_seqs_per_batch="$MAX_SEQS_PER_BATCH"
    --enable_mla=true --block_size="$BLOCK_SIZE"
    --enable_prefix_cache="$ENABLE_PREFIX_CACHE"
    --enable_chunked_prefill="$ENABLE_CHUNKED_PREFILL" --host "${NODE_BIND[i]}"
    --cluster_token_file="$(node_token_file "$i")"
  )
  [[ -n "$MODEL_PATH" ]] && common+=(--model "$MODEL_PATH")
  if [[ -n "$DRAFT_MODEL_PATH" && "$NUM_SPECULATIVE_TOKENS" != 0 ]]; then
    draft=(--draft_model "$DRAFT_MODEL_PATH" --draft_devices="$device")
  fi
  read -r -a extra <<< "$EXTRA_ARGS"
  WORDS=()
  if [[ "$DEVICE_TYPE" == cuda ]]; then WORDS+=(env "CUDA_VISIBLE_DEVICES=${NODE_DEV[i]}")
  elif [[ "$DEVICE_TYPE" == npu ]]; then WORDS+=(env "ASCEND_RT_VISIBLE_DEVICES=${NODE_DEV[i]}")
  fi
  if [[ -n "${NODE_HOST[i]}" && -n "$REMOTE_ENV" ]]; then
    (( ${#WORDS[@]} > 0 )) || WORDS=(env)
    local remote_env
    read -r -a remote_env <<< "$REMOTE_ENV"
    WORDS+=("${remote_env[@]}")
  fi
  # setsid: each node leads its own process group, so `stop` can signal the whole group
  WORDS+=(setsid nohup "$py" -m xllm_py "${common[@]}" ${draft[@]+"${draft[@]}"} --devices="$device")
  WORDS+=(--port "$((START_PORT + i))" ${extra[@]+"${extra[@]}"})
}

host_command() {  # host_command HOST: the shell command line that starts HOST's nodes
  # there and prints their pids, one a line
  local host=$1 i cmd="" sep="" token
  token=$(q "$LOG_ABS/cluster.token")
  # the token arrives on standard input; a temporary file and mv, because on this host
  # standard input may be that very file
  cmd="mkdir -p $(q "$LOG_ABS") && (umask 077 && cat > $token.tmp && mv -f $token.tmp $token)"
  cmd+=" && cd $(q "$REMOTE_ROOT") || exit 1"
  for i in "${!NODE_HOST[@]}"; do
    [[ "${NODE_HOST[i]}" == "$host" ]] || continue
    node_words "$i" "$REMOTE_PYTHON"
    cmd+="; $sep$(qjoin "${WORDS[@]}") > $(q "$LOG_ABS/node_$i.log") 2>&1 < /dev/null & echo \$!"
    sep="sleep 0.5; "
  done
  printf '%s' "$cmd"
}

healthy() {  # healthy URL: node 0 answers /health (a PD router: with every instance live,
  # where one live decode instance would do for it)
  local body
  body=$(curl -sf --max-time 5 "$1/health" 2> /dev/null) || return 1
  (( PD_DECODE == 0 )) || [[ "$body" == "{\"decode\":$PD_DECODE,\"prefill\":$PD_PREFILL}" ]]
}

start_cluster() {
  plan_nodes
  local url i h
  if (( MULTI )); then url="http://${HOST_NAMES[0]}:$START_PORT"; else url="http://$HOST:$START_PORT"; fi
  if [[ -n "$CLUSTER_TOKEN_FILE" && ! -r "$CLUSTER_TOKEN_FILE" ]]; then
    die "CLUSTER_TOKEN_FILE=$CLUSTER_TOKEN_FILE: cannot read it"
  fi
  case " $EXTRA_ARGS" in
    *" --api_key"* | *" --cluster_token "* | *" --cluster_token="*)
      die "EXTRA_ARGS carries a secret: set XLLM_API_KEY, or CLUSTER_TOKEN_FILE, instead" ;;
  esac
  if [[ "$DRY_RUN" == 1 ]]; then
    if (( MULTI )); then
      for h in "${HOST_NAMES[@]}"; do
        echo "$(qjoin "${SSH_CMD[@]}" "$h") $(q "$(host_command "$h")") < $(q "$TOKEN_SRC")"
      done
    else
      for (( i = 0; i < NNODES; i++ )); do
        node_words "$i" "$PYTHON"
        echo "$(qjoin "${WORDS[@]}") > $(q "$LOG_DIR/node_$i.log") 2>&1 < /dev/null &"
      done
    fi
    echo "# then: wait for $url/health"
    return 0
  fi
  mkdir -p "$LOG_DIR"
  if [[ -f "$PID_FILE" ]]; then
    read_pids
    local up
    up=$(running "${!NODE_PID[@]}")
    up="${up%%$'\n'*}"
    if [[ -n "$up" ]]; then
      echo "a cluster from $PID_FILE is still running ($(where "$up")); run '$0 stop' first" >&2
      exit 1
    fi
    rm -f "$PID_FILE"
  fi
  [[ -n "$CLUSTER_TOKEN_FILE" ]] || make_token "$TOKEN_SRC"
  if (( MULTI )); then
    local out pids n rc
    for h in "${!HOST_NAMES[@]}"; do
      rc=0
      out=$("${SSH_CMD[@]}" "${HOST_NAMES[h]}" "$(host_command "${HOST_NAMES[h]}")" < "$TOKEN_SRC") || rc=$?
      pids=$(echo "$out" | grep -E '^[0-9]+$' || true)
      for i in $pids; do echo "${HOST_NAMES[h]} $i" >> "$PID_FILE"; done
      n=$(echo "$pids" | wc -w)
      if (( n != HOST_SLOTS[h] )); then
        echo "starting ${HOST_SLOTS[h]} nodes on ${HOST_NAMES[h]} with '$SSH' gave $n pids (exit status $rc)${out:+; it printed:}" >&2
        [[ -z "$out" ]] || echo "$out" >&2
        [[ -f "$PID_FILE" ]] && stop_cluster > /dev/null
        exit 1
      fi
    done
  else
    for (( i = 0; i < NNODES; i++ )); do
      node_words "$i" "$PYTHON"
      "${WORDS[@]}" > "$LOG_DIR/node_$i.log" 2>&1 < /dev/null &
      echo $! >> "$PID_FILE"
      sleep 0.5
    done
  fi
  local deadline=$((SECONDS + HEALTH_TIMEOUT)) up
  until healthy "$url"; do
    read_pids
    up=" $(running "${!NODE_PID[@]}" | tr '\n' ' ') "
    for i in "${!NODE_PID[@]}"; do
      if [[ "$up" != *" $i "* && "$up" != *" $i? "* ]]; then
        echo "node $i ($(where "$i")) exited during start-up; last lines of $(log_name "$i"):" >&2
        tail_log "$i" >&2
        stop_cluster > /dev/null
        exit 1
      fi
    done
    if (( SECONDS > deadline )); then
      if (( MULTI )); then
        echo "no healthy master at $url after ${HEALTH_TIMEOUT}s; last lines of $(log_name 0):" >&2
        tail_log 0 >&2
      else
        echo "no healthy master at $url after ${HEALTH_TIMEOUT}s; see $LOG_DIR/" >&2
      fi
      stop_cluster > /dev/null
      exit 1
    fi
    sleep 1
  done
  if (( MULTI )); then
    echo "cluster of $NNODES nodes on ${#HOST_NAMES[@]} hosts is up: $url/v1 (logs in $LOG_ABS/ on each host, stop with '$0 stop')"
  elif (( PD_DECODE > 0 )); then
    echo "PD deployment of $PD_PREFILL prefill and $PD_DECODE decode instances is up behind its router: $url/v1 (logs in $LOG_DIR/, stop with '$0 stop')"
  else
    echo "cluster of $NNODES nodes is up: $url/v1 (logs in $LOG_DIR/, stop with '$0 stop')"
  fi
}

case "${1:-start}" in
  start) start_cluster ;;
  stop) stop_cluster ;;
  status) status_cluster ;;
  -h | --help | help) usage_text ;;
  *) echo "usage: $0 [start|stop|status]" >&2; exit 2 ;;
esac
