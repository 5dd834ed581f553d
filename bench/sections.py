# SPDX-License-Identifier: Apache-2.0
"""The per-backend sections of bench/all.py: each starts its server, runs turnstile's loops
beside the peers' and the raw limit, then contention, growth, the async acquires and (file://,
etcd://) the CLI."""
import os
import subprocess
import sys
import tempfile

from all import (HERE, PYTHON, Server, async_section, contention, curator_contention, gbench_rate, growth, hyperfine,
                 rate_of, rounds)


def run_file(bench):
    program = bench.binary("turnstile_bench_uncontended")
    if program:
        one = lambda name: lambda: gbench_rate(bench, "file uncontended", [program, f"--benchmark_filter=^{name}(/|$)"]).get(name)
        rounds(bench, "file", {"turnstile Mutex": one("BM_Mutex"), "flock(2) pair (limit)": one("BM_FlockPair")},
               "flock(2) pair (limit)")
    else:
        bench.skip("file uncontended", "turnstile_bench_uncontended not built")
    contention(bench, "file", modes=("turnstile", "flock"))
    with tempfile.TemporaryDirectory(prefix="turnstile-growth-") as directory:
        growth(bench, "file", "file://" + directory)
    with tempfile.TemporaryDirectory(prefix="turnstile-async-") as directory:
        async_section(bench, "file", "file://" + directory)
    cli = os.path.join(bench.build, "tools", "turnstile", "turnstile")
    if not bench.wants("cli"):
        return
    with tempfile.TemporaryDirectory(prefix="turnstile-cli-") as directory:
        bench.results["cli"]["file"] = hyperfine(bench, "file CLI", {
            "turnstile run": f"{cli} run --backend file://{directory} --lock x -- true",
            "flock(1)": f"flock {directory}/x true"}, runs=100)


def number(bench, what, command):
    """The last word of command's output as a number (the C++ loops print pairs/s), or None."""
    try:
        return float(subprocess.run(command, capture_output=True, text=True, timeout=120).stdout.split()[-1])
    except (OSError, subprocess.TimeoutExpired, IndexError, ValueError) as error:
        bench.skip(what, str(error)[:200] or "no output")
        return None


def python_has(module):
    return subprocess.run([PYTHON, "-c", "import " + module], capture_output=True).returncode == 0


def python_peer(bench, loops, name, module, address):
    """Adds bench/peers/py_locks.py's loop for module (kazoo, consul) when /usr/bin/python3 has it."""
    if not python_has(module):
        return bench.skip(name, f"/usr/bin/python3 cannot import {module} (Debian: python3-{module})")
    command = [PYTHON, os.path.join(HERE, "peers", "py_locks.py"), module, address, str(bench.args.seconds)]
    loops[name] = lambda: rate_of(bench.run_json(name, command))


def run_redis(bench):
    program = bench.binary("turnstile_bench_redis_uncontended")
    if not program:
        return bench.skip("redis", "the redis backend or its benchmark is not built")
    with Server(bench, "redis") as server:
        one = lambda name: lambda: gbench_rate(bench, "redis uncontended", [program, "--url=" + server.url,
                                                                             f"--benchmark_filter=^{name}(/|$)"]).get(name)
        loops = {"turnstile Mutex": one("BM_RedisMutex"), "two PINGs (limit)": one("BM_RedisPingPair")}
        if python_has("redis"):
            loops["redis-py Lock"] = lambda: rate_of(bench.run_json(
                "redis-py Lock", [PYTHON, os.path.join(HERE, "redis_py_lock.py"), server.url, str(bench.args.seconds)]))
        else:
            bench.skip("redis-py Lock", "/usr/bin/python3 cannot import redis (python3-redis)")
        rounds(bench, "redis", loops, "two PINGs (limit)")
        contention(bench, "redis", server.url)
        growth(bench, "redis", server.url)
        async_section(bench, "redis", server.url)


def curator_command(bench):
    jars = [f"/usr/share/java/{j}.jar" for j in ("curator-recipes", "curator-framework", "curator-client", "zookeeper",
                                                 "zookeeper-jute", "guava", "slf4j-api", "slf4j-nop")]
    classes = os.path.join(bench.build, "bench", "java")
    source = os.path.join(HERE, "ZookeeperCuratorBench.java")
    target = os.path.join(classes, "ZookeeperCuratorBench.class")
    if not os.path.exists(target) or os.path.getmtime(source) > os.path.getmtime(target):
        os.makedirs(classes, exist_ok=True)
        if subprocess.run(["javac", "-d", classes, "-cp", ":".join(jars), source]).returncode != 0:
            return None
    return ["java", "-Xmx512m", "-cp", ":".join([classes] + jars), "ZookeeperCuratorBench"]


def run_zk(bench):
    program = bench.binary("turnstile_bench_zookeeper")
    if not program:
        return bench.skip("zk", "the zookeeper backend or its benchmark is not built")
    with Server(bench, "zookeeper") as server:
        with open(os.path.join(server.dir, "zookeeper.pid")) as f:
            env = {"TURNSTILE_ZK_SERVER_PID": f.read().strip()}
        seconds = str(bench.args.seconds)
        zk = lambda mode: lambda: rate_of(bench.run_json(f"zk {mode}", [program, "uncontended", mode, server.url, seconds],
                                                         env=env))
        subprocess.run([program, "uncontended", "raw", server.url, "5"], capture_output=True, env=dict(os.environ, **env))
        loops = {"turnstile Mutex": zk("turnstile"), "raw create+getChildren+delete (limit)": zk("raw")}
        java = curator_command(bench)
        if java:
            loops["Curator InterProcessMutex"] = lambda: rate_of(bench.run_json(
                "Curator", java + ["uncontended", server.address(), seconds]))
        else:
            bench.skip("Curator", "javac or the Curator jars are missing (libcurator-recipes-java)")
        python_peer(bench, loops, "kazoo Lock", "kazoo", server.address())
        rounds(bench, "zk", loops, "raw create+getChildren+delete (limit)")
        contention(bench, "zk", server.url)
        if java:
            curator_contention(bench, server.address(), java)
        growth(bench, "zk", server.url, holds=(1, 100, 1000))
        async_section(bench, "zk", server.url)


def go_etcd_mutex(bench):
    """Builds bench/peers/etcd_mutex offline from Debian's golang-etcd-server-dev (cached)."""
    out = os.path.join(bench.build, "bench", "peers", "etcd_mutex")
    source = os.path.join(HERE, "peers", "etcd_mutex", "main.go")
    if os.path.exists(out) and os.path.getmtime(out) > os.path.getmtime(source):
        return out
    env = dict(os.environ, GO111MODULE="off", GOPATH="/usr/share/gocode", GOFLAGS="-mod=mod",
               GOCACHE=os.path.join(bench.build, "bench", "peers", "go-cache"))
    print("  building the Go etcd peer (offline, GOPATH=/usr/share/gocode)", file=sys.stderr)
    try:
        done = subprocess.run(["go", "build", "-o", out, "."], cwd=os.path.dirname(source), env=env,
                              capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as error:
        bench.skip("Go concurrency.Mutex", f"go build: {error}")
        return None
    if done.returncode != 0:
        bench.skip("Go concurrency.Mutex", "go build failed (golang-go, golang-etcd-server-dev): "
                   + (done.stderr.strip().splitlines() or [""])[-1][:150])
        return None
    return out


def run_etcd(bench):
    program, raw = bench.binary("turnstile_bench_etcd"), bench.binary("turnstile_bench_etcd_raw")
    if not program or not raw:
        return bench.skip("etcd", "the etcd backend or its benchmarks are not built")
    go = go_etcd_mutex(bench)
    with Server(bench, "etcd") as server:
        seconds = str(bench.args.seconds)
        loops = {"turnstile Mutex": lambda: number(bench, "etcd turnstile", [program, server.url, seconds]),
                 "raw Txn + DeleteRange (limit)": lambda: number(bench, "etcd raw", [raw, server.url, seconds])}
        if go:
            loops["Go concurrency.Mutex"] = lambda: rate_of(bench.run_json("Go concurrency.Mutex",
                                                                           [go, server.address(), seconds]))
        rounds(bench, "etcd", loops, "raw Txn + DeleteRange (limit)")
        contention(bench, "etcd", server.url)
        growth(bench, "etcd", server.url, holds=(1, 100, 1000), waiters=(1, 10, 100))
        async_section(bench, "etcd", server.url)
        cli = os.path.join(bench.build, "tools", "turnstile", "turnstile")
        if not bench.wants("cli"):
            return
        bench.results["cli"]["etcd"] = hyperfine(bench, "etcd CLI", {
            "turnstile run": f"{cli} run --backend {server.url} --lock x -- true",
            "etcdctl lock": f"etcdctl --endpoints=http://{server.address()} lock x true"}, runs=30)


def run_consul(bench):
    program = bench.binary("turnstile_bench_consul")
    if not program:
        return bench.skip("consul", "the consul backend or its benchmark is not built")
    with Server(bench, "consul", env={"CONSUL_TEST_TOMBSTONE_TTL": "1s"}) as server:
        seconds = str(bench.args.seconds)
        count = lambda mode: lambda: number(bench, "consul " + mode, [program, mode, server.url, seconds])
        loops = {"turnstile Mutex": count("turnstile"), "raw PUT acquire + release (limit)": count("raw")}
        python_peer(bench, loops, "python-consul session acquire/release", "consul", server.address())
        rounds(bench, "consul", loops, "raw PUT acquire + release (limit)")
        contention(bench, "consul", server.url)
        growth(bench, "consul", server.url, holds=(1, 100, 300), waiters=(1, 10, 100))
        # 10,000 on the stand-in take ~25 min (each hand-off reads the whole queue): 1,000 here.
        async_section(bench, "consul", server.url, waiters=1000)
