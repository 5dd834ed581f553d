# Sourced by the test-server scripts beside it (POSIX sh).

# Stops the process whose pid is in PIDFILE, if any: SIGTERM, up to 5 s to exit, then SIGKILL;
# removes PIDFILE.
stop_process() {
  if [ -f "$1" ]; then
    pid=$(cat "$1")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$1"
  fi
}

# ---- one server (redis.sh, zookeeper.sh, etcd.sh, consul.sh) -----------------------------------
# TURNSTILE_CLUSTER_NETNS="ns" and TURNSTILE_CLUSTER_HOSTS="a" at start (as for the clusters
# below, with one namespace: see netns.sh): the server listens on address a inside namespace ns,
# so that a fault run can cut its clients off from it. `start` records both in DIR/netns for the
# later commands. Without them: 127.0.0.1 here. Sets server_ns and server_host.
server_place() {  # ACTION (DIR in $dir)
  if [ "$1" = start ]; then
    server_ns=${TURNSTILE_CLUSTER_NETNS:-}
    server_ns=${server_ns%% *}
    server_host=${TURNSTILE_CLUSTER_HOSTS:-127.0.0.1}
    server_host=${server_host%% *}
  elif [ -f "$dir/netns" ]; then
    { read -r server_ns; read -r server_host; } < "$dir/netns"
  else
    server_ns=""
    server_host=127.0.0.1
  fi
}

server_place_record() {  # after `start` made DIR
  printf '%s\n%s\n' "$server_ns" "$server_host" > "$dir/netns"
}

# Runs a command in the server's namespace (or here, without one).
in_server() {  # COMMAND...
  if [ -n "$server_ns" ]; then ip netns exec "$server_ns" "$@"; else "$@"; fi
}

# Starts COMMAND in the background in the server's namespace, output appended to LOG; its pid
# (the command's own: `ip netns exec` execs it, and no function runs in between) in PIDFILE.
server_spawn() {  # PIDFILE LOG COMMAND...
  spawn_pidfile=$1
  spawn_log=$2
  shift 2
  if [ -n "$server_ns" ]; then set -- ip netns exec "$server_ns" "$@"; fi
  "$@" </dev/null >>"$spawn_log" 2>&1 &
  echo $! > "$spawn_pidfile"
}

# ---- 3-node clusters (zookeeper_ensemble.sh, etcd_cluster.sh) --------------------------------
# The script sourcing this defines: cluster_configure (writes each node's configuration for the
# ports in $base), node_launch ID (starts node ID in the background, its pid in
# $dir/nID/pid), node_serves ID (exit 0 when node ID answers clients), cluster_healthy,
# cluster_leader, node_wipe ID, url_scheme; then calls cluster_main "$@".
# Node i listens on node_host i (127.0.0.1, or the i-th of TURNSTILE_CLUSTER_HOSTS) and runs
# inside namespace i of TURNSTILE_CLUSTER_NETNS when set; `start` records both in $dir/netns so
# that later commands use the same without the environment.

cluster_nodes="1 2 3"

node_host() {  # ID
  if [ -n "${cluster_hosts:-}" ]; then
    # shellcheck disable=SC2086
    set -- "$1" $cluster_hosts
    shift "$1"
    echo "$1"
  else
    echo 127.0.0.1
  fi
}

# Runs a command in node ID's network namespace (or here, without namespaces).
in_node() {  # ID COMMAND...
  if [ -n "${cluster_netns:-}" ]; then
    # shellcheck disable=SC2086
    in_node_ns=$(set -- "$1" $cluster_netns; shift "$1"; echo "$1")
    shift
    ip netns exec "$in_node_ns" "$@"
  else
    shift
    "$@"
  fi
}

# Starts COMMAND in the background in node ID's namespace, output appended to LOG; its pid (the
# command's own: `ip netns exec` execs it) in $dir/nID/pid.
node_spawn() {  # ID LOG COMMAND...
  spawn_id=$1
  spawn_log=$2
  shift 2
  if [ -n "${cluster_netns:-}" ]; then
    # shellcheck disable=SC2086
    set -- ip netns exec "$(set -- "$spawn_id" $cluster_netns; shift "$spawn_id"; echo "$1")" "$@"
  fi
  "$@" </dev/null >>"$spawn_log" 2>&1 &
  echo $! > "$dir/n$spawn_id/pid"
}

node_pid() {  # ID; empty when none
  cat "$dir/n$1/pid" 2>/dev/null || true
}

node_alive() {  # ID
  pid=$(node_pid "$1")
  [ -n "$pid" ] && case "$(ps -o stat= -p "$pid" 2>/dev/null)" in ''|Z*) false ;; *) true ;; esac
}

# The port number OFFSET of node ID, from $dir/ports (base) and the family's ports per node.
node_port() {  # ID OFFSET
  echo $((base + ($1 - 1) * ports_per_node + $2))
}

write_nodes() {
  : > "$dir/nodes.tmp"
  for i in $cluster_nodes; do
    echo "$i $(node_host "$i") $(node_port "$i" 0) $(node_pid "$i")" >> "$dir/nodes.tmp"
  done
  mv "$dir/nodes.tmp" "$dir/nodes"
}

write_url() {
  hosts=""
  for i in $cluster_nodes; do hosts="$hosts${hosts:+,}$(node_host "$i"):$(node_port "$i" 0)"; done
  echo "$url_scheme://$hosts" > "$dir/url"
}

# Whether any of the ports base..base+3*ports_per_node-1 is in use here (loopback mode only:
# each namespace has ports of its own).
ports_taken() {
  [ -n "${cluster_netns:-}" ] && return 1
  last=$((base + 3 * ports_per_node - 1))
  ss -Htan 2>/dev/null | awk -v lo="$base" -v hi="$last" \
    '{ n = split($4, a, ":"); p = a[n] + 0; if (p >= lo && p <= hi) found = 1 } END { exit !found }'
}

stop_node() {  # ID: SIGCONT, SIGTERM, up to 5 s, SIGKILL
  pid=$(node_pid "$1")
  if [ -n "$pid" ]; then
    kill -CONT "$pid" 2>/dev/null || true
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do node_alive "$1" || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$dir/n$1/pid"
  fi
}

wait_until() {  # TENTHS COMMAND...: retries COMMAND every 0.1 s, up to TENTHS times
  tries=$1
  shift
  for _ in $(seq 1 "$tries"); do
    if "$@"; then return 0; fi
    sleep 0.1
  done
  return 1
}

all_alive() {
  for i in $cluster_nodes; do node_alive "$i" || return 1; done
}

healthy_or_dead() {  # stops waiting when a node has exited (lost a port race)
  cluster_healthy || ! all_alive
}

cluster_main() {
  action=$1
  dir=$2
  [ -n "$dir" ] || { echo "usage: $0 ACTION DIR [ID]" >&2; exit 64; }
  if [ "$action" = start ]; then
    cluster_netns=${TURNSTILE_CLUSTER_NETNS:-}
    cluster_hosts=${TURNSTILE_CLUSTER_HOSTS:-}
  elif [ -f "$dir/netns" ]; then
    { read -r cluster_netns; read -r cluster_hosts; } < "$dir/netns"
  fi
  [ -f "$dir/ports" ] && read -r base < "$dir/ports"
  case "$action" in
  start)
    # Nodes left running by an interrupted run would be orphaned by new pid files.
    [ -d "$dir" ] && cluster_main stop "$dir"
    mkdir -p "$dir"
    rm -f "$dir/url" "$dir/nodes" "$dir/ports"
    printf '%s\n%s\n' "$cluster_netns" "$cluster_hosts" > "$dir/netns"
    for attempt in 1 2 3 4 5 6; do
      base=$(shuf -i 20000-60000 -n 1)
      if ports_taken; then continue; fi
      for i in $cluster_nodes; do rm -rf "$dir/n$i"; mkdir -p "$dir/n$i"; done
      echo "$base" > "$dir/ports"
      cluster_configure
      for i in $cluster_nodes; do node_launch "$i"; done
      if wait_until 600 healthy_or_dead && all_alive; then
        write_nodes
        write_url
        echo "$url_scheme cluster ready: $(cat "$dir/url")"
        return 0
      fi
      echo "attempt $attempt: the cluster did not form (a port taken?); trying other ports" >&2
      for i in $cluster_nodes; do stop_node "$i"; done
    done
    echo "could not start the cluster; logs:" >&2
    for i in $cluster_nodes; do tail -n 30 "$dir/n$i"/*.log >&2 || true; done
    return 1
    ;;
  stop)
    for i in $cluster_nodes; do stop_node "$i"; done
    ;;
  kill)
    pid=$(node_pid "$3")
    [ -n "$pid" ] || { echo "node $3 is not running" >&2; return 1; }
    kill -9 "$pid"
    # Reaped by init, not us: wait until it is gone (or a zombie), so its ports are free.
    id=$3
    wait_until 50 eval '! node_alive "$id"'
    rm -f "$dir/n$3/pid"
    ;;
  start-node)
    id=$3
    if node_alive "$id"; then echo "node $id is running" >&2; return 1; fi
    if [ "${4:-}" = wipe ]; then node_wipe "$id"; fi
    node_launch "$id"
    write_nodes
    if wait_until 600 eval 'node_serves "$id" || ! node_alive "$id"' && node_alive "$id"; then
      return 0
    fi
    echo "node $id did not come back; log:" >&2
    tail -n 30 "$dir/n$id"/*.log >&2 || true
    return 1
    ;;
  pause)
    kill -STOP "$(node_pid "$3")"
    ;;
  resume)
    kill -CONT "$(node_pid "$3")"
    ;;
  leader)
    cluster_leader
    ;;
  healthy)
    cluster_healthy
    ;;
  *)
    echo "usage: $0 start|stop|healthy|leader DIR | kill|pause|resume DIR ID | start-node DIR ID [wipe]" >&2
    return 64
    ;;
  esac
}
