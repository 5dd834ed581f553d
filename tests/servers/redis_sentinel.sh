#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# A throwaway Redis Sentinel set-up on free 127.0.0.1 ports, for tests: a primary (p1), one
# replica (p2) and three sentinels (s1 s2 s3, quorum 2) watching the master "turnstile".
#   redis_sentinel.sh start DIR        writes DIR/url (redis+sentinel://…/turnstile) and DIR/nodes
#                                      ("ID ROLE HOST PORT PID" lines; ROLE as started)
#   redis_sentinel.sh stop DIR
#   redis_sentinel.sh kill DIR ID      kill -9 of one node
#   redis_sentinel.sh start-node DIR ID [wipe]
#                                      restarts a data node as a replica of the current primary
#                                      (wipe: without its data files), or a sentinel
#   redis_sentinel.sh pause|resume DIR ID   SIGSTOP / SIGCONT
#   redis_sentinel.sh leader DIR       the ID of the data node the sentinels call the primary
#   redis_sentinel.sh healthy DIR      exit 0 when every node runs, the sentinels agree on a
#                                      primary that says it is one, with its replica online
#   redis_sentinel.sh failover DIR     SENTINEL FAILOVER, then waits until a sentinel names the
#                                      new primary (prints its ID; `healthy` comes later)
# Data nodes keep no data on disk (persistence off): a restarted node resyncs from the primary.
# Sentinels use redis-server --sentinel (Debian's redis-sentinel is the same binary).
# TURNSTILE_CLUSTER_NETNS / TURNSTILE_CLUSTER_HOSTS at start (five of each, for p1 p2 s1 s2 s3):
# each node in a network namespace of its own (redis_nodes.sh).
set -eu
action=$1
dir=$2
master=turnstile
nodes_all="p1 p2 s1 s2 s3"

. "$(dirname "$0")/redis_nodes.sh"

role_of() {  # ID: the role as started
  case $1 in p1) echo primary ;; p2) echo replica ;; *) echo sentinel ;; esac
}

start_data() {  # ID [PRIMARY_ID]
  id=$1
  mkdir -p "$dir/$id"
  if [ $# -ge 2 ]; then
    set -- --replicaof "$(node_field "$2" 3)" "$(node_field "$2" 4)"
  else
    set --
  fi
  node_server "$id" --bind "$(node_field "$id" 3)" --port "$(node_field "$id" 4)" --save '' --appendonly no \
    --daemonize yes --dir "$dir/$id" --pidfile "$dir/$id.pid" --logfile "$dir/$id.log" \
    --repl-diskless-sync yes --repl-diskless-sync-delay 0 --repl-ping-replica-period 1 "$@"
  wait_ping "$id"
}

start_sentinel() {  # ID PRIMARY_ID
  # A sentinel rewrites its configuration file: a fresh one each start.
  cat > "$dir/$1.conf" <<EOF
bind $(node_field "$1" 3)
port $(node_field "$1" 4)
daemonize yes
pidfile $dir/$1.pid
logfile $dir/$1.log
dir $dir
sentinel monitor $master $(node_field "$2" 3) $(node_field "$2" 4) 2
sentinel down-after-milliseconds $master 1000
sentinel failover-timeout $master 3000
sentinel parallel-syncs $master 1
EOF
  node_server "$1" "$dir/$1.conf" --sentinel
  wait_ping "$1"
}

# The primary's port as the sentinels answer (the first that answers; ports differ per node).
primary_port() {
  for s in s1 s2 s3; do
    answer=$(rcli "$s" SENTINEL get-master-addr-by-name "$master" 2>/dev/null | sed -n 2p)
    if [ -n "$answer" ]; then echo "$answer"; return 0; fi
  done
  return 1
}

id_of_port() {  # PORT: the data node listening on it
  awk -v p="$1" '$4 == p && ($1 == "p1" || $1 == "p2") { print $1 }' "$dir/nodes"
}

leader() {
  port=$(primary_port) || return 1
  id_of_port "$port"
}

healthy() {
  for id in p1 p2 s1 s2 s3; do
    [ "$(rcli "$id" ping 2>/dev/null)" = PONG ] || { [ -n "${HEALTHY_WHY:-}" ] && echo "unhealthy at check 1" >&2; return 1; }
  done
  first=""
  for s in s1 s2 s3; do
    answer=$(rcli "$s" SENTINEL get-master-addr-by-name "$master" 2>/dev/null | sed -n 2p)
    [ -n "$answer" ] || { [ -n "${HEALTHY_WHY:-}" ] && echo "unhealthy at check 2" >&2; return 1; }
    [ -z "$first" ] || [ "$first" = "$answer" ] || { [ -n "${HEALTHY_WHY:-}" ] && echo "unhealthy at check 3" >&2; return 1; }
    first=$answer
    # Every sentinel knows the other two, and the primary is not thought down.
    flags=$(rcli "$s" SENTINEL master "$master" 2>/dev/null | awk 'prev == "flags" { print } { prev = $0 }')
    [ "$flags" = master ] || { [ -n "${HEALTHY_WHY:-}" ] && echo "unhealthy at check 4" >&2; return 1; }
    others=$(rcli "$s" SENTINEL master "$master" 2>/dev/null | awk 'prev == "num-other-sentinels" { print } { prev = $0 }')
    [ "$others" = 2 ] || { [ -n "${HEALTHY_WHY:-}" ] && echo "unhealthy at check 5" >&2; return 1; }
  done
  primary=$(id_of_port "$first")
  [ -n "$primary" ] || { [ -n "${HEALTHY_WHY:-}" ] && echo "unhealthy at check 6" >&2; return 1; }
  info=$(rcli "$primary" INFO replication 2>/dev/null | tr -d '\r')
  echo "$info" | grep -q '^role:master$' || { [ -n "${HEALTHY_WHY:-}" ] && echo "unhealthy at check 6" >&2; return 1; }
  echo "$info" | grep -q '^slave0:.*state=online' || { [ -n "${HEALTHY_WHY:-}" ] && echo "unhealthy at check 7" >&2; return 1; }
  # The replica reports its link up, and every sentinel lists it as a replica that is not down.
  for s in s1 s2 s3; do
    rcli "$s" SENTINEL replicas "$master" 2>/dev/null |
      awk 'prev == "flags" && $0 == "slave" { ok = 1 } { prev = $0 } END { exit !ok }' || { [ -n "${HEALTHY_WHY:-}" ] && echo "unhealthy at check 8" >&2; return 1; }
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
  rm -f "$dir/url" "$dir/nodes" "$dir/nodes.tmp"
  place_nodes
  mv "$dir/nodes.tmp" "$dir/nodes"
  start_data p1 || { echo "p1 did not start" >&2; cat "$dir/p1.log" >&2; exit 1; }
  start_data p2 p1 || { echo "p2 did not start" >&2; cat "$dir/p2.log" >&2; exit 1; }
  for id in s1 s2 s3; do
    start_sentinel "$id" p1 || { echo "$id did not start" >&2; cat "$dir/$id.log" >&2; exit 1; }
  done
  for id in p1 p2 s1 s2 s3; do set_pid "$id" "$(pid_of "$id")"; done
  if ! wait_healthy 30; then
    echo "the sentinel set-up did not become healthy" >&2
    tail -n 20 "$dir"/*.log >&2
    exit 1
  fi
  echo "redis+sentinel://$(node_field s1 3):$(node_field s1 4),$(node_field s2 3):$(node_field s2 4),$(node_field s3 3):$(node_field s3 4)/$master" > "$dir/url"
  echo "redis sentinel set-up ready: $(cat "$dir/url")"
  ;;
stop)
  for id in s1 s2 s3 p1 p2; do stop_node "$id"; done
  ;;
kill|pause|resume)
  node_action "$action" "$3"
  ;;
start-node)
  id=$3
  port=$(node_field "$id" 4)
  [ -n "$port" ] || { echo "no node $id" >&2; exit 64; }
  [ -f "$dir/$id.pid" ] && kill -0 "$(cat "$dir/$id.pid")" 2>/dev/null && { echo "$id is running" >&2; exit 1; }
  case $id in
  p*)
    [ "${4:-}" = wipe ] && rm -rf "${dir:?}/$id"
    primary=$(primary_port) || { echo "no sentinel names a primary" >&2; exit 1; }
    if [ "$primary" = "$port" ]; then
      # The sentinels still name this node: it comes back as the primary (empty).
      start_data "$id"
    else
      start_data "$id" "$(id_of_port "$primary")"
    fi
    ;;
  s*)
    # The sentinel's own rewritten configuration knows the current primary and its peers.
    node_server "$id" "$dir/$id.conf" --sentinel
    wait_ping "$id"
    ;;
  esac
  set_pid "$id" "$(pid_of "$id")"
  ;;
leader)
  leader
  ;;
healthy)
  healthy
  ;;
failover)
  before=$(leader)
  # Refused while a previous failover is still in progress: try again for a while.
  for _ in $(seq 1 50); do
    out=$(rcli s1 SENTINEL FAILOVER "$master" 2>&1) && [ "$out" = OK ] && break
    sleep 0.2
  done
  [ "$out" = OK ] || { echo "SENTINEL FAILOVER: $out" >&2; exit 1; }
  # Until a sentinel names the new primary (the old one may still be catching up as a
  # replica: `healthy` says when that is done).
  for _ in $(seq 1 150); do
    now=$(leader || true)
    if [ -n "$now" ] && [ "$now" != "$before" ]; then echo "$now"; exit 0; fi
    sleep 0.1
  done
  echo "no new primary after SENTINEL FAILOVER" >&2
  exit 1
  ;;
*)
  echo "usage: $0 start|stop|kill|start-node|pause|resume|leader|healthy|failover DIR [ID]" >&2
  exit 64
  ;;
esac
