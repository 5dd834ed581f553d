#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Starts or stops a throwaway redis-server (Debian's) on a free port of 127.0.0.1, for tests.
#   redis.sh start DIR   data, log and pid under DIR; writes the URL to DIR/url
#   redis.sh stop DIR
#   redis.sh restart DIR   the same port, empty (what a crash without persistence looks like)
#   redis.sh pause DIR / resume DIR   stops the process (SIGSTOP) and continues it: it answers
#     nobody, for as long as the test wants, and keeps every connection and key
# Persistence is off: a restart forgets everything, as the restart tests want.
# TURNSTILE_CLUSTER_NETNS / TURNSTILE_CLUSTER_HOSTS at start: in a network namespace (common.sh).
set -eu
action=$1
dir=$2
. "$(dirname "$0")/common.sh"
server_place "$action"

launch() {  # PORT
  # Protected mode would refuse clients from other namespaces (no password: tests only).
  in_server redis-server --bind "$server_host" --port "$1" --save '' --appendonly no --daemonize yes \
    --protected-mode "$([ -n "$server_ns" ] && echo no || echo yes)" \
    --dir "$dir" --pidfile "$dir/redis.pid" --logfile "$dir/redis.log"
}

pong() {  # PORT
  [ "$(in_server redis-cli -h "$server_host" -p "$1" ping 2>/dev/null)" = PONG ]
}

redis_exited() {
  [ -f "$dir/redis.pid" ] && process_gone "$(cat "$dir/redis.pid")"
}

# The server on PORT, answering; otherwise stopped again (a daemon that lost the race for the
# port has exited).
try_port() {  # PORT
  port=$1
  if launch "$port" && wait_until 50 eval 'pong "$port" || redis_exited' && pong "$port"; then
    echo "redis://$server_host:$port" > "$dir/url"
    echo "redis-server ready on $server_host:$port"
    return 0
  fi
  stop_process "$dir/redis.pid"
  return 1
}

case "$action" in
start)
  # A server left running by an interrupted run would be orphaned by a new pid file.
  "$0" stop "$dir"
  mkdir -p "$dir"
  rm -f "$dir/url"
  server_place_record
  start_on_free_port 10 1 try_port && exit 0
  echo "could not start redis-server; log:" >&2
  cat "$dir/redis.log" >&2 || true
  exit 1
  ;;
stop)
  stop_process "$dir/redis.pid"
  ;;
restart)
  port=$(sed 's/.*://' "$dir/url")
  "$0" stop "$dir"
  launch "$port"
  wait_until 50 pong "$port"
  ;;
pause)
  kill -STOP "$(cat "$dir/redis.pid")"
  ;;
resume)
  kill -CONT "$(cat "$dir/redis.pid")"
  ;;
*)
  echo "usage: $0 start|stop|restart|pause|resume DIR" >&2
  exit 64
  ;;
esac
