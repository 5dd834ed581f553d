#!/bin/bash
# The full fault suite (`make faults`): every backend, every fault kind it can take, at least
# MIN_HOLDS holds each (default 10000), one table (BUILD/faults/table.md) printed at the end.
#   tests/faults/run_all.sh BUILD_DIR [BACKEND...]
# Backends: file redis zookeeper etcd consul, and the clusters whose scripts exist:
# zookeeper-ensemble etcd-cluster redis-sentinel redis-cluster. Exit status 1 when any run found a problem.
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

status=0
server_faults=server-kill,server-pause,client-pause,client-kill
for backend in "${backends[@]}"; do
  work=$out/$backend
  extra=()
  case $backend in
    file) target=(--url "file://$work/locks"); kinds=client-pause,client-kill ;;
    redis) target=(--server "$servers/redis.sh"); kinds=$server_faults ;;
    zookeeper) target=(--server "$servers/zookeeper.sh"); kinds=$server_faults ;;
    etcd) target=(--server "$servers/etcd.sh"); kinds=$server_faults ;;
    consul) target=(--server "$servers/consul.sh"); kinds=$server_faults ;;
    zookeeper-ensemble|etcd-cluster)
      target=(--server "$servers/${backend/-/_}.sh"); kinds=$server_faults,partition,client-partition
      # Partitions: the nodes and the clients in network namespaces of their own (root only).
      extra=(--netns "tsf$$" --netns-script "$servers/netns.sh") ;;
    redis-sentinel) target=(--server "$servers/redis_sentinel.sh"); kinds=$server_faults
      # Each admission waits for the replica (WAIT); what remains is the window before a client
      # notices a new primary (see the README's Redis Sentinel section).
      extra=(--url-query min_replicas=1
             --allow-overlaps "Sentinel: a client may act on the old primary until it notices the failover") ;;
    redis-cluster) target=(--server "$servers/redis_cluster.sh"); kinds=$server_faults
      # Likewise: a failover's window before a client notices its slot's new primary.
      extra=(--url-query min_replicas=1
             --allow-overlaps "Redis Cluster: a client may act on the old primary until it notices the failover") ;;
    *) echo "unknown backend $backend" >&2; exit 2 ;;
  esac
  echo "== $backend: at least $min_holds holds, $seconds s or more, faults $kinds" >&2
  CONSUL_TEST_SESSION_TTL_MIN=1s CONSUL_TEST_URL_QUERY=lock_delay=1 \
    "$faults" run --backend "$backend" "${target[@]}" --work "$work" --seconds "$seconds" \
      --min-holds "$min_holds" --clients 6 --cli-clients 1 --ttl-ms 2000 --faults "$kinds" --cli "$cli" \
      --table "$table" "${extra[@]}" > "$out/$backend.txt" 2> "$out/$backend.log" || status=1
  tail -n +3 "$out/$backend.txt" | head -3 >&2
done
echo
cat "$table"
exit $status
