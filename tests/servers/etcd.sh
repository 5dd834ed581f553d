#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Starts or stops a throwaway etcd (Debian's etcd-server) on free 127.0.0.1 client and peer
# ports, for tests.
#   etcd.sh start DIR     data, log and pid under DIR; writes etcd://127.0.0.1:PORT to DIR/url
#   etcd.sh stop DIR
#   etcd.sh restart DIR   the same ports and data (what a crash with its disk intact looks like)
# With DIR/tls/{server.pem,server.key,ca.pem} present, clients speak TLS and the URL is etcds://.
# TURNSTILE_CLUSTER_NETNS / TURNSTILE_CLUSTER_HOSTS at start: in a network namespace (common.sh).
set -eu
action=$1
dir=$2
. "$(dirname "$0")/common.sh"
server_place "$action"

if [ -f "$dir/tls/server.pem" ]; then
  client_scheme=https
  url_scheme=etcds
  server_tls="--cert-file $dir/tls/server.pem --key-file $dir/tls/server.key"
  client_tls="--cacert=$dir/tls/ca.pem"
else
  client_scheme=http
  url_scheme=etcd
  client_tls=""
fi

launch() {  # client port, peer port
  # shellcheck disable=SC2086
  server_spawn "$dir/etcd.pid" "$dir/etcd.log" etcd --name n1 --data-dir "$dir/data" ${server_tls:-} \
    --listen-client-urls "$client_scheme://$server_host:$1" --advertise-client-urls "$client_scheme://$server_host:$1" \
    --listen-peer-urls "http://$server_host:$2" --initial-advertise-peer-urls "http://$server_host:$2" \
    --initial-cluster "n1=http://$server_host:$2" --initial-cluster-state new
}

ready() {  # client port
  # shellcheck disable=SC2086
  in_server etcdctl --endpoints="$client_scheme://$server_host:$1" $client_tls --command-timeout=1s endpoint health >/dev/null 2>&1
}

etcd_exited() {
  process_gone "$(cat "$dir/etcd.pid")"
}

wait_ready() {  # client port; fails when etcd exits first
  ready_port=$1
  wait_until 100 eval 'ready "$ready_port" || etcd_exited' && ready "$ready_port"
}

# etcd on client port CLIENT and peer port CLIENT+1, serving; otherwise stopped again and its
# data removed (it lost the race for a port, or was too slow).
try_port() {  # CLIENT
  client=$1
  peer=$((client + 1))
  launch "$client" "$peer"
  if wait_ready "$client"; then
    echo "$client $peer" > "$dir/ports"
    echo "$url_scheme://$server_host:$client" > "$dir/url"
    echo "etcd ready on $server_host:$client"
    return 0
  fi
  stop_process "$dir/etcd.pid"
  rm -rf "$dir/data"
  return 1
}

case "$action" in
start)
  # A server left running by an interrupted run would be orphaned by a new pid file.
  "$0" stop "$dir"
  mkdir -p "$dir"
  rm -rf "$dir/url" "$dir/data"
  server_place_record
  start_on_free_port 10 2 try_port && exit 0
  echo "could not start etcd; log:" >&2
  tail -n 50 "$dir/etcd.log" >&2 || true
  exit 1
  ;;
stop)
  stop_process "$dir/etcd.pid"
  ;;
restart)
  read -r client peer < "$dir/ports"
  "$0" stop "$dir"
  launch "$client" "$peer"
  wait_ready "$client"
  ;;
*)
  echo "usage: $0 start|stop|restart DIR" >&2
  exit 64
  ;;
esac
