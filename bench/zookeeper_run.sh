#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# The zk:// benchmarks, Apache Curator 5 as the peer, each section against one throwaway
# ZooKeeper (tests/servers/zookeeper.sh) shared by turnstile, Curator and the raw loop:
#   1. uncontended RecursiveMutex lock+unlock per second vs Curator's InterProcessMutex vs the
#      raw limit (create ephemeral-sequential + getChildren + delete on the same C client), and
#      the requests the server received per pair; with the server's default fsync
#      (forceSync=yes) and with forceSync=no;
#   2. 8 contenders on one Mutex for SECONDS: acquisitions/s and handoff p50/p99 (turnstile:
#      8 processes, bench/contention.cpp; Curator: 8 sessions in one JVM);
#   3. PROCS x THREADS turnstile Mutex waiters on one lock: watches the server fired per release
#      and client memory per waiter.
# Each measurement is the median of RUNS runs, the three uncontended loops interleaved
# (rotated order) so that drift on a busy machine hits all of them alike. Prints markdown.
#   bench/zookeeper_run.sh <builddir>
#   env: RUNS=3 SECONDS_EACH=3 CONTENTION_SECONDS=2 PROCS=10 THREADS=100
set -eu
build=$(cd "$1" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
runs=${RUNS:-3}
seconds=${SECONDS_EACH:-3}
contention_seconds=${CONTENTION_SECONDS:-2}
procs=${PROCS:-10}
threads=${THREADS:-100}
bench=$build/bench/turnstile_bench_zookeeper
contention=$build/bench/turnstile_bench_contention
for binary in "$bench" "$contention"; do
  [ -x "$binary" ] || { echo "missing $binary (build the bench targets)" >&2; exit 1; }
done

jars=
for jar in curator-recipes curator-framework curator-client zookeeper zookeeper-jute guava slf4j-api slf4j-nop; do
  jars=$jars:/usr/share/java/$jar.jar
done
java_dir=$build/bench/java
if [ ! -f "$java_dir/ZookeeperCuratorBench.class" ] || [ "$here/ZookeeperCuratorBench.java" -nt "$java_dir/ZookeeperCuratorBench.class" ]; then
  mkdir -p "$java_dir"
  javac -d "$java_dir" -cp "${jars#:}" "$here/ZookeeperCuratorBench.java"
fi
curator() { java -Xmx512m -cp "$java_dir$jars" ZookeeperCuratorBench "$@"; }

work=$(mktemp -d /tmp/turnstile-bench-zk-XXXXXX)
server=
stop_server() {
  if [ -n "$server" ]; then "$here/../tests/servers/zookeeper.sh" stop "$server" || true; fi
  server=
}
trap 'stop_server; rm -rf "$work"' EXIT
start_server() {  # start_server NAME [forceSync value]
  server=$work/$1
  TURNSTILE_ZK_FORCESYNC=${2:-} "$here/../tests/servers/zookeeper.sh" start "$server" >/dev/null
  url=$(cat "$server/url")
  export TURNSTILE_ZK_SERVER_PID
  TURNSTILE_ZK_SERVER_PID=$(cat "$server/zookeeper.pid")
}
load() { cut -d' ' -f1-3 /proc/loadavg; }

echo "load average before: $(load) ($(nproc) CPUs)" >&2
for sync in default no; do
  if [ "$sync" = default ]; then start_server zk-default; else start_server zk-nosync no; fi
  echo "== uncontended, forceSync=$sync ($url, $seconds s per loop, $runs runs)" >&2
  # Warm the server's JIT first (10 s: its CPU per request keeps falling for tens of seconds),
  # so that whichever loop runs first is not penalized.
  "$bench" uncontended raw "$url" 10 >/dev/null
  for run in $(seq 1 "$runs"); do
    modes=(turnstile curator raw raw-container raw-noresolve)
    shift_by=$(( (run - 1) % ${#modes[@]} ))
    modes=("${modes[@]:shift_by}" "${modes[@]:0:shift_by}")
    for mode in "${modes[@]}"; do
      if [ "$mode" = curator ]; then line=$(curator uncontended "${url#zk://}" "$seconds") || continue
      else line=$("$bench" uncontended "$mode" "$url" "$seconds") || continue; fi
      echo "$line" >&2
      echo "{\"section\":\"uncontended\",\"sync\":\"$sync\",\"run\":$run,\"load\":\"$(load)\",\"result\":$line}" >> "$work/results.jsonl"
    done
  done
  if [ "$sync" = default ]; then
    echo "== 8 contenders, forceSync=$sync ($contention_seconds s, $runs runs)" >&2
    for run in $(seq 1 "$runs"); do
      line=$("$contention" turnstile --procs 8 --seconds "$contention_seconds" --url "$url") || continue
      echo "$line" >&2
      echo "{\"section\":\"contention\",\"sync\":\"$sync\",\"run\":$run,\"load\":\"$(load)\",\"result\":$line}" >> "$work/results.jsonl"
      line=$(curator contention "${url#zk://}" 8 "$contention_seconds") || continue
      echo "$line" >&2
      echo "{\"section\":\"contention\",\"sync\":\"$sync\",\"run\":$run,\"load\":\"$(load)\",\"result\":$line}" >> "$work/results.jsonl"
    done
    echo "== $procs x $threads waiters, forceSync=$sync ($runs runs)" >&2
    for run in $(seq 1 "$runs"); do
      sleep 2  # let the server close the previous run's sessions
      line=$("$bench" waiters "$url" --procs "$procs" --threads "$threads") || { echo "waiters run $run failed" >&2; continue; }
      echo "$line" >&2
      echo "{\"section\":\"waiters\",\"sync\":\"$sync\",\"run\":$run,\"load\":\"$(load)\",\"result\":$line}" >> "$work/results.jsonl"
    done
  fi
  stop_server
done
echo "load average after: $(load)" >&2

python3 - "$work/results.jsonl" "$(nproc)" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
cpus = sys.argv[2]
med = statistics.median
def pick(section, sync, mode=None):
    return [r for r in rows if r["section"] == section and r["sync"] == sync and (mode is None or r["result"]["mode"] == mode)]
loads = [float(r["load"].split()[0]) for r in rows]
print(f"Load average (1 min) during the run: {min(loads):.2f} to {max(loads):.2f} on {cpus} CPUs "
      f"(median {med(loads):.2f}); medians of {max(r['run'] for r in rows)} runs.\n")

print("### 1. Uncontended lock+unlock per second (one client, one lock)\n")
print("| server | turnstile RecursiveMutex | Curator InterProcessMutex | raw create+getChildren+delete | turnstile / Curator | turnstile / raw | requests per pair (turnstile / Curator / raw) |")
print("|---|---:|---:|---:|---:|---:|---|")
for sync in ("default", "no"):
    by = {m: pick("uncontended", sync, m) for m in ("turnstile", "curator", "raw", "raw-container", "raw-noresolve")}
    if not by["turnstile"]:
        continue
    rate = {m: med(r["result"]["per_second"] for r in v) for m, v in by.items() if v}
    runs = sorted({r["run"] for r in by["turnstile"]})
    def paired(a, b):  # median of the per-run ratios (the loops of one run are interleaved)
        ra = {r["run"]: r["result"]["per_second"] for r in by[a]}
        rb = {r["run"]: r["result"]["per_second"] for r in by[b]}
        return med(ra[k] / rb[k] for k in runs if k in ra and k in rb)
    req = {m: med(r["result"]["packets_per_pair"] for r in v) for m, v in by.items() if v}
    name = "forceSync=yes (default)" if sync == "default" else "forceSync=no"
    print(f"| {name} | {rate['turnstile']:.0f} | {rate['curator']:.0f} | {rate['raw']:.0f} | "
          f"{paired('turnstile', 'curator'):.2f}x | {paired('turnstile', 'raw'):.2f}x | "
          f"{req['turnstile']:.2f} / {req['curator']:.2f} / {req['raw']:.2f} |")
print("\nRatios are medians of the per-run ratios. Requests per pair: delta of the server's "
      "`zk_packets_received` (mntr) over the timed loop divided by the pairs; the keeper's "
      "once-a-second ping and the C client's pings are included (+0.001 to +0.003).\n")
print("Where the time goes (medians): CPU per pair of the client process (all its threads) and of the server; "
      "raw-container is the raw loop with turnstile's node data and a container parent; "
      "raw-noresolve is the raw loop with zoo_set_servers_resolution_delay(zh, -1) (no getaddrinfo per socket poll).\n")
print("| server | loop | pairs/s | client CPU µs/pair | server CPU µs/pair |")
print("|---|---|---:|---:|---:|")
for sync in ("default", "no"):
    for mode in ("turnstile", "curator", "raw", "raw-container", "raw-noresolve"):
        v = pick("uncontended", sync, mode)
        if not v:
            continue
        cpu = [r["result"].get("client_cpu_us_per_pair") for r in v]
        srv = [r["result"].get("server_cpu_us_per_pair") for r in v]
        cpu_text = f"{med(cpu):.0f}" if None not in cpu else "n/a (JVM)"
        srv_text = f"{med(srv):.0f}" if None not in srv else "n/a"
        print(f"| forceSync={'yes' if sync == 'default' else 'no'} | {mode} | {med(r['result']['per_second'] for r in v):.0f} | {cpu_text} | {srv_text} |")

c = pick("contention", "default")
if c:
    print("\n### 2. 8 contenders on one Mutex (forceSync=yes)\n")
    print("| contenders | acquisitions/s | handoff p50 | handoff p99 | cross-contender p50 | cross p99 | same contender again | order errors |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for mode, label in (("turnstile", "turnstile Mutex, 8 processes"), ("curator", "Curator InterProcessMutex, 8 sessions in one JVM")):
        v = [r["result"] for r in c if r["result"]["mode"] == mode]
        if not v:
            continue
        ms = lambda k: med(x[k] for x in v) / 1e6
        print(f"| {label} | {med(x['per_second'] for x in v):.0f} | {ms('handoff_p50_ns'):.2f} ms | {ms('handoff_p99_ns'):.2f} ms | "
              f"{ms('cross_p50_ns'):.2f} ms | {ms('cross_p99_ns'):.2f} ms | {100 * med(x['same_process_share'] for x in v):.1f}% | "
              f"{max(x['order_errors'] for x in v)} |")
    t = [r["result"] for r in c if r["result"]["mode"] == "turnstile"]
    p = [r["result"] for r in c if r["result"]["mode"] == "curator"]
    if t and p:
        print(f"\nturnstile / Curator acquisitions/s: {med(x['per_second'] for x in t) / med(x['per_second'] for x in p):.2f}x; "
              f"handoff p50 turnstile / Curator: {med(x['handoff_p50_ns'] for x in t) / med(x['handoff_p50_ns'] for x in p):.2f}x")

w = [r["result"] for r in pick("waiters", "default")]
if w:
    n = w[0]["waiters"]
    print(f"\n### 3. {n} waiters on one lock ({w[0]['procs']} processes x {w[0]['threads']} threads, turnstile Mutex)\n")
    print("| watches set while queued | watches fired in total (releases with a waiter behind) | fired per release | of which on deleted nodes / on children lists | drain (handoffs/s) | RSS per waiter incl. its thread | idle thread alone | per waiter, thread excluded | failed |")
    print("|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    print(f"| {med(x['watches_while_queued'] for x in w):.0f} | {med(x['watches_fired'] for x in w):.0f} ({n}) | "
          f"{med(x['fired_per_release_with_waiter'] for x in w):.3f} | {med(x['deleted_watches_fired'] for x in w):.0f} / "
          f"{med(x['children_watches_fired'] for x in w):.0f} | {med(x['handoffs_per_second'] for x in w):.0f} | "
          f"{med(x['waiter_kib_with_thread'] for x in w):.1f} KiB | {med(x['idle_thread_kib'] for x in w):.1f} KiB | "
          f"{med(x['waiter_kib_minus_thread'] for x in w):.1f} KiB | {max(x['failed'] for x in w)} |")
    print(f"\nAfter malloc_trim(0) in every waiter process, still {med(x['waiter_kib_trimmed_minus_thread'] for x in w):.1f} KiB "
          "per waiter (thread excluded): live memory, not malloc's cache.")
    print("\nWatches: deltas of mntr's `zk_watch_count` and `zk_sum_node_{deleted,changed,created,children}_watch_count` "
          "(server side). Memory: summed VmRSS of the waiter processes after connecting, after starting as many idle "
          "threads (blocked in read(2)), and after the waiter threads queued.")
PY
