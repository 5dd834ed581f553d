#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# The consul:// benchmarks, against one throwaway Consul test stand-in (tests/servers/consul.sh;
# a Python program built from Consul's documentation, not Consul) in one run:
#   1. uncontended Mutex lock+unlock per second vs api.Lock's own two requests (PUT ?acquire and
#      PUT ?release on one kept-alive connection), 3 rounds alternating, and the HTTP requests one
#      turnstile lock+unlock sends (the stand-in's test-only counters);
#   2. 8 processes contending for one Mutex: acquisitions per second, handoff p50/p99, and the
#      blocking queries answered per handoff (1 = one wake-up per release among the waiters).
#   bench/consul_run.sh <builddir> [seconds]
set -eu
build=$1
seconds=${2:-3}
here=$(cd "$(dirname "$0")" && pwd)
server=$(mktemp -d /tmp/turnstile-bench-consul-XXXXXX)
trap '"$here/../tests/servers/consul.sh" stop "$server"; rm -rf "$server"' EXIT
# Tombstones of the benchmark's many short-lived keys reaped after 1 s (Consul: 15 min), so the
# stand-in's state, which it rewrites on every write, stays small for both loops.
CONSUL_TEST_TOMBSTONE_TTL=1s "$here/../tests/servers/consul.sh" start "$server" >/dev/null
url=$(cat "$server/url")
base="http://${url#consul://}"
stats() { curl -s "$base/v1/test-stand-in/stats"; }
# What changed in the counters between two snapshots, per event: "KEY=N ..." for keys matching $3.
delta() {
  /usr/bin/python3 - "$1" "$2" "$3" "$4" <<'PY'
import json, sys
before, after, pattern, per = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3], float(sys.argv[4])
for key in sorted(after):
    if pattern in key:
        n = after[key] - before.get(key, 0)
        if n:
            print(f"  {key}: {n / per:.2f}")
PY
}

echo "== uncontended ($seconds s each, 3 rounds, raw and turnstile alternating)"
for round in 1 2 3; do
  raw=$("$build/bench/turnstile_bench_consul" raw "$url" "$seconds")
  ours=$("$build/bench/turnstile_bench_consul" turnstile "$url" "$seconds")
  echo "round $round: raw acquire+release PUTs $raw pairs/s, turnstile Mutex $ours pairs/s, turnstile time / raw time $(awk "BEGIN { printf \"%.2f\", $raw / $ours }")"
done
before=$(stats)
"$build/bench/turnstile_bench_consul" turnstile "$url" 1 > "$server/pairs"
pairs=$(cat "$server/pairs")
after=$(stats)
# The program also warms up with 200 pairs and connects once: per pair is close enough at
# thousands of pairs.
echo "requests per turnstile lock+unlock (about $pairs pairs + 200 warm-up):"
delta "$before" "$after" "/" "$(awk "BEGIN { print $pairs + 200 }")"

echo "== 8 contenders ($seconds s)"
before=$(stats)
"$build/bench/turnstile_bench_contention" turnstile --procs 8 --seconds "$seconds" --url "$url" | tee "$server/contention.json"
after=$(stats)
acquisitions=$(/usr/bin/python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d.get("acquisitions") or d.get("holds") or 0)' "$server/contention.json")
echo "per acquisition ($acquisitions):"
delta "$before" "$after" "" "$acquisitions"
