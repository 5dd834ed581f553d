#!/bin/sh
# Runs every turnstile benchmark against its peer in the same run and prints a markdown table.
# Builds nothing: build first (the `bench` target builds, then runs this).
#
#   bench/run.sh <builddir> [--runs N] [--seconds S]
#   cmake --build <builddir> --target bench
#
# Needs <builddir>/bench/turnstile_bench_{uncontended,contention} and awk; the whole-process
# comparison also needs hyperfine, flock(1) and <builddir>/tools/turnstile/turnstile (or
# $TURNSTILE_CLI), and is skipped with a message when one is missing.
#
# Each comparison runs --runs times (default 3); every ratio is computed within one run (both
# sides measured back to back), and the tables show the median over the runs. The contention
# comparison runs each side for --seconds (default 2). Takes about a minute and a half.
# Raw results are kept in $TURNSTILE_BENCH_OUT (default: a fresh mktemp -d directory).
set -eu

usage() { echo "usage: $0 <builddir> [--runs N] [--seconds S]" >&2; exit 64; }
[ $# -ge 1 ] || usage
build=$(cd "$1" && pwd) || usage
shift
runs=3
seconds=2
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) runs=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    *) usage ;;
  esac
done

uncontended=$build/bench/turnstile_bench_uncontended
contention=$build/bench/turnstile_bench_contention
cli=${TURNSTILE_CLI:-$build/tools/turnstile/turnstile}
for binary in "$uncontended" "$contention"; do
  [ -x "$binary" ] || { echo "$0: $binary not found: build the bench targets first" >&2; exit 66; }
done

out=${TURNSTILE_BENCH_OUT:-$(mktemp -d /tmp/turnstile-bench-results-XXXXXX)}
mkdir -p "$out"
rm -f "$out"/uncontended-* "$out"/contention-* "$out"/cli-*
scratch=$(mktemp -d /tmp/turnstile-bench-scratch-XXXXXX)
trap 'rm -rf "$scratch"' EXIT INT TERM
echo "raw results: $out" >&2

i=1
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
cli_files=
[ -f "$out/cli-1.csv" ] && cli_files=$(i=1; while [ "$i" -le "$runs" ]; do printf '%s ' "$out/cli-$i.csv"; i=$((i + 1)); done)
# shellcheck disable=SC2086
awk -v runs="$runs" '
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
