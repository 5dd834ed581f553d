#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# A throwaway 3-member etcd cluster (Debian's etcd-server) for tests of fail-over.
#   etcd_cluster.sh start DIR    members 1..3 (named n1..n3) on free ports, data/log/pid under
#                                DIR/n1..n3; returns once every member serves with one leader;
#                                writes DIR/url (etcd://H1:P1,H2:P2,H3:P3) and DIR/nodes (lines
#                                "ID HOST CLIENT_PORT PID")
#   etcd_cluster.sh stop DIR     stops every member (paused ones too)
#   etcd_cluster.sh kill DIR ID  kill -9 of member ID (no wait for recovery)
#   etcd_cluster.sh start-node DIR ID [wipe]  starts member ID again on its ports; wipe: without
#                                its data, which etcd requires to be a new member: it is removed
#                                (etcdctl member remove) and added again (member add) through the
#                                others, then started with --initial-cluster-state existing;
#                                returns once it serves
#   etcd_cluster.sh pause|resume DIR ID       SIGSTOP / SIGCONT of member ID
#   etcd_cluster.sh leader DIR   prints the ID of the leader (etcdctl endpoint status), exit 1
#                                if none
#   etcd_cluster.sh healthy DIR  exit 0 when every member serves and all follow one leader
# TURNSTILE_CLUSTER_NETNS="ns1 ns2 ns3" and TURNSTILE_CLUSTER_HOSTS="a1 a2 a3" at start: member
# i listens on a_i inside namespace ns_i (see netns.sh), and is checked from there.
# Fast elections: heartbeat 100 ms, election timeout 1 s.
set -eu
. "$(dirname "$0")/common.sh"
url_scheme=etcd
ports_per_node=2  # client, peer

client_url() { echo "http://$(node_host "$1"):$(node_port "$1" 0)"; }
peer_url() { echo "http://$(node_host "$1"):$(node_port "$1" 1)"; }

cluster_configure() {
  for i in $cluster_nodes; do echo new > "$dir/n$i/state"; done
}

node_launch() {  # ID
  initial=""
  for j in $cluster_nodes; do initial="$initial${initial:+,}n$j=$(peer_url "$j")"; done
  node_spawn "$1" "$dir/n$1/etcd.log" etcd --name "n$1" --data-dir "$dir/n$1/data" \
    --listen-client-urls "$(client_url "$1")" --advertise-client-urls "$(client_url "$1")" \
    --listen-peer-urls "$(peer_url "$1")" --initial-advertise-peer-urls "$(peer_url "$1")" \
    --initial-cluster "$initial" --initial-cluster-state "$(cat "$dir/n$1/state")" \
    --initial-cluster-token "turnstile-$(cat "$dir/ports")" \
    --heartbeat-interval 100 --election-timeout 1000
}

etcdctl_at() {  # ID ARGS...: etcdctl against member ID, from its namespace, 1 s per command
  at=$1
  shift
  in_node "$at" etcdctl --endpoints="$(client_url "$at")" --dial-timeout=1s --command-timeout=1s "$@"
}

node_serves() {  # ID
  etcdctl_at "$1" endpoint health >/dev/null 2>&1
}

# "TERM MEMBER LEADER" of member ID (decimal ids), nothing when it does not answer.
node_status() {  # ID
  etcdctl_at "$1" endpoint status -w fields 2>/dev/null | awk -F' : ' '
    /"MemberID"/ { m = $2 } /"Leader"/ { l = $2 } /"RaftTerm"/ { t = $2 }
    END { if (m != "") print t, m, l }'
}

# The leader as the member of the newest term sees it, if that is one of ours.
cluster_leader() {
  statuses=""
  for i in $cluster_nodes; do
    s=$(node_status "$i")
    [ -n "$s" ] && statuses="$statuses$i $s
"
  done
  leader=$(printf '%s' "$statuses" | sort -k2,2n | tail -n 1 | awk '{print $4}')
  [ -n "$leader" ] && [ "$leader" != 0 ] || return 1
  found=$(printf '%s' "$statuses" | awk -v l="$leader" '$3 == l { print $1 }')
  [ -n "$found" ] && echo "$found"
}

cluster_healthy() {
  leaders=""
  for i in $cluster_nodes; do
    node_serves "$i" || return 1
    s=$(node_status "$i")
    [ -n "$s" ] || return 1
    leaders="$leaders ${s##* }"
  done
  # shellcheck disable=SC2086
  set -- $leaders
  [ "$1" != 0 ] && [ "$1" = "$2" ] && [ "$2" = "$3" ]
}

# Data lost means a new member (etcd's runtime reconfiguration guide): removed and added again
# through a live member, then started with --initial-cluster-state existing. etcd refuses to
# remove a member until the others have been connected for 5 s (after a leader change, say):
# both steps are retried for up to 20 s.
member_removed() {  # ID
  for j in $cluster_nodes; do
    [ "$j" = "$1" ] && continue
    list=$(etcdctl_at "$j" member list 2>/dev/null) || continue
    old=$(printf '%s\n' "$list" | awk -F', ' -v n="n$1" -v u="$(peer_url "$1")" '$3 == n || $4 == u { print $1 }')
    [ -z "$old" ] && return 0
    etcdctl_at "$j" member remove "$old" >/dev/null 2>&1 && return 0
  done
  return 1
}

member_added() {  # ID
  for j in $cluster_nodes; do
    [ "$j" = "$1" ] && continue
    etcdctl_at "$j" member add "n$1" --peer-urls="$(peer_url "$1")" >/dev/null 2>&1 && return 0
  done
  return 1
}

node_wipe() {  # ID
  wipe_id=$1
  if ! wait_until 100 eval 'member_removed "$wipe_id"' || ! wait_until 100 eval 'member_added "$wipe_id"'; then
    echo "no live member could replace member $wipe_id" >&2
    return 1
  fi
  rm -rf "$dir/n$wipe_id/data"
  echo existing > "$dir/n$wipe_id/state"
}

cluster_main "$@"
