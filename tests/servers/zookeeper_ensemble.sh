#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# A throwaway 3-node ZooKeeper ensemble (Debian's zookeeper package) for tests of fail-over.
#   zookeeper_ensemble.sh start DIR    nodes 1..3 on free ports, config/data/log/pid under
#                                      DIR/n1..n3; returns once every node serves in the quorum;
#                                      writes DIR/url (zk://H1:P1,H2:P2,H3:P3) and DIR/nodes
#                                      (lines "ID HOST CLIENT_PORT PID")
#   zookeeper_ensemble.sh stop DIR     stops every node (paused ones too)
#   zookeeper_ensemble.sh kill DIR ID  kill -9 of node ID (no wait for recovery)
#   zookeeper_ensemble.sh start-node DIR ID [wipe]  starts node ID again on its ports (wipe:
#                                      without its data, keeping myid); returns once it serves
#   zookeeper_ensemble.sh pause|resume DIR ID        SIGSTOP / SIGCONT of node ID
#   zookeeper_ensemble.sh leader DIR   prints the ID of the leader (4lw srvr), exit 1 if none
#   zookeeper_ensemble.sh healthy DIR  exit 0 when every node serves, one of them the leader
# TURNSTILE_CLUSTER_NETNS="ns1 ns2 ns3" and TURNSTILE_CLUSTER_HOSTS="a1 a2 a3" at start: node i
# listens on a_i inside namespace ns_i (see netns.sh), and is checked from there.
# Fast, like zookeeper.sh: tickTime 250 ms (sessions from 500 ms), syncLimit 2 s, 256 MB heap.
set -eu
. "$(dirname "$0")/common.sh"
url_scheme=zk
ports_per_node=3  # client, quorum, election
classpath=/usr/share/java/zookeeper.jar:/usr/share/java/zookeeper-jute.jar:/usr/share/java/slf4j-api.jar:/usr/share/java/slf4j-simple.jar:/usr/share/java/netty-handler.jar:/usr/share/java/netty-transport.jar:/usr/share/java/netty-common.jar:/usr/share/java/netty-buffer.jar:/usr/share/java/netty-resolver.jar:/usr/share/java/netty-codec.jar:/usr/share/java/netty-transport-native-epoll.jar:/usr/share/java/netty-transport-native-unix-common.jar:/usr/share/java/metrics-core.jar:/usr/share/java/commons-cli.jar:/usr/share/java/commons-io.jar

cluster_configure() {
  for i in $cluster_nodes; do
    mkdir -p "$dir/n$i/data"
    echo "$i" > "$dir/n$i/data/myid"
    {
      cat <<CFG
tickTime=250
initLimit=20
syncLimit=8
minSessionTimeout=500
maxSessionTimeout=60000
dataDir=$dir/n$i/data
clientPort=$(node_port "$i" 0)
clientPortAddress=$(node_host "$i")
admin.enableServer=false
4lw.commands.whitelist=srvr,ruok,stat,mntr,cons,wchs
maxClientCnxns=0
standaloneEnabled=false
CFG
      for j in $cluster_nodes; do
        echo "server.$j=$(node_host "$j"):$(node_port "$j" 1):$(node_port "$j" 2)"
      done
    } > "$dir/n$i/zoo.cfg"
  done
}

node_launch() {  # ID
  # cnxTimeout: how long a peer waits for another's election port (a paused or cut-off one).
  node_spawn "$1" "$dir/n$1/zookeeper.log" java -Xmx256m -XX:+UseSerialGC -XX:TieredStopAtLevel=1 -Dzookeeper.log.dir="$dir/n$1" \
    -Dorg.slf4j.simpleLogger.defaultLogLevel=warn -Dzookeeper.cnxTimeout=1000 \
    -cp "$classpath" org.apache.zookeeper.server.quorum.QuorumPeerMain "$dir/n$1/zoo.cfg"
}

# The reply of node ID to a four-letter command, within 1 s (a paused node answers nothing).
four_letters() {  # ID COMMAND
  in_node "$1" timeout 1 bash -c 'exec 3<>"/dev/tcp/$0/$1" && printf %s "$2" >&3 && cat <&3' \
    "$(node_host "$1")" "$(node_port "$1" 0)" "$2" 2>/dev/null || true
}

node_mode() {  # ID: leader, follower, or nothing when it does not serve
  four_letters "$1" srvr | sed -n 's/^Mode: //p'
}

node_serves() {  # ID
  case "$(node_mode "$1")" in leader|follower) return 0 ;; *) return 1 ;; esac
}

# A leader resumed from SIGSTOP says "leader" until it notices it was replaced: of the nodes
# that say so, the one of the newest epoch (the zxid's upper 32 bits) leads.
cluster_leader() {
  best=""
  best_epoch=-1
  for i in $cluster_nodes; do
    reply=$(four_letters "$i" srvr)
    case "$reply" in *"Mode: leader"*) ;; *) continue ;; esac
    zxid=$(printf '%s\n' "$reply" | sed -n 's/^Zxid: //p')
    epoch=$(( ${zxid:-0} >> 32 ))
    if [ "$epoch" -gt "$best_epoch" ]; then best=$i; best_epoch=$epoch; fi
  done
  [ -n "$best" ] && echo "$best"
}

cluster_healthy() {
  leaders=0
  for i in $cluster_nodes; do
    case "$(node_mode "$i")" in
    leader) leaders=$((leaders + 1)) ;;
    follower) ;;
    *) return 1 ;;
    esac
  done
  [ "$leaders" = 1 ]
}

node_wipe() {  # ID: the data goes, myid stays
  find "$dir/n$1/data" -mindepth 1 ! -name myid -exec rm -rf {} +
}

cluster_main "$@"
