#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Network namespaces for partition tests (as root; `ip netns` and veth pairs, nothing else):
#   netns.sh up PREFIX N     namespaces PREFIX-hub (a bridge br0) and PREFIX-1..N, each with lo
#                            up and a veth "eth0" into the bridge, address 10.213.0.(10+i)/24
#   netns.sh down PREFIX     deletes every namespace of PREFIX (stop what runs in them first)
#   netns.sh cut PREFIX I    takes node I's link into the bridge down: a partition of node I
#   netns.sh heal PREFIX I   brings it up again
#   netns.sh addr I          prints node I's address
# Only addresses inside namespaces made here are used; the host's own network is untouched.
set -eu
action=$1

addr() { echo "10.213.0.$((10 + $1))"; }

case "$action" in
up)
  prefix=$2
  n=$3
  "$0" down "$prefix"
  ip netns add "$prefix-hub"
  ip -n "$prefix-hub" link set lo up
  ip -n "$prefix-hub" link add br0 type bridge
  ip -n "$prefix-hub" link set br0 up
  for i in $(seq 1 "$n"); do
    ip netns add "$prefix-$i"
    ip link add "tsv$$-$i" netns "$prefix-hub" type veth peer name eth0 netns "$prefix-$i"
    ip -n "$prefix-hub" link set "tsv$$-$i" name "v$i"
    ip -n "$prefix-hub" link set "v$i" master br0 up
    ip -n "$prefix-$i" link set lo up
    ip -n "$prefix-$i" addr add "$(addr "$i")/24" dev eth0
    ip -n "$prefix-$i" link set eth0 up
  done
  ;;
down)
  prefix=$2
  for ns in $(ip netns list | awk '{print $1}'); do
    case "$ns" in "$prefix"-hub|"$prefix"-[0-9]*) ip netns delete "$ns" ;; esac
  done
  ;;
cut)
  ip -n "$2-hub" link set "v$3" down
  ;;
heal)
  ip -n "$2-hub" link set "v$3" up
  ;;
addr)
  addr "$2"
  ;;
*)
  echo "usage: $0 up PREFIX N | down PREFIX | cut PREFIX I | heal PREFIX I | addr I" >&2
  exit 64
  ;;
esac
