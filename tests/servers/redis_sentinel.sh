#!/bin/sh
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
set -eu
action=$1
dir=$2
master=turnstile

. "$(dirname "$0")/redis_nodes.sh"

start_data() {  # ID PORT [REPLICAOF_PORT]
  mkdir -p "$dir/$1"
  if [ $# -ge 3 ]; then
    set -- "$1" "$2" --replicaof 127.0.0.1 "$3"
  fi
  id=$1
  port=$2
  shift 2
  redis-server --bind 127.0.0.1 --port "$port" --save '' --appendonly no --daemonize yes \
    --dir "$dir/$id" --pidfile "$dir/$id.pid" --logfile "$dir/$id.log" \
    --repl-diskless-sync yes --repl-diskless-sync-delay 0 --repl-ping-replica-period 1 "$@"
  wait_ping "$port"
}

start_sentinel() {  # ID PORT PRIMARY_PORT
  # A sentinel rewrites its configuration file: a fresh one each start.
  cat > "$dir/$1.conf" <<EOF
bind 127.0.0.1
port $2
daemonize yes
pidfile $dir/$1.pid
logfile $dir/$1.log
dir $dir
sentinel monitor $master 127.0.0.1 $3 2
sentinel down-after-milliseconds $master 1000
sentinel failover-timeout $master 3000
sentinel parallel-syncs $master 1
EOF
  redis-server "$dir/$1.conf" --sentinel
  wait_ping "$2"
}

# The primary's port as the sentinels answer (the first that answers).
primary_port() {
  for s in s1 s2 s3; do
    sp=$(node_field "$s" 4)
    answer=$(redis-cli -h 127.0.0.1 -p "$sp" SENTINEL get-master-addr-by-name "$master" 2>/dev/null | sed -n 2p)
    if [ -n "$answer" ]; then echo "$answer"; return 0; fi
  done
  return 1
}

leader() {
  port=$(primary_port) || return 1
  awk -v p="$port" '$4 == p && ($1 == "p1" || $1 == "p2") { print $1 }' "$dir/nodes"
}

healthy() {
  for id in p1 p2 s1 s2 s3; do
    [ "$(redis-cli -h 127.0.0.1 -p "$(node_field "$id" 4)" ping 2>/dev/null)" = PONG ] || { [ -n "${HEALTHY_WHY:-}" ] && echo "unhealthy at check 1" >&2; return 1; }
  done
  first=""
  for s in s1 s2 s3; do
    sp=$(node_field "$s" 4)
    answer=$(redis-cli -h 127.0.0.1 -p "$sp" SENTINEL get-master-addr-by-name "$master" 2>/dev/null | sed -n 2p)
    [ -n "$answer" ] || { [ -n "${HEALTHY_WHY:-}" ] && echo "unhealthy at check 2" >&2; return 1; }
    [ -z "$first" ] || [ "$first" = "$answer" ] || { [ -n "${HEALTHY_WHY:-}" ] && echo "unhealthy at check 3" >&2; return 1; }
    first=$answer
    # Every sentinel knows the other two, and the primary is not thought down.
    flags=$(redis-cli -h 127.0.0.1 -p "$sp" SENTINEL master "$master" 2>/dev/null | awk 'prev == "flags" { print } { prev = $0 }')
    [ "$flags" = master ] || { [ -n "${HEALTHY_WHY:-}" ] && echo "unhealthy at check 4" >&2; return 1; }
    others=$(redis-cli -h 127.0.0.1 -p "$sp" SENTINEL master "$master" 2>/dev/null | awk 'prev == "num-other-sentinels" { print } { prev = $0 }')
    [ "$others" = 2 ] || { [ -n "${HEALTHY_WHY:-}" ] && echo "unhealthy at check 5" >&2; return 1; }
  done
  info=$(redis-cli -h 127.0.0.1 -p "$first" INFO replication 2>/dev/null | tr -d '\r')
  echo "$info" | grep -q '^role:master$' || { [ -n "${HEALTHY_WHY:-}" ] && echo "unhealthy at check 6" >&2; return 1; }
  echo "$info" | grep -q '^slave0:.*state=online' || { [ -n "${HEALTHY_WHY:-}" ] && echo "unhealthy at check 7" >&2; return 1; }
  # The replica reports its link up, and every sentinel lists it as a replica that is not down.
  for s in s1 s2 s3; do
    sp=$(node_field "$s" 4)
    redis-cli -h 127.0.0.1 -p "$sp" SENTINEL replicas "$master" 2>/dev/null |
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
  : > "$dir/nodes.tmp"
  for id in p1 p2 s1 s2 s3; do
    port=$(free_port)
    case $id in p*) role=primary ;; *) role=sentinel ;; esac
    [ "$id" = p2 ] && role=replica
    echo "$id $role 127.0.0.1 $port 0" >> "$dir/nodes.tmp"
  done
  mv "$dir/nodes.tmp" "$dir/nodes"
  p1=$(node_field p1 4)
  start_data p1 "$p1" || { echo "p1 did not start" >&2; cat "$dir/p1.log" >&2; exit 1; }
  start_data p2 "$(node_field p2 4)" "$p1" || { echo "p2 did not start" >&2; cat "$dir/p2.log" >&2; exit 1; }
  for id in s1 s2 s3; do
    start_sentinel "$id" "$(node_field "$id" 4)" "$p1" || { echo "$id did not start" >&2; cat "$dir/$id.log" >&2; exit 1; }
  done
  for id in p1 p2 s1 s2 s3; do set_pid "$id" "$(pid_of "$id")"; done
  if ! wait_healthy 30; then
    echo "the sentinel set-up did not become healthy" >&2
    tail -n 20 "$dir"/*.log >&2
    exit 1
  fi
  echo "redis+sentinel://127.0.0.1:$(node_field s1 4),127.0.0.1:$(node_field s2 4),127.0.0.1:$(node_field s3 4)/$master" > "$dir/url"
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
      start_data "$id" "$port"
    else
      start_data "$id" "$port" "$primary"
    fi
    ;;
  s*)
    # The sentinel's own rewritten configuration knows the current primary and its peers.
    redis-server "$dir/$id.conf" --sentinel
    wait_ping "$port"
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
  sp=$(node_field s1 4)
  # Refused while a previous failover is still in progress: try again for a while.
  for _ in $(seq 1 50); do
    out=$(redis-cli -h 127.0.0.1 -p "$sp" SENTINEL FAILOVER "$master" 2>&1) && [ "$out" = OK ] && break
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
