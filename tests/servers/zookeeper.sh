#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# Starts or stops a throwaway ZooKeeper server (Debian's zookeeper package, standalone) on a
# free port of 127.0.0.1, for tests.
#   zookeeper.sh start DIR   config, data, log and pid under DIR; writes the URL to DIR/url
#   zookeeper.sh stop DIR
#   zookeeper.sh restart DIR  stops it and starts it again on the same port with its data, so
#                             sessions survive (tests of a connection lost and regained)
# tickTime is short (250 ms) so that sessions may be as short as 500 ms (2 x tickTime): the
# conformance suite kills children that asked for a 2 s TTL and expects their holds to go
# within one short session timeout. maxSessionTimeout stays generous (60 s) for the others
# (TURNSTILE_ZK_MAX_SESSION_TIMEOUT=ms overrides it: tests of a granted timeout shorter than asked).
# TURNSTILE_ZK_FORCESYNC=no sets forceSync=no (no fsync of the transaction log per write), for
# benchmarks; unset, the server's default (forceSync=yes) stays.
# TURNSTILE_CLUSTER_NETNS / TURNSTILE_CLUSTER_HOSTS at start: in a network namespace (common.sh).
# TURNSTILE_ZK_CONTAINER_CHECK_MS=ms has the server look for empty container nodes to delete
# every ms instead of every minute (the Java system properties znode.container.checkIntervalMs
# and znode.container.maxPerMinute; kept for restart): tests of what a reaped container
# parent restarts (its sequence numbers) and what it must not (fencing tokens).
set -eu
action=$1
dir=$2
. "$(dirname "$0")/common.sh"
server_place "$action"
classpath=/usr/share/java/zookeeper.jar:/usr/share/java/zookeeper-jute.jar:/usr/share/java/slf4j-api.jar:/usr/share/java/slf4j-simple.jar:/usr/share/java/netty-handler.jar:/usr/share/java/netty-transport.jar:/usr/share/java/netty-common.jar:/usr/share/java/netty-buffer.jar:/usr/share/java/netty-resolver.jar:/usr/share/java/netty-codec.jar:/usr/share/java/netty-transport-native-epoll.jar:/usr/share/java/netty-transport-native-unix-common.jar:/usr/share/java/metrics-core.jar:/usr/share/java/commons-cli.jar:/usr/share/java/commons-io.jar

# Starts the server of DIR/zoo.cfg in the background; its pid in DIR/zookeeper.pid.
launch() {
  # shellcheck disable=SC2046 # the saved properties are words, one per line
  server_spawn "$dir/zookeeper.pid" "$dir/zookeeper.log" \
    java -Xmx512m -Dzookeeper.log.dir="$dir" -Dorg.slf4j.simpleLogger.defaultLogLevel=warn \
    $(cat "$dir/jvm.properties" 2>/dev/null) \
    -cp "$classpath" org.apache.zookeeper.server.quorum.QuorumPeerMain "$dir/zoo.cfg"
}

# Serving client requests: the four-letter command `srvr` names the server's mode. `ruok`
# would not do: it answers imok as soon as the port is bound, while a restarted server may still
# be loading its data and refuses sessions (a client's connect then timed out under load).
serving() {
  reply=$(in_server timeout 2 bash -c 'exec 3<>"/dev/tcp/$0/$1" && printf srvr >&3 && cat <&3' \
    "$server_host" "$1" 2>/dev/null || true)
  case "$reply" in *"Mode: "*) return 0 ;; *) return 1 ;; esac
}

zookeeper_exited() {
  process_gone "$(cat "$dir/zookeeper.pid")"
}

# The server on PORT, serving; otherwise stopped again (one that lost the race for the
# port has exited).
try_port() {  # PORT
  port=$1
  cat > "$dir/zoo.cfg" <<CFG
tickTime=250
minSessionTimeout=500
maxSessionTimeout=${TURNSTILE_ZK_MAX_SESSION_TIMEOUT:-60000}
dataDir=$dir/data
clientPort=$port
clientPortAddress=$server_host
admin.enableServer=false
4lw.commands.whitelist=srvr,ruok,stat,mntr,cons,wchs
maxClientCnxns=0
${TURNSTILE_ZK_FORCESYNC:+forceSync=$TURNSTILE_ZK_FORCESYNC}
CFG
  : > "$dir/zookeeper.log"
  launch
  if wait_until 150 eval 'serving "$port" || zookeeper_exited' && serving "$port"; then
    echo "zk://$server_host:$port" > "$dir/url"
    echo "zookeeper ready on $server_host:$port"
    return 0
  fi
  stop_process "$dir/zookeeper.pid"
  return 1
}

case "$action" in
start)
  # A server left running by an interrupted run would be orphaned by a new pid file.
  "$0" stop "$dir"
  mkdir -p "$dir/data"
  rm -f "$dir/url" "$dir/jvm.properties"
  server_place_record
  if [ -n "${TURNSTILE_ZK_CONTAINER_CHECK_MS:-}" ]; then
    printf '%s\n' "-Dznode.container.checkIntervalMs=$TURNSTILE_ZK_CONTAINER_CHECK_MS" \
      "-Dznode.container.maxPerMinute=100000" > "$dir/jvm.properties"
  fi
  start_on_free_port 10 1 try_port && exit 0
  echo "could not start zookeeper; log:" >&2
  cat "$dir/zookeeper.log" >&2 || true
  exit 1
  ;;
stop)
  stop_process "$dir/zookeeper.pid"
  ;;
restart)
  "$0" stop "$dir"
  port=$(sed -n 's/^clientPort=//p' "$dir/zoo.cfg")
  launch
  if wait_until 600 serving "$port"; then
    echo "zookeeper restarted on $server_host:$port"
    exit 0
  fi
  echo "could not restart zookeeper; log:" >&2
  cat "$dir/zookeeper.log" >&2 || true
  exit 1
  ;;
*)
  echo "usage: $0 start|stop|restart DIR" >&2
  exit 64
  ;;
esac
