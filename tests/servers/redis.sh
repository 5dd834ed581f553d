#!/bin/sh
# Starts or stops a throwaway redis-server (Debian's) on a free port of 127.0.0.1, for tests.
#   redis.sh start DIR   data, log and pid under DIR; writes the URL to DIR/url
#   redis.sh stop DIR
#   redis.sh restart DIR   the same port, empty (what a crash without persistence looks like)
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

case "$action" in
start)
  # A server left running by an interrupted run would be orphaned by a new pid file.
  "$0" stop "$dir"
  mkdir -p "$dir"
  rm -f "$dir/url"
  server_place_record
  for attempt in 1 2 3 4 5 6 7 8 9 10; do
    port=$(shuf -i 20000-60999 -n 1)
    launch "$port" || continue
    for _ in $(seq 1 50); do
      if pong "$port"; then
        echo "redis://$server_host:$port" > "$dir/url"
        echo "redis-server ready on $server_host:$port"
        exit 0
      fi
      # A daemon that lost the race for the port has exited: try another port.
      if [ -f "$dir/redis.pid" ] && ! kill -0 "$(cat "$dir/redis.pid")" 2>/dev/null; then break; fi
      sleep 0.1
    done
    [ -f "$dir/redis.pid" ] && kill "$(cat "$dir/redis.pid")" 2>/dev/null || true
  done
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
  for _ in $(seq 1 50); do
    pong "$port" && exit 0
    sleep 0.1
  done
  exit 1
  ;;
*)
  echo "usage: $0 start|stop|restart DIR" >&2
  exit 64
  ;;
esac
