#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# A throwaway Redis Cluster on free 127.0.0.1 ports, for tests: three primaries (n1 n2 n3) with
# one replica each (n4 n5 n6), cluster-node-timeout 1000 ms so a failover takes seconds.
#   redis_cluster.sh start DIR         writes DIR/url (redis+cluster://n1,n2,n3) and DIR/nodes
#                                      ("ID ROLE HOST PORT PID BUSPORT" lines; ROLE as started)
#   redis_cluster.sh stop DIR
#   redis_cluster.sh kill DIR ID       kill -9 of one node
#   redis_cluster.sh start-node DIR ID [wipe]
#                                      restarts a node with its cluster configuration (it rejoins;
#                                      a primary that was failed over comes back as a replica).
#                                      Nodes keep no data on disk (persistence off), so a node
#                                      always comes back without its data, `wipe` or not. Its
#                                      identity (nodes.conf) is kept: a node of a new identity on
#                                      the old one's address leaves the old one's slots served by
#                                      nobody until an operator steps in (CLUSTER FORGET).
#   redis_cluster.sh pause|resume DIR ID    SIGSTOP / SIGCONT
#   redis_cluster.sh owner DIR KEY     the ID of the node serving KEY's slot (by n1's view, or
#                                      the first node that answers)
#   redis_cluster.sh replica-of DIR ID the ID of a replica of primary ID
#   redis_cluster.sh leader DIR        the ID of a primary (the first that says so), for the fault
#                                      suite's "hit the leader"
#   redis_cluster.sh failover DIR ID   CLUSTER FAILOVER on a replica of primary ID, then waits
#                                      until that replica serves the slots (prints its ID)
#   redis_cluster.sh healthy DIR       exit 0 when every node runs, every node says
#                                      cluster_state:ok, the configuration agrees (--cluster
#                                      check) and each of three primaries has a replica linked
# TURNSTILE_CLUSTER_NETNS / TURNSTILE_CLUSTER_HOSTS at start (six of each, for n1..n6): each node
# in a network namespace of its own (redis_nodes.sh).
set -eu
action=$1
dir=$2
nodes_all="n1 n2 n3 n4 n5 n6"

. "$(dirname "$0")/redis_nodes.sh"

cli() { rcli "$@"; }  # ID ARGS...

role_of() {  # ID: the role as started (redis-cli --cluster create chooses; see start-once)
  case $1 in n1|n2|n3) echo primary ;; *) echo replica ;; esac
}

start_data() {  # ID
  id=$1
  mkdir -p "$dir/$id"
  node_server "$id" --bind "$(node_field "$id" 3)" --port "$(node_field "$id" 4)" \
    --cluster-enabled yes --cluster-port "$(node_field "$id" 6)" \
    --cluster-config-file "$dir/$id/nodes.conf" --cluster-node-timeout 1000 \
    --cluster-replica-validity-factor 0 --cluster-require-full-coverage no \
    --save '' --appendonly no --daemonize yes \
    --dir "$dir/$id" --pidfile "$dir/$id.pid" --logfile "$dir/$id.log" \
    --repl-diskless-sync yes --repl-diskless-sync-delay 0 --repl-ping-replica-period 1
  wait_ping "$id"
}

# CLUSTER NODES from the first node that answers.
cluster_nodes() {
  for id in $nodes_all; do
    out=$(cli "$id" CLUSTER NODES 2>/dev/null) && [ -n "$out" ] && { echo "$out"; return 0; }
  done
  return 1
}

id_of_port() {  # PORT
  awk -v p="$1" '$4 == p { print $1 }' "$dir/nodes"
}

owner() {  # KEY
  for id in $nodes_all; do
    slot=$(cli "$id" CLUSTER KEYSLOT "$1" 2>/dev/null) || continue
    case $slot in ''|*[!0-9]*) continue ;; esac
    # CLUSTER SLOTS: start, end, then the primary's host and port.
    port=$(cli "$id" CLUSTER SLOTS 2>/dev/null | awk -v s="$slot" '
      { line[NR] = $0 }
      END {
        for (i = 1; i + 3 <= NR; i++) {
          if (line[i] ~ /^[0-9]+$/ && line[i + 1] ~ /^[0-9]+$/ && line[i + 2] ~ /\./ && line[i] + 0 <= s && s <= line[i + 1] + 0) {
            print line[i + 3]; exit
          }
        }
      }') || continue
    [ -n "$port" ] && { id_of_port "$port"; return 0; }
  done
  return 1
}

replica_of() {  # ID
  primary_id=$(cli "$1" CLUSTER MYID 2>/dev/null) || return 1
  port=$(cluster_nodes | awk -v m="$primary_id" '$4 == m && $3 !~ /fail/ { split($2, a, "[:@]"); print a[2]; exit }')
  [ -n "$port" ] && id_of_port "$port"
}

healthy() {
  for id in $nodes_all; do
    [ "$(cli "$id" ping 2>/dev/null)" = PONG ] || return 1
    cli "$id" CLUSTER INFO 2>/dev/null | tr -d '\r' | grep -q '^cluster_state:ok$' || return 1
  done
  in_node n1 redis-cli --cluster check "$(node_field n1 3):$(node_field n1 4)" >/dev/null 2>&1 || return 1
  # Three primaries with slots, each with a replica that is linked and not failing.
  nodes=$(cluster_nodes) || return 1
  echo "$nodes" | awk '
    $3 ~ /master/ && $3 !~ /fail/ && NF >= 9 { primary[$1] = 1; n++ }
    $3 ~ /slave/ && $3 !~ /fail/ && $8 == "connected" { replica[$4] = 1 }
    END { if (n != 3) exit 1; for (m in primary) if (!(m in replica)) exit 1; exit 0 }' || return 1
  for id in $nodes_all; do
    role=$(cli "$id" ROLE 2>/dev/null | head -n 1)
    if [ "$role" = slave ]; then
      cli "$id" INFO replication 2>/dev/null | tr -d '\r' | grep -q '^master_link_status:up$' || return 1
    fi
  done
  return 0
}

case "$action" in
start)
  start_retrying
  ;;
start-once)
  "$0" stop "$dir" 2>/dev/null || true
  mkdir -p "$dir"
  rm -rf "$dir/url" "$dir/nodes" "$dir/nodes.tmp" "$dir"/n?
  place_nodes
  # Each line gets the node's cluster bus port.
  for id in $nodes_all; do
    bus=$(free_port 1 "$dir/nodes.tmp")
    awk -v id="$id" -v bus="$bus" '$1 == id { $6 = bus } { print }' "$dir/nodes.tmp" > "$dir/nodes.tmp2"
    mv "$dir/nodes.tmp2" "$dir/nodes.tmp"
  done
  mv "$dir/nodes.tmp" "$dir/nodes"
  for id in $nodes_all; do
    start_data "$id" || { echo "$id did not start" >&2; cat "$dir/$id.log" >&2; exit 1; }
    set_pid "$id" "$(pid_of "$id")"
  done
  addresses=""
  for id in $nodes_all; do addresses="$addresses $(node_field "$id" 3):$(node_field "$id" 4)"; done
  # shellcheck disable=SC2086
  in_node n1 redis-cli --cluster create $addresses --cluster-replicas 1 --cluster-yes > "$dir/create.log" 2>&1 ||
    { echo "redis-cli --cluster create failed" >&2; cat "$dir/create.log" >&2; exit 1; }
  if ! wait_healthy 60; then
    echo "the cluster did not become healthy" >&2
    tail -n 20 "$dir"/*.log >&2
    exit 1
  fi
  # redis-cli pairs replicas with primaries as it likes: record the roles as they are.
  for id in $nodes_all; do
    role=$(cli "$id" ROLE | head -n 1)
    [ "$role" = master ] && role=primary || role=replica
    awk -v id="$id" -v r="$role" '$1 == id { $2 = r } { print }' "$dir/nodes" > "$dir/nodes.new"
    mv "$dir/nodes.new" "$dir/nodes"
  done
  echo "redis+cluster://$(node_field n1 3):$(node_field n1 4),$(node_field n2 3):$(node_field n2 4),$(node_field n3 3):$(node_field n3 4)" > "$dir/url"
  echo "redis cluster ready: $(cat "$dir/url")"
  ;;
stop)
  for id in $nodes_all; do stop_node "$id"; done
  ;;
kill|pause|resume)
  node_action "$action" "$3"
  ;;
start-node)
  id=$3
  port=$(node_field "$id" 4)
  [ -n "$port" ] || { echo "no node $id" >&2; exit 64; }
  [ -f "$dir/$id.pid" ] && kill -0 "$(cat "$dir/$id.pid")" 2>/dev/null && { echo "$id is running" >&2; exit 1; }
  # `wipe`: nothing more to remove (no data files; the identity stays, see above).
  start_data "$id"
  set_pid "$id" "$(pid_of "$id")"
  ;;
owner)
  owner "$3"
  ;;
replica-of)
  replica_of "$3"
  ;;
leader)
  for id in $nodes_all; do
    [ "$(cli "$id" ROLE 2>/dev/null | head -n 1)" = master ] && { echo "$id"; exit 0; }
  done
  exit 1
  ;;
failover)
  replica=$(replica_of "$3") || { echo "no replica of $3" >&2; exit 1; }
  [ -n "$replica" ] || { echo "no replica of $3" >&2; exit 1; }
  # Refused while the replica is still syncing: try again for a while.
  for _ in $(seq 1 50); do
    out=$(cli "$replica" CLUSTER FAILOVER 2>&1) && [ "$out" = OK ] && break
    sleep 0.2
  done
  [ "$out" = OK ] || { echo "CLUSTER FAILOVER: $out" >&2; exit 1; }
  for _ in $(seq 1 150); do
    [ "$(cli "$replica" ROLE 2>/dev/null | head -n 1)" = master ] && { echo "$replica"; exit 0; }
    sleep 0.1
  done
  echo "$replica did not become a primary after CLUSTER FAILOVER" >&2
  exit 1
  ;;
healthy)
  healthy
  ;;
*)
  echo "usage: $0 start|stop|kill|start-node|pause|resume|owner|replica-of|leader|failover|healthy DIR [ID|KEY]" >&2
  exit 64
  ;;
esac
