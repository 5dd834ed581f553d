# SPDX-License-Identifier: Apache-2.0
"""`make bench`: every backend against its peers and limits in one run, then the page and plots.

    /usr/bin/python3 bench/all.py BUILDDIR [--seconds S] [--rounds N] [--only file,redis,zk,etcd,consul]
                                  [--sections uncontended,contention,growth,async,cli]
                                  [--results FILE] [--merge] [--render-only]

Starts its own throwaway servers (tests/servers/{redis,zookeeper,etcd,consul}.sh start DIR;
DIR/url; stop DIR), runs each section, keeps every figure in one JSON file (default
BUILDDIR/bench-results.json), then bench/report.py writes the generated part of
docs/benchmarks.md and the PNG plots in docs/bench/. Ratios are taken within one round (the
loops of a round run back to back, their order rotated from round to round), then the median.

Sections per backend: uncontended lock+unlock pairs/s against the peers and the raw round-trip
limit; 1, 2, 4, 8, 16, 32 processes contending for one Mutex (acquisitions/s; handoff latency
CDF at 8); growth (names held at once, waiters on one name); async acquires (co_await
lock_async() + unlock against the blocking pair, 10,000 async waiters on one name); CLI start-up against flock(1) and
`etcdctl lock` under hyperfine. A missing tool or a failing run is recorded as skipped, with the
reason, and the run goes on. --sections runs only those sections; with --merge their figures
replace those sections in an existing results file (the page then says which run measured them). Run it with /usr/bin/python3: Debian's python modules (redis,
kazoo, consul, matplotlib) import only there.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PYTHON = "/usr/bin/python3"
CONTENDERS = [1, 2, 4, 8, 16, 32]
CDF_AT = 8
HOLDS_BUDGET = 45  # seconds for taking the holds of one growth size: the run stays under 15 minutes


class Bench:
    """The run's state: the build, the options, the results and a scratch directory."""

    def __init__(self, build, args):
        self.build = build
        self.args = args
        self.scratch = tempfile.mkdtemp(prefix="turnstile-bench-all-")
        self.results = {"uncontended": {}, "contention": {}, "cdf": {}, "cli": {}, "growth": {}, "async": {},
                        "skipped": [], "machine": machine()}

    def binary(self, name):
        path = os.path.join(self.build, "bench", name)
        return path if os.access(path, os.X_OK) else None

    def wants(self, section):
        return section in self.args.sections.split(",")

    def skip(self, what, why):
        print(f"SKIPPED {what}: {why}", file=sys.stderr)
        self.results["skipped"].append(f"{what}: {why}")

    def run_json(self, what, command, timeout=120, env=None):
        """Runs command; its last stdout line as JSON, or None (recorded as skipped)."""
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                                  env=dict(os.environ, **(env or {})))
        except subprocess.TimeoutExpired:
            self.skip(what, f"no answer in {timeout} s")
            return None
        except OSError as error:
            self.skip(what, str(error))
            return None
        lines = done.stdout.strip().splitlines()
        try:
            value = json.loads(lines[-1]) if lines else None
        except ValueError:
            value = None
        if done.returncode != 0 or value is None:
            detail = (done.stderr.strip().splitlines() or ["exit status %d" % done.returncode])[-1]
            if isinstance(value, dict) and "error" in value:
                detail = value["error"]
            self.skip(what, detail[:200])
            return value if isinstance(value, dict) else None
        return value


def machine():
    return {"cpus": os.cpu_count(), "load_before": load(), "started_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def load():
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


class Server:
    """One throwaway server of tests/servers; a context manager."""

    def __init__(self, bench, kind, env=None):
        self.script = os.path.join(ROOT, "tests", "servers", kind + ".sh")
        self.dir = os.path.join(bench.scratch, kind)
        self.env = dict(os.environ, **(env or {}))
        self.url = None

    def __enter__(self):
        subprocess.run([self.script, "start", self.dir], check=True, stdout=subprocess.DEVNULL, env=self.env,
                       timeout=120)
        with open(os.path.join(self.dir, "url")) as f:
            self.url = f.read().strip()
        return self

    def __exit__(self, *exc):
        subprocess.run([self.script, "stop", self.dir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=60)
        return False

    def address(self):
        return self.url.split("://", 1)[1].split("/")[0].split("?")[0].split("@")[-1]


def rounds(bench, backend, loops, limit_name):
    """Runs each loop (name -> function returning pairs/s or None) once per round, order rotated;
    stores the per-round rates. limit_name: the raw round-trip loop, or None."""
    if not bench.wants("uncontended"):
        return
    names = list(loops)
    per_round = []
    for r in range(bench.args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        rates = {}
        for name in order:
            print(f"  {backend} uncontended, round {r + 1}: {name}", file=sys.stderr)
            rate = loops[name]()
            if rate:
                rates[name] = rate
        per_round.append(rates)
    bench.results["uncontended"][backend] = {"rounds": per_round, "order": names, "limit": limit_name}


def gbench_rate(bench, what, command):
    """pairs/s of each Google Benchmark in command's JSON output (1e9 / real ns per pair)."""
    try:
        done = subprocess.run(command + ["--benchmark_format=json", "--benchmark_min_time=0.5"], capture_output=True,
                              text=True, timeout=120)
        data = json.loads(done.stdout)
    except (subprocess.TimeoutExpired, ValueError, OSError) as error:
        bench.skip(what, str(error)[:200])
        return {}
    unit = {"ns": 1e9, "us": 1e6, "ms": 1e3, "s": 1.0}
    return {b["name"].split("/")[0]: unit[b.get("time_unit", "ns")] / b["real_time"] for b in data.get("benchmarks", [])
            if b.get("real_time")}


def rate_of(value):
    return value.get("per_second") if isinstance(value, dict) else None


def contention(bench, backend, url=None, modes=("turnstile",)):
    """Each mode at 1..32 contenders; handoff CDF at CDF_AT."""
    if not bench.wants("contention"):
        return
    program = bench.binary("turnstile_bench_contention")
    if not program:
        return bench.skip(f"{backend} contention", "turnstile_bench_contention not built")
    series = bench.results["contention"].setdefault(backend, {})
    for mode in modes:
        for procs in CONTENDERS:
            print(f"  {backend} contention: {mode}, {procs} processes", file=sys.stderr)
            command = [program, mode, "--procs", str(procs), "--seconds", str(bench.args.seconds)]
            command += ["--url", url] if url else []
            cdf = os.path.join(bench.scratch, f"cdf-{backend}-{mode}.json")
            command += ["--cdf", cdf] if procs == CDF_AT else []
            value = bench.run_json(f"{backend} contention {mode} x{procs}", command)
            if value:
                series.setdefault(mode, {})[str(procs)] = value
            if procs == CDF_AT and value and os.path.exists(cdf):
                with open(cdf) as f:
                    bench.results["cdf"].setdefault(backend, {})[mode] = json.load(f)


def curator_contention(bench, address, java):
    if not bench.wants("contention"):
        return
    series = bench.results["contention"].setdefault("zk", {})
    for procs in CONTENDERS:
        print(f"  zk contention: Curator, {procs} sessions", file=sys.stderr)
        value = bench.run_json(f"zk contention Curator x{procs}",
                               java + ["contention", address, str(procs), str(bench.args.seconds)])
        if value:
            series.setdefault("curator", {})[str(procs)] = value


def growth(bench, backend, url, holds=(1, 100, 1000, 10000), waiters=(1, 10, 100, 1000)):
    if not bench.wants("growth"):
        return
    program = bench.binary("turnstile_bench_growth")
    if not program:
        return bench.skip(f"{backend} growth", "turnstile_bench_growth not built")
    out = bench.results["growth"].setdefault(backend, {"holds": {}, "waiters": {}})
    for kind, sizes in (("holds", holds), ("waiters", waiters)):
        for n in sizes:
            print(f"  {backend} growth: {kind} {n}", file=sys.stderr)
            budget = [str(HOLDS_BUDGET)] if kind == "holds" else []
            value = bench.run_json(f"{backend} growth {kind} {n}", [program, kind, url, str(n)] + budget, timeout=180)
            if value:
                out[kind][str(n)] = value


def async_section(bench, backend, url, waiters=10000):
    """Uncontended `co_await lock_async()` + unlock against lock() + unlock() (the rounds run in one
    process, their order swapped each round), then `waiters` async acquires queued on one name."""
    if not bench.wants("async"):
        return
    program = bench.binary("turnstile_bench_async")
    if not program:
        return bench.skip(f"{backend} async", "turnstile_bench_async not built")
    out = bench.results["async"].setdefault(backend, {})
    print(f"  {backend} async: co_await lock_async() + unlock against lock() + unlock()", file=sys.stderr)
    timeout = 60 + 4 * bench.args.seconds * bench.args.rounds
    value = bench.run_json(f"{backend} async pairs", [program, "pairs", url, str(bench.args.seconds),
                                                      str(bench.args.rounds)], timeout=timeout)
    if value:
        out["pairs"] = value
    print(f"  {backend} async: {waiters} waiters on one name", file=sys.stderr)
    value = bench.run_json(f"{backend} async waiters {waiters}", [program, "waiters", url, str(waiters)], timeout=1200)
    if value:
        out["waiters"] = value


def hyperfine(bench, what, commands, runs):
    """{name: {median, mean, user+system}} of each command, or {} when hyperfine is missing."""
    if not shutil.which("hyperfine"):
        bench.skip(what, "hyperfine is not installed")
        return {}
    out = os.path.join(bench.scratch, "hyperfine.json")
    argv = ["hyperfine", "--style", "none", "--shell", "none", "--warmup", "5", "--runs", str(runs),
            "--export-json", out]
    for name, command in commands.items():
        argv += ["-n", name, command]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        bench.skip(what, (done.stderr.strip().splitlines() or ["failed"])[-1][:200])
        return {}
    with open(out) as f:
        data = json.load(f)["results"]
    return {r["command"]: {"median_ms": r["median"] * 1e3, "mean_ms": r["mean"] * 1e3,
                           "cpu_ms": (r["user"] + r["system"]) * 1e3} for r in data}


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def merged(results_file, new, sections):
    """The results in results_file with `sections` replaced by this run's; the run that measured
    them is kept beside them (machine_of[section]) for the page to say."""
    with open(results_file) as f:
        results = json.load(f)
    for section in sections:
        results[section] = new[section]
        results.setdefault("machine_of", {})[section] = new["machine"]
    results["skipped"] = results.get("skipped", []) + new["skipped"]
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("build")
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default="file,redis,zk,etcd,consul")
    parser.add_argument("--sections", default="uncontended,contention,growth,async,cli")
    parser.add_argument("--merge", action="store_true")
    parser.add_argument("--results")
    parser.add_argument("--render-only", action="store_true")
    args = parser.parse_args()
    build = os.path.abspath(args.build)
    results_file = args.results or os.path.join(build, "bench-results.json")
    if not args.render_only:
        import sections  # bench/sections.py: one function per backend

        bench = Bench(build, args)
        start = time.monotonic()
        try:
            for backend in args.only.split(","):
                print(f"== {backend}", file=sys.stderr)
                getattr(sections, "run_" + backend)(bench)
        finally:
            shutil.rmtree(bench.scratch, ignore_errors=True)
        bench.results["machine"].update(load_after=load(), seconds=round(time.monotonic() - start))
        results = merged(results_file, bench.results, args.sections.split(",")) if args.merge else bench.results
        with open(results_file, "w") as f:
            json.dump(results, f, indent=1)
        print(f"results: {results_file}", file=sys.stderr)
    import report  # bench/report.py: the page and the plots

    report.render(results_file, ROOT)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
