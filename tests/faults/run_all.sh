#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# The full fault suite (`make faults`): every backend, every fault kind it can take, at least
# MIN_HOLDS holds each (default 10000), one table (BUILD/faults/table.md) printed at the end.
#   tests/faults/run_all.sh BUILD_DIR [BACKEND...]
# Backends: file redis zookeeper etcd consul, and the clusters whose scripts exist:
# zookeeper-ensemble etcd-cluster redis-sentinel redis-cluster. Exit status 1 when any run found a problem.
# As root, partitions too: each server node and each client in a network namespace of its own
# (tests/servers/netns.sh), named tsf<this script's pid>-<the tool's pid>-*, deleted after each run.
set -u
build=$(cd "$1" && pwd)
shift
source_dir=$(cd "$(dirname "$0")/../.." && pwd)
servers=$source_dir/tests/servers
faults=$build/tests/faults/turnstile-faults
cli=$build/tools/turnstile/turnstile
out=$build/faults
min_holds=${MIN_HOLDS:-10000}
seconds=${SECONDS_PER_BACKEND:-60}
mkdir -p "$out"
table=$out/table.md
{
  echo "| backend | holds | faults | overlaps | stale writes accepted | leaked entries | starved waiters | losses told | loss report ms p50 / p99 | availability in faults / overall |"
  echo "|---|---|---|---|---|---|---|---|---|---|"
} > "$table"

backends=("$@")
if [ ${#backends[@]} -eq 0 ]; then
  backends=(file redis zookeeper etcd consul)
  [ -x "$servers/zookeeper_ensemble.sh" ] && backends+=(zookeeper-ensemble)
  [ -x "$servers/etcd_cluster.sh" ] && backends+=(etcd-cluster)
  [ -x "$servers/redis_sentinel.sh" ] && backends+=(redis-sentinel)
  [ -x "$servers/redis_cluster.sh" ] && backends+=(redis-cluster)
fi

# Whatever a run killed from outside left behind: its servers and its namespaces.
netns_prefix=tsf$$
leftovers() {
  [ -n "${script:-}" ] && "$script" stop "$work/servers" >/dev/null 2>&1
  [ "$(id -u)" = 0 ] && "$servers/netns.sh" down "$netns_prefix" >/dev/null 2>&1
  true
}
trap 'leftovers; exit 130' INT TERM HUP

status=0
server_faults=server-kill,server-pause,client-pause,client-kill
for backend in "${backends[@]}"; do
  work=$out/$backend
  script=""
  # Partitions (root only; without root the run says so and injects the rest): the server
  # nodes (how many namespaces they take) and the clients in network namespaces of their own.
  partitions() { extra+=(--netns "$netns_prefix" --netns-script "$servers/netns.sh" --netns-servers "$1"); }
  extra=()
  case $backend in
    file) target=(--url "file://$work/locks"); kinds=client-pause,client-kill ;;
    redis|zookeeper|etcd|consul)
      script=$servers/$backend.sh; kinds=$server_faults,client-partition; partitions 1 ;;
    zookeeper-ensemble|etcd-cluster)
      script=$servers/${backend/-/_}.sh; kinds=$server_faults,partition,client-partition; partitions 3 ;;
    redis-sentinel) script=$servers/redis_sentinel.sh; kinds=$server_faults,partition,client-partition
      # Each admission waits for the replica (WAIT); what remains is the window before a client
      # notices a new primary (see docs/backends/redis.md, Redis Sentinel).
      extra=(--url-query min_replicas=1
             --allow-overlaps "Sentinel: a client may act on the old primary until it notices the failover")
      partitions 5 ;;  # p1 p2 s1 s2 s3
    redis-cluster) script=$servers/redis_cluster.sh; kinds=$server_faults,partition,client-partition
      # Likewise: a failover's window before a client notices its slot's new primary.
      extra=(--url-query min_replicas=1
             --allow-overlaps "Redis Cluster: a client may act on the old primary until it notices the failover")
      partitions 6 ;;  # 3 primaries, 3 replicas
    *) echo "unknown backend $backend" >&2; exit 2 ;;
  esac
  [ -n "$script" ] && target=(--server "$script")
  echo "== $backend: at least $min_holds holds, $seconds s or more, faults $kinds" >&2
  CONSUL_TEST_SESSION_TTL_MIN=1s CONSUL_TEST_URL_QUERY=lock_delay=1 \
    "$faults" run --backend "$backend" "${target[@]}" --work "$work" --seconds "$seconds" \
      --min-holds "$min_holds" --clients 6 --cli-clients 1 --ttl-ms 2000 --faults "$kinds" --cli "$cli" \
      --table "$table" "${extra[@]}" > "$out/$backend.txt" 2> "$out/$backend.log" || status=1
  leftovers
  tail -n +3 "$out/$backend.txt" | head -3 >&2
done
echo
cat "$table"
exit $status
