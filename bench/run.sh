#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Runs every turnstile benchmark against its peer in the same run and prints a markdown table.
# Builds nothing: build first (the `bench` target builds, then runs this).
#
#   bench/run.sh <builddir> [--runs N] [--seconds S] [--redis | --redis-only]
#   cmake --build <builddir> --target bench        (or --target bench-redis: with --redis)
#
# Needs <builddir>/bench/turnstile_bench_{uncontended,contention} and awk; the whole-process
# comparison also needs hyperfine, flock(1) and <builddir>/tools/turnstile/turnstile (or
# $TURNSTILE_CLI), and is skipped with a message when one is missing.
#
# Each comparison runs --runs times (default 3); every ratio is computed within one run (both
# sides measured back to back), and the tables show the median over the runs. The contention
# comparison runs each side for --seconds (default 2). Takes about a minute and a half.
# Raw results are kept in $TURNSTILE_BENCH_OUT (default: a fresh mktemp -d directory).
#
# --redis adds the redis:// backend section (about half a minute more), --redis-only runs only it.
# It starts its own throwaway redis-server (tests/servers/redis.sh, persistence off) and, in
# each run against that one server: an uncontended Mutex vs two bare PING round trips on one
# hiredis connection and vs redis-py's redis.lock.Lock (Debian's python3-redis, run with
# /usr/bin/python3 or $TURNSTILE_BENCH_PYTHON), then --procs processes contending for one
# Mutex and 16 for one Semaphore(limit 3), --seconds each. It needs redis-server, redis-cli and
# <builddir>/bench/turnstile_bench_redis_uncontended (built when the redis backend is), and is
# skipped with a message when one is missing; the redis-py comparison alone is skipped when
# that Python cannot import redis.
set -eu

usage() { echo "usage: $0 <builddir> [--runs N] [--seconds S] [--redis | --redis-only]" >&2; exit 64; }
[ $# -ge 1 ] || usage
build=$(cd "$1" && pwd) || usage
shift
runs=3
seconds=2
file_section=1
redis_section=0
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) runs=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    --redis) redis_section=1; shift ;;
    --redis-only) redis_section=1; file_section=0; shift ;;
    *) usage ;;
  esac
done
here=$(cd "$(dirname "$0")" && pwd)

uncontended=$build/bench/turnstile_bench_uncontended
contention=$build/bench/turnstile_bench_contention
cli=${TURNSTILE_CLI:-$build/tools/turnstile/turnstile}
for binary in "$uncontended" "$contention"; do
  [ -x "$binary" ] || { echo "$0: $binary not found: build the bench targets first" >&2; exit 66; }
done

out=${TURNSTILE_BENCH_OUT:-$(mktemp -d /tmp/turnstile-bench-results-XXXXXX)}
mkdir -p "$out"
rm -f "$out"/uncontended-* "$out"/contention-* "$out"/cli-* "$out"/redis-*
scratch=$(mktemp -d /tmp/turnstile-bench-scratch-XXXXXX)
redis_dir=
cleanup() {
  [ -n "$redis_dir" ] && "$here/../tests/servers/redis.sh" stop "$redis_dir" >/dev/null 2>&1
  rm -rf "$scratch"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
echo "raw results: $out" >&2

i=1
[ "$file_section" -eq 1 ] || i=$((runs + 1))
while [ "$i" -le "$runs" ]; do
  echo "run $i/$runs: uncontended (Google Benchmark)" >&2
  "$uncontended" --benchmark_out="$out/uncontended-$i.csv" --benchmark_out_format=csv \
    >"$out/uncontended-$i.txt" 2>&1

  echo "run $i/$runs: 8 processes contending, turnstile then flock, ${seconds} s each" >&2
  "$contention" turnstile --procs 8 --seconds "$seconds" >"$out/contention-turnstile-$i.json"
  "$contention" flock --procs 8 --seconds "$seconds" >"$out/contention-flock-$i.json"

  if [ ! -x "$cli" ]; then
    [ "$i" -eq 1 ] && echo "SKIPPED whole-process comparison: $cli not built" >&2
  elif ! command -v hyperfine >/dev/null || ! command -v flock >/dev/null; then
    [ "$i" -eq 1 ] && echo "SKIPPED whole-process comparison: hyperfine or flock(1) missing" >&2
  else
    echo "run $i/$runs: turnstile run vs flock(1) under hyperfine" >&2
    dir=$(mktemp -d "$scratch/cli-XXXXXX")
    hyperfine --style none --shell none --warmup 20 --runs 200 \
      --export-json "$out/cli-$i.json" --export-csv "$out/cli-$i.csv" \
      -n "turnstile run" "$cli run --backend file://$dir --lock x -- true" \
      -n "flock" "flock $dir/x true" >"$out/cli-$i.txt" 2>&1
  fi
  i=$((i + 1))
done

# The summary: plain POSIX awk over the CSV and one-line JSON files of each run.
# Shared by the file:// and the redis:// summaries.
awk_functions='
function median(key,   n, i, j, t, a) {  # median over runs of v[key, run]
  n = 0
  for (i = 1; i <= runs; i++) if ((key, i) in v) a[++n] = v[key, i]
  for (i = 2; i <= n; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
  if (n == 0) return 0
  return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
}
function commas(x,   s, r) {
  s = sprintf("%.0f", x); r = ""
  while (length(s) > 3) { r = "," substr(s, length(s) - 2) r; s = substr(s, 1, length(s) - 3) }
  return s r
}
function us(ns) { return sprintf("%.1f µs", ns / 1000) }
function per_run(key,   i, s) {
  s = ""
  for (i = 1; i <= runs; i++) if ((key, i) in v) s = s (s == "" ? "" : ", ") sprintf("%.2f", v[key, i])
  return s
}
function run_of(file) { sub(/.*-/, "", file); sub(/\..*/, "", file); return file + 0 }
'
if [ "$file_section" -eq 1 ]; then
cli_files=
[ -f "$out/cli-1.csv" ] && cli_files=$(i=1; while [ "$i" -le "$runs" ]; do printf '%s ' "$out/cli-$i.csv"; i=$((i + 1)); done)
# shellcheck disable=SC2086
awk -v runs="$runs" "$awk_functions"'
FNR == 1 { run = run_of(FILENAME) }
# Google Benchmark CSV: "BM_Name/real_time",iterations,real_time,cpu_time,ns,...
FILENAME ~ /uncontended-[0-9]+\.csv$/ && /^"BM_/ {
  split($0, f, ","); name = f[1]; gsub(/"/, "", name); sub(/\/.*/, "", name)
  v["u_real_" name, run] = f[3]; v["u_cpu_" name, run] = f[4]; seen_u[name] = 1
}
# turnstile_bench_contention: one flat JSON object per file.
FILENAME ~ /contention-(turnstile|flock)-[0-9]+\.json$/ {
  line = $0; gsub(/[{}"]/, "", line); n = split(line, kv, ",")
  for (k = 1; k <= n; k++) { split(kv[k], p, ":"); c[p[1]] = p[2] }
  mode = c["mode"]
  for (key in c) v["c_" mode "_" key, run] = c[key]
}
# hyperfine CSV: command,mean,stddev,median,user,system,min,max
FILENAME ~ /cli-[0-9]+\.csv$/ && FNR > 1 {
  split($0, f, ","); cmd = (f[1] == "flock") ? "flock" : "ts"
  v["h_mean_" cmd, run] = f[2]; v["h_cpu_" cmd, run] = f[5] + f[6]; have_cli = 1
}
END {
  for (i = 1; i <= runs; i++) for (name in seen_u) if (("u_real_BM_FlockPair", i) in v && ("u_real_" name, i) in v) {
    v["u_rr_" name, i] = v["u_real_" name, i] / v["u_real_BM_FlockPair", i]
    v["u_cr_" name, i] = v["u_cpu_" name, i] / v["u_cpu_BM_FlockPair", i]
  }
  order = "BM_FlockPair BM_Mutex BM_RecursiveMutex BM_SharedMutexShared BM_SharedMutexExclusive BM_Semaphore BM_PermitCounter"
  label["BM_FlockPair"] = "bare `flock(2)` LOCK_EX + LOCK_UN (baseline)"
  label["BM_Mutex"] = "`Mutex` lock + unlock"
  label["BM_RecursiveMutex"] = "`RecursiveMutex` lock + unlock"
  label["BM_SharedMutexShared"] = "`SharedMutex` lock_shared + unlock_shared"
  label["BM_SharedMutexExclusive"] = "`SharedMutex` lock + unlock"
  label["BM_Semaphore"] = "`Semaphore` acquire + release (limit 4)"
  label["BM_PermitCounter"] = "`PermitCounter` acquire + release"
  printf "Uncontended, file:// backend, one thread (median of %d runs; ratios within each run, then median):\n\n", runs
  print "| operation | wall time | vs flock pair | vs flock pair, CPU time of the calling thread |"
  print "|---|---:|---:|---:|"
  n = split(order, names, " ")
  for (k = 1; k <= n; k++) {
    name = names[k]; if (!(name in seen_u)) continue
    printf "| %s | %s ns | %.2f× | %.2f× |\n", label[name], commas(median("u_real_" name)),
      median("u_rr_" name), median("u_cr_" name)
  }
  r = median("u_rr_BM_Mutex")
  printf "\nMutex / flock pair: %.2f× (target ≤ 3×: %s); per run: %s\n\n", r, r <= 3 ? "met" : "NOT met", per_run("u_rr_BM_Mutex")

  for (i = 1; i <= runs; i++) if (("c_flock_per_second", i) in v && ("c_turnstile_per_second", i) in v) {
    v["c_tp", i] = v["c_turnstile_per_second", i] / v["c_flock_per_second", i]
    if (v["c_flock_cross_p50_ns", i] > 0) v["c_cross", i] = v["c_turnstile_cross_p50_ns", i] / v["c_flock_cross_p50_ns", i]
    errors += v["c_turnstile_order_errors", i] + v["c_turnstile_failed", i] + v["c_flock_failed", i]
  }
  printf "8 processes contending for one lock, %g s each, empty critical section (median of %d runs):\n\n", median("c_turnstile_seconds"), runs
  print "| | acquisitions/s | handoff p50 | handoff p99 | handoff to another process p50 | p99 | next holder is the same process |"
  print "|---|---:|---:|---:|---:|---:|---:|"
  for (k = 1; k <= 2; k++) {
    mode = k == 1 ? "turnstile" : "flock"
    printf "| %s | %s | %s | %s | %s | %s | %.1f%% |\n", k == 1 ? "`Mutex` (FIFO)" : "bare `flock(2)` (not FIFO)",
      commas(median("c_" mode "_per_second")), us(median("c_" mode "_handoff_p50_ns")), us(median("c_" mode "_handoff_p99_ns")),
      us(median("c_" mode "_cross_p50_ns")), us(median("c_" mode "_cross_p99_ns")), 100 * median("c_" mode "_same_process_share")
  }
  printf "\nThroughput turnstile / flock: %.2f×; handoff to another process p50, turnstile / flock: %.2f×; token-order errors or failures: %d\n\n",
    median("c_tp"), median("c_cross"), errors

  if (!have_cli) { print "Whole process (`turnstile run` vs `flock(1)`): skipped, the CLI was not built."; exit }
  for (i = 1; i <= runs; i++) {
    v["h_r", i] = v["h_mean_ts", i] / v["h_mean_flock", i]
    v["h_cr", i] = v["h_cpu_ts", i] / v["h_cpu_flock", i]
  }
  printf "Whole process, hyperfine --warmup 20 --runs 200 (median of %d runs):\n\n", runs
  print "| command | mean wall time | vs flock(1) | user+sys CPU | vs flock(1), CPU |"
  print "|---|---:|---:|---:|---:|"
  printf "| `turnstile run --backend file://DIR --lock x -- true` | %.2f ms | %.2f× | %.2f ms | %.2f× |\n",
    1000 * median("h_mean_ts"), median("h_r"), 1000 * median("h_cpu_ts"), median("h_cr")
  printf "| `flock DIR/x true` | %.2f ms | 1.00× | %.2f ms | 1.00× |\n", 1000 * median("h_mean_flock"), 1000 * median("h_cpu_flock")
  r = median("h_r")
  printf "\nturnstile run / flock(1): %.2f× (target ≤ 1.5×: %s); per run: %s\n", r, r <= 1.5 ? "met" : "NOT met", per_run("h_r")
}
' "$out"/uncontended-*.csv "$out"/contention-*.json $cli_files
fi

[ "$redis_section" -eq 1 ] || exit 0

# The redis:// section: one throwaway redis-server for every run of it.
redis_bench=$build/bench/turnstile_bench_redis_uncontended
python=${TURNSTILE_BENCH_PYTHON:-/usr/bin/python3}
skip_redis() { echo; echo "redis:// backend: SKIPPED, $1"; echo "SKIPPED redis:// section: $1" >&2; exit 0; }
if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
  skip_redis "redis-server or redis-cli is not installed (Debian: apt-get install redis-server)"
fi
if [ ! -x "$redis_bench" ] || [ ! -f "$build/src/libturnstile-redis.so" ]; then
  skip_redis "the redis backend or its benchmark is not built (needs libhiredis-dev; $redis_bench)"
fi
have_py=1
if ! "$python" -c 'import redis' 2>/dev/null; then
  have_py=0
  echo "SKIPPED redis-py comparison: $python cannot import redis (Debian: apt-get install python3-redis)" >&2
fi
redis_dir=$scratch/redis
"$here/../tests/servers/redis.sh" start "$redis_dir" >&2 || skip_redis "redis-server did not start (log above)"
url=$(cat "$redis_dir/url")
redis-server --version | sed 's/ sha=.*//' >"$out/redis-version.txt"
[ "$have_py" -eq 1 ] && "$python" -c 'import redis; print(redis.__version__)' >"$out/redis-py-version.txt"
stats() { redis-cli -u "$url" info commandstats | tr -d '\r' >"$1"; }

i=1
while [ "$i" -le "$runs" ]; do
  echo "run $i/$runs: redis:// uncontended: 2 PINGs, empty script pair, Mutex (Google Benchmark)" >&2
  "$redis_bench" --url="$url" --benchmark_min_time=1 --benchmark_out="$out/redis-uncontended-$i.csv" --benchmark_out_format=csv \
    >"$out/redis-uncontended-$i.txt" 2>&1
  if [ "$have_py" -eq 1 ]; then
    echo "run $i/$runs: redis:// uncontended: redis-py Lock, ${seconds} s" >&2
    "$python" "$here/redis_py_lock.py" "$url" "$seconds" >"$out/redis-py-$i.json"
  fi
  echo "run $i/$runs: redis:// ${seconds} s each: 8 processes on one Mutex, 16 on one Semaphore(3)" >&2
  stats "$out/redis-mutex-before-$i.txt"
  "$contention" turnstile --procs 8 --seconds "$seconds" --url "$url" >"$out/redis-mutex-$i.json"
  stats "$out/redis-mutex-after-$i.txt"
  "$contention" semaphore --limit 3 --procs 16 --seconds "$seconds" --url "$url" >"$out/redis-semaphore-$i.json"
  stats "$out/redis-semaphore-after-$i.txt"
  i=$((i + 1))
done
echo "redis:// commands the client sends per lock+unlock, under MONITOR (1000 pairs)" >&2
"$redis_bench" --url="$url" --count-commands 1000 >"$out/redis-commands.json"

py_files=
[ "$have_py" -eq 1 ] && py_files=$(i=1; while [ "$i" -le "$runs" ]; do printf '%s ' "$out/redis-py-$i.json"; i=$((i + 1)); done)
# shellcheck disable=SC2086
awk -v runs="$runs" -v server="$(cat "$out/redis-version.txt")" \
    -v pyversion="$(cat "$out/redis-py-version.txt" 2>/dev/null || true)" "$awk_functions"'
function json(line, into,   n, k, kv, p) {  # one flat JSON object, no nesting, no commas in values
  gsub(/[{}"]/, "", line); n = split(line, kv, ",")
  for (k = 1; k <= n; k++) { split(kv[k], p, ":"); into[p[1]] = p[2] }
}
function calls(file, name) { return ((file, name) in st) ? st[file, name] : 0 }
FNR == 1 { run = run_of(FILENAME) }
# Google Benchmark CSV with counters: find the columns by the header.
FILENAME ~ /redis-uncontended-[0-9]+\.csv$/ && /^name,/ {
  n = split($0, h, ","); for (k = 1; k <= n; k++) { gsub(/"/, "", h[k]); col[h[k]] = k }
}
FILENAME ~ /redis-uncontended-[0-9]+\.csv$/ && /^"BM_/ {
  split($0, f, ","); name = f[1]; gsub(/"/, "", name); sub(/\/.*/, "", name)
  v["real_" name, run] = f[col["real_time"]]; v["cpu_" name, run] = f[col["cpu_time"]]
  v["cmds_" name, run] = f[col["commands_per_pair"]]; v["evalsha_" name, run] = f[col["evalsha_per_pair"]]
  seen[name] = 1
}
FILENAME ~ /redis-py-[0-9]+\.json$/ {
  split("", c); json($0, c)
  v["real_py", run] = c["ns_per_pair"]; v["cmds_py", run] = c["commands_per_pair"]; v["evalsha_py", run] = c["evalsha_per_pair"]; have_py = 1
}
FILENAME ~ /redis-(mutex|semaphore)-[0-9]+\.json$/ {
  split("", c); json($0, c); mode = FILENAME ~ /semaphore/ ? "sem" : "mutex"
  for (key in c) v[mode "_" key, run] = c[key]
  errors += c["failed"] + c["order_errors"]
  if (mode == "sem" && c["max_holders"] > c["limit"]) errors++
}
FILENAME ~ /redis-commands\.json$/ { json($0, mon) }
# INFO commandstats: cmdstat_evalsha:calls=123,usec=...
FILENAME ~ /redis-(mutex|semaphore)-(before|after)-[0-9]+\.txt$/ && /^cmdstat_/ {
  base = FILENAME; sub(/.*\//, "", base); split($0, f, /[:=,]/); st[base, substr(f[1], 9)] = f[3]
}
END {
  for (i = 1; i <= runs; i++) {
    if (("real_BM_RedisPingPair", i) in v) {
      ping = v["real_BM_RedisPingPair", i]
      v["r_ping_BM_RedisPingPair", i] = 1
      v["r_ping_BM_RedisEmptyScriptPair", i] = v["real_BM_RedisEmptyScriptPair", i] / ping
      v["r_ping_BM_RedisMutex", i] = v["real_BM_RedisMutex", i] / ping
      if (("real_py", i) in v) {
        v["r_ping_py", i] = v["real_py", i] / ping
        v["r_py", i] = v["real_py", i] / v["real_BM_RedisMutex", i]  # pairs/s turnstile / redis-py
      }
    }
    for (k = 1; k <= 2; k++) {
      mode = k == 1 ? "mutex" : "sem"
      before = k == 1 ? "redis-mutex-before-" i ".txt" : "redis-mutex-after-" i ".txt"
      after = k == 1 ? "redis-mutex-after-" i ".txt" : "redis-semaphore-after-" i ".txt"
      acq = v[mode "_acquisitions", i]; if (acq <= 0) continue
      split("evalsha subscribe unsubscribe publish", names, " ")
      for (n = 1; n <= 4; n++) v[mode "_per_" names[n], i] = (calls(after, names[n]) - calls(before, names[n])) / acq
    }
  }
  printf "\nredis:// backend: %s on 127.0.0.1, persistence off, the same server for every row; 2-core VM, noisy.\n", server
  printf "Uncontended, one thread (median of %d runs; ratios within each run, then median):\n\n", runs
  print "| operation | wall time per pair | pairs/s | vs two PINGs | server commands per pair: all / EVALSHA |"
  print "|---|---:|---:|---:|---:|"
  split("BM_RedisPingPair BM_RedisEmptyScriptPair BM_RedisMutex", order, " ")
  label["BM_RedisPingPair"] = "two bare `PING` round trips, one hiredis connection (the limit)"
  label["BM_RedisEmptyScriptPair"] = "two `EVALSHA` round trips of `return 1`, hiredis (reference)"
  label["BM_RedisMutex"] = "turnstile `Mutex` lock + unlock"
  for (k = 1; k <= 3; k++) {
    name = order[k]; if (!(name in seen)) continue
    t = median("real_" name)
    printf "| %s | %.1f µs | %s | %.2f× | %g / %g |\n", label[name], t / 1000, commas(1e9 / t), median("r_ping_" name),
      median("cmds_" name), median("evalsha_" name)
  }
  if (have_py) {
    t = median("real_py")
    printf "| redis-py %s `redis.lock.Lock` acquire + release | %.1f µs | %s | %.2f× | %g / %g |\n", pyversion, t / 1000,
      commas(1e9 / t), median("r_ping_py"), median("cmds_py"), median("evalsha_py")
  }
  print ""
  if (have_py) {
    r = median("r_py")
    printf "turnstile / redis-py, pairs/s: %.2f× (target ≥ 1.3×: %s); per run: %s\n", r, (r >= 1.3 ? "met" : "NOT met"), per_run("r_py")
  } else print "turnstile / redis-py: skipped, no redis-py"
  r = median("r_ping_BM_RedisMutex")
  printf "turnstile / two PINGs, time per pair: %.2f× (target ≤ 1.15×: %s); per run: %s\n", r, r <= 1.15 ? "met" : "NOT met",
    per_run("r_ping_BM_RedisMutex")
  sent = mon["sent_per_pair"] + 0
  printf "Commands per lock+unlock: the client sends %g (EVALSHA: %g; MONITOR over %d pairs; target 2: %s); INFO commandstats counts %g, as it also counts the %g redis.call()s the two scripts make.\n\n",
    sent, mon["sent_evalsha_per_pair"] + 0, mon["pairs"], (sent <= 2 ? "met" : "NOT met"), median("cmds_BM_RedisMutex"), mon["from_scripts_per_pair"] + 0

  printf "Contended, empty critical section, %g s each (median of %d runs):\n\n", median("mutex_seconds"), runs
  print "| | processes | acquisitions/s | handoff p50 | handoff p99 | next holder is the same process | EVALSHA / SUBSCRIBE / UNSUBSCRIBE per acquisition |"
  print "|---|---:|---:|---:|---:|---:|---:|"
  printf "| `Mutex` (FIFO) | %d | %s | %s | %s | %.1f%% | %.2f / %.2f / %.2f |\n", median("mutex_procs"), commas(median("mutex_per_second")),
    us(median("mutex_handoff_p50_ns")), us(median("mutex_handoff_p99_ns")), 100 * median("mutex_same_process_share"),
    median("mutex_per_evalsha"), median("mutex_per_subscribe"), median("mutex_per_unsubscribe")
  printf "| `Semaphore`, limit %d | %d | %s | – | – | – | %.2f / %.2f / %.2f |\n", median("sem_limit"), median("sem_procs"),
    commas(median("sem_per_second")), median("sem_per_evalsha"), median("sem_per_subscribe"), median("sem_per_unsubscribe")
  printf "\nSemaphore: at most %d holders seen at once (limit %d); token-order errors or failures: %d\n", median("sem_max_holders"),
    median("sem_limit"), errors
}
' "$out"/redis-uncontended-*.csv $py_files "$out"/redis-mutex-[0-9]*.json "$out"/redis-semaphore-[0-9]*.json \
  "$out"/redis-commands.json "$out"/redis-mutex-before-*.txt "$out"/redis-mutex-after-*.txt "$out"/redis-semaphore-after-*.txt
