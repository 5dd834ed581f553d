#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# The etcd:// benchmarks, against one throwaway etcd (tests/servers/etcd.sh) in one run:
#   1. uncontended Mutex lock+unlock per second vs the raw Txn + DeleteRange gRPC loop
#      (turnstile_bench_etcd);
#   2. whole process: `turnstile run --backend etcd://... --lock x -- true` vs
#      `etcdctl lock x true` (hyperfine, median);
#   3. 8 processes contending for one Mutex: acquisitions per second, handoff p50/p99
#      (turnstile_bench_contention --url).
#   bench/etcd_run.sh <builddir> [seconds]
set -eu
build=$1
seconds=${2:-3}
here=$(cd "$(dirname "$0")" && pwd)
server=$(mktemp -d /tmp/turnstile-bench-etcd-XXXXXX)
trap '"$here/../tests/servers/etcd.sh" stop "$server"; rm -rf "$server"' EXIT
"$here/../tests/servers/etcd.sh" start "$server" >/dev/null
url=$(cat "$server/url")
endpoint="http://${url#etcd://}"

echo "== uncontended ($seconds s each, 3 rounds, raw and turnstile alternating)"
for round in 1 2 3; do
  raw=$("$build/bench/turnstile_bench_etcd_raw" "$url" "$seconds")
  ours=$("$build/bench/turnstile_bench_etcd" "$url" "$seconds")
  echo "round $round: raw Txn+DeleteRange $raw pairs/s, turnstile Mutex $ours pairs/s, raw/turnstile $(awk "BEGIN { printf \"%.2f\", $raw / $ours }")"
done

echo "== whole process (hyperfine, 100 runs)"
hyperfine --style none --shell none --warmup 10 --runs 100 --export-json "$server/cli.json" \
  "$build/tools/turnstile/turnstile run --backend $url --lock x -- true" \
  "etcdctl --endpoints=$endpoint lock x true" >/dev/null
python3 - "$server/cli.json" <<'PY'
import json, sys
results = json.load(open(sys.argv[1]))["results"]
for r in results:
    print(f'{r["median"]*1000:8.2f} ms median  {r["command"]}')
print(f'ratio turnstile/etcdctl: {results[0]["median"]/results[1]["median"]:.2f}')
PY

echo "== 8 contenders ($seconds s)"
"$build/bench/turnstile_bench_contention" turnstile --procs 8 --seconds "$seconds" --url "$url"
