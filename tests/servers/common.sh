# SPDX-License-Identifier: Apache-2.0
# Sourced by the test-server scripts beside it (POSIX sh): the one set of helpers they share.
#   wait_until TENTHS COMMAND...      COMMAND every 0.1 s until it succeeds, up to TENTHS times
#   process_gone PID                  PID has exited, or is a zombie (it has let go of its ports;
#                                     a container's init may take long to reap it, or never)
#   stop_pid PID                      SIGCONT (a paused process must hear what follows), SIGTERM,
#                                     up to 5 s to go, then SIGKILL
#   stop_process PIDFILE              stop_pid of the pid in PIDFILE, if any; removes PIDFILE
#   stop_node ID                      stop_process of node ID's pid file (node_pidfile ID, which
#                                     the script of a multi-node set-up defines)
#   free_port [COUNT [LISTED]]        the first of COUNT consecutive ports free here, none of
#                                     them a word of file LISTED (ports chosen, not yet bound)
#   start_tries TRIES TRY...          TRY... until it succeeds, TRIES times at most: TRY starts
#                                     the server(s), polls until they serve, and stops what it
#                                     started when they do not (a port taken between its choice
#                                     and its use, say)
#   start_on_free_port TRIES COUNT TRY...
#                                     the same, TRY... PORT with the first of COUNT free ports

wait_until() {  # TENTHS COMMAND...
  tries=$1
  shift
  for _ in $(seq 1 "$tries"); do
    if "$@"; then return 0; fi
    sleep 0.1
  done
  return 1
}

process_gone() {  # PID
  case "$(ps -o stat= -p "$1" 2>/dev/null)" in ''|Z*) return 0 ;; *) return 1 ;; esac
}

stop_pid() {  # PID
  [ "${1:-0}" -gt 0 ] 2>/dev/null || return 0
  kill -CONT "$1" 2>/dev/null || true
  kill "$1" 2>/dev/null || true
  wait_until 50 process_gone "$1" || kill -9 "$1" 2>/dev/null || true
}

stop_process() {  # PIDFILE
  if [ -f "$1" ]; then
    stop_pid "$(cat "$1")"
    rm -f "$1"
  fi
}

stop_node() {  # ID
  stop_process "$(node_pidfile "$1")"
}

# Below the kernel's ephemeral range (32768 up), so that no outgoing connection holds one.
free_port() {  # [COUNT [LISTED]]
  count=${1:-1}
  while :; do
    first=$(shuf -i 20000-$((32767 - count)) -n 1)
    last=$((first + count - 1))
    if ss -Htan 2>/dev/null | awk -v lo="$first" -v hi="$last" \
      '{ n = split($4, a, ":"); p = a[n] + 0; if (p >= lo && p <= hi) found = 1 } END { exit !found }'; then
      continue
    fi
    if [ -n "${2:-}" ] && [ -f "$2" ] &&
      awk -v lo="$first" -v hi="$last" '{ for (i = 1; i <= NF; i++) if ($i >= lo && $i <= hi) found = 1 } END { exit !found }' "$2"; then
      continue
    fi
    echo "$first"
    return
  done
}

start_tries() {  # TRIES TRY...
  start_tries_left=$1
  shift
  while [ "$start_tries_left" -gt 0 ]; do
    if "$@"; then return 0; fi
    start_tries_left=$((start_tries_left - 1))
  done
  return 1
}

with_free_port() {  # COUNT TRY...
  with_count=$1
  shift
  "$@" "$(free_port "$with_count")"
}

start_on_free_port() {  # TRIES COUNT TRY...
  start_on_tries=$1
  shift
  start_tries "$start_on_tries" with_free_port "$@"
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
  [ -n "$pid" ] && ! process_gone "$pid"
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

node_pidfile() {  # ID
  echo "$dir/n$1/pid"
}

all_alive() {
  for i in $cluster_nodes; do node_alive "$i" || return 1; done
}

healthy_or_dead() {  # stops waiting when a node has exited (lost a port race)
  cluster_healthy || ! all_alive
}

# The cluster on ports BASE.. (ports_per_node per node), formed; otherwise stopped again.
cluster_try() {  # BASE
  base=$1
  for i in $cluster_nodes; do rm -rf "$dir/n$i"; mkdir -p "$dir/n$i"; done
  echo "$base" > "$dir/ports"
  cluster_configure
  for i in $cluster_nodes; do node_launch "$i"; done
  if wait_until 600 healthy_or_dead && all_alive; then return 0; fi
  echo "the cluster did not form on ports from $base (a port taken?); trying others" >&2
  for i in $cluster_nodes; do stop_node "$i"; done
  return 1
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
    if start_on_free_port 6 $((3 * ports_per_node)) cluster_try; then
      write_nodes
      write_url
      echo "$url_scheme cluster ready: $(cat "$dir/url")"
      return 0
    fi
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
