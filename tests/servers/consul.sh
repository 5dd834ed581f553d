#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Starts or stops the Consul HTTP API TEST STAND-IN (consul_server.py beside this script, not
# Consul: none can be installed here) on a free port of 127.0.0.1, for tests.
#   consul.sh start DIR     state, log and pid under DIR; writes consul://127.0.0.1:PORT to DIR/url
#                           (consul://TOKEN@127.0.0.1:PORT when CONSUL_TEST_ACL_TOKEN is set: then
#                           every request needs that token)
#   consul.sh stop DIR
#   consul.sh restart DIR   the same port and Raft state (KV, sessions, index), as a Consul server
#                           restarted with its data dir; session TTL timers start again
#   consul.sh restart-empty DIR  the same port without its state (KV, sessions, indexes lost)
#   consul.sh pause DIR     SIGSTOP: the server answers nothing until resumed
#   consul.sh resume DIR    SIGCONT
# TURNSTILE_CLUSTER_NETNS / TURNSTILE_CLUSTER_HOSTS at start: in a network namespace (common.sh).
set -eu
action=$1
dir=$2
server="$(cd "$(dirname "$0")" && pwd)/consul_server.py"
. "$(dirname "$0")/common.sh"
server_place "$action"

launch() {  # port (0: any free one)
  rm -f "$dir/port"
  # shellcheck disable=SC2086
  server_spawn "$dir/consul.pid" "$dir/consul.log" /usr/bin/python3 "$server" --bind "$server_host" --port "$1" \
    --port-file "$dir/port" --data-dir "$dir/data" $acl $extra
  wait_until 100 eval '[ -s "$dir/port" ] || process_gone "$(cat "$dir/consul.pid")"' && [ -s "$dir/port" ]
}

acl=""
# CONSUL_TEST_SESSION_TTL_MIN at start (Consul's session_ttl_min, e.g. 1s) stays for restarts.
extra=""
if [ "$action" = start ] && [ -n "${CONSUL_TEST_SESSION_TTL_MIN:-}" ]; then
  extra="--session-ttl-min $CONSUL_TEST_SESSION_TTL_MIN"
elif { [ "$action" = restart ] || [ "$action" = restart-empty ]; } && [ -f "$dir/extra_options" ]; then
  extra=$(cat "$dir/extra_options")
fi
if [ -n "${CONSUL_TEST_ACL_TOKEN:-}" ]; then
  acl="--acl-token $CONSUL_TEST_ACL_TOKEN"
elif [ -f "$dir/acl_token" ] && { [ "$action" = restart ] || [ "$action" = restart-empty ]; }; then
  acl="--acl-token $(cat "$dir/acl_token")"
fi

case "$action" in
start)
  # A server left running by an interrupted run would be orphaned by a new pid file.
  "$0" stop "$dir"
  mkdir -p "$dir"
  rm -rf "$dir/url" "$dir/data" "$dir/acl_token"
  server_place_record
  printf '%s\n' "$extra" > "$dir/extra_options"
  if launch 0; then
    port=$(cat "$dir/port")
    if [ -n "${CONSUL_TEST_ACL_TOKEN:-}" ]; then
      printf '%s\n' "$CONSUL_TEST_ACL_TOKEN" > "$dir/acl_token"
      echo "consul://$CONSUL_TEST_ACL_TOKEN@$server_host:$port" > "$dir/url"
    else
      echo "consul://$server_host:$port" > "$dir/url"
    fi
    # The URL turnstile's tests use: the same, with CONSUL_TEST_URL_QUERY (e.g. lock_delay=1).
    if [ -n "${CONSUL_TEST_URL_QUERY:-}" ]; then
      echo "$(cat "$dir/url")?$CONSUL_TEST_URL_QUERY" > "$dir/turnstile_url"
    fi
    echo "Consul test stand-in ready on $server_host:$port"
    exit 0
  fi
  echo "could not start the Consul test stand-in; log:" >&2
  tail -n 50 "$dir/consul.log" >&2 || true
  exit 1
  ;;
stop)
  stop_process "$dir/consul.pid"
  ;;
restart)
  port=$(sed 's/.*://' "$dir/url")
  "$0" stop "$dir"
  launch "$port"
  ;;
restart-empty)
  # A server that lost its Raft state (a new cluster on the old address): indexes start again.
  port=$(sed 's/.*://' "$dir/url")
  "$0" stop "$dir"
  rm -rf "$dir/data"
  launch "$port"
  ;;
pause)
  kill -STOP "$(cat "$dir/consul.pid")"
  ;;
resume)
  kill -CONT "$(cat "$dir/consul.pid")"
  ;;
*)
  echo "usage: $0 start|stop|restart|restart-empty|pause|resume DIR" >&2
  exit 64
  ;;
esac
