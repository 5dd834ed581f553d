# SPDX-License-Identifier: Apache-2.0
# Sourced by redis_sentinel.sh and redis_cluster.sh (POSIX sh): their nodes' bookkeeping in
# $dir/nodes ("ID ROLE HOST PORT PID ..." lines) and $dir/ID.pid, and the node actions they share.
# The sourcing script defines `healthy` (for wait_healthy) and $nodes_all (every node's ID).
#
# Network namespaces (partition tests; see netns.sh): with TURNSTILE_CLUSTER_NETNS="ns1 ns2 ..."
# and TURNSTILE_CLUSTER_HOSTS="a1 a2 ..." at start, the i-th node of $nodes_all listens on a_i
# inside ns_i. DIR/nodes keeps its host, DIR/netns ("ID NAMESPACE" lines) its namespace, and
# every command reaches a node from the node's own namespace (so it answers while cut off).
# The helpers every server script shares (stop_node, wait_until, free_port, start_tries) come
# from common.sh.
. "$(dirname "$0")/common.sh"

nth() {  # N WORDS...: the N-th of WORDS, nothing when there are fewer
  nth_n=$1
  shift
  [ "$nth_n" -le $# ] && eval "echo \"\${$nth_n}\"" || true
}

# Writes DIR/netns and DIR/nodes.tmp's first fields ("ID ROLE HOST PORT 0") for $nodes_all;
# role_of ID gives the role as started.
place_nodes() {
  : > "$dir/netns"
  : > "$dir/nodes.tmp"
  k=0
  for id in $nodes_all; do
    k=$((k + 1))
    # shellcheck disable=SC2086
    ns=$(nth "$k" ${TURNSTILE_CLUSTER_NETNS:-})
    # shellcheck disable=SC2086
    host=$(nth "$k" ${TURNSTILE_CLUSTER_HOSTS:-})
    [ -n "$ns" ] && echo "$id $ns" >> "$dir/netns"
    echo "$id $(role_of "$id") ${host:-127.0.0.1} $(free_port 1 "$dir/nodes.tmp") 0" >> "$dir/nodes.tmp"
  done
}

# Runs COMMAND in node ID's namespace (or here, without namespaces).
in_node() {  # ID COMMAND...
  in_ns=$(awk -v id="$1" '$1 == id { print $2 }' "$dir/netns" 2>/dev/null || true)
  shift
  if [ -n "$in_ns" ]; then ip netns exec "$in_ns" "$@"; else "$@"; fi
}

# redis-cli against node ID, from its namespace.
rcli() {  # ID ARGS...
  rcli_id=$1
  shift
  in_node "$rcli_id" redis-cli -h "$(node_field "$rcli_id" 3)" -p "$(node_field "$rcli_id" 4)" "$@"
}

# redis-server in node ID's namespace. Protected mode off: it would refuse clients from the
# other namespaces (no password; only loopback or the test's own namespaces reach a node).
node_server() {  # ID ARGS...
  node_server_id=$1
  shift
  in_node "$node_server_id" redis-server "$@" --protected-mode no
}

node_field() {  # ID FIELD(2=role 3=host 4=port 5=pid)
  awk -v id="$1" -v f="$2" '$1 == id { print $f }' "$dir/nodes"
}

set_pid() {  # ID PID
  awk -v id="$1" -v pid="$2" '$1 == id { $5 = pid } { print }' "$dir/nodes" > "$dir/nodes.new"
  mv "$dir/nodes.new" "$dir/nodes"
}

ping_ok() {  # ID
  [ "$(rcli "$1" ping 2>/dev/null)" = PONG ]
}

wait_ping() {  # ID
  wait_until 100 ping_ok "$1"
}

pid_of() { cat "$dir/$1.pid" 2>/dev/null || echo 0; }
# The pid of a running node, or exit 1: never 0, which kill(1) takes for its own process group.
live_pid() {
  pid=$(pid_of "$1")
  if [ "$pid" -le 0 ] 2>/dev/null || ! kill -0 "$pid" 2>/dev/null; then echo "$1 is not running" >&2; exit 1; fi
  echo "$pid"
}

node_pidfile() {  # ID
  echo "$dir/$1.pid"
}

wait_healthy() {  # SECONDS
  wait_until $(($1 * 10)) healthy
}

# start: `$0 start-once DIR` up to three times (a port taken between its choice and its use
# fails an attempt), stopping what an attempt left.
start_once_or_stop() {
  "$0" start-once "$dir" && return 0
  "$0" stop "$dir" 2>/dev/null || true
  return 1
}

start_retrying() {
  start_tries 3 start_once_or_stop && exit 0
  exit 1
}

# kill ID (kill -9), pause ID (SIGSTOP), resume ID (SIGCONT); false for any other action.
node_action() {  # ACTION ID
  case $1 in
  kill)
    pid=$(pid_of "$2")
    [ "$pid" != 0 ] && kill -9 "$pid" 2>/dev/null || true
    wait_until 50 process_gone "$pid" || true
    rm -f "$dir/$2.pid"
    ;;
  pause) kill -STOP "$(live_pid "$2")" ;;
  resume) kill -CONT "$(live_pid "$2")" ;;
  *) return 1 ;;
  esac
}
