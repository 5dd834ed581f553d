#!/bin/sh
# Starts or stops a throwaway redis-server (Debian's) on a free port of 127.0.0.1, for tests.
#   redis.sh start DIR   data, log and pid under DIR; writes the URL to DIR/url
#   redis.sh stop DIR
#   redis.sh restart DIR   the same port, empty (what a crash without persistence looks like)
# Persistence is off: a restart forgets everything, as the restart tests want.
set -eu
action=$1
dir=$2
. "$(dirname "$0")/common.sh"
case "$action" in
start)
  # A server left running by an interrupted run would be orphaned by a new pid file.
  "$0" stop "$dir"
  mkdir -p "$dir"
  rm -f "$dir/url"
  for attempt in 1 2 3 4 5 6 7 8 9 10; do
    port=$(shuf -i 20000-60999 -n 1)
    redis-server --bind 127.0.0.1 --port "$port" --save '' --appendonly no --daemonize yes \
      --dir "$dir" --pidfile "$dir/redis.pid" --logfile "$dir/redis.log" || continue
    for _ in $(seq 1 50); do
      if [ "$(redis-cli -h 127.0.0.1 -p "$port" ping 2>/dev/null)" = PONG ]; then
        echo "redis://127.0.0.1:$port" > "$dir/url"
        echo "redis-server ready on 127.0.0.1:$port"
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
  redis-server --bind 127.0.0.1 --port "$port" --save '' --appendonly no --daemonize yes \
    --dir "$dir" --pidfile "$dir/redis.pid" --logfile "$dir/redis.log"
  for _ in $(seq 1 50); do
    [ "$(redis-cli -h 127.0.0.1 -p "$port" ping 2>/dev/null)" = PONG ] && exit 0
    sleep 0.1
  done
  exit 1
  ;;
*)
  echo "usage: $0 start|stop|restart DIR" >&2
  exit 64
  ;;
esac
