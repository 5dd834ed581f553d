# SPDX-License-Identifier: Apache-2.0
"""The peer of turnstile's uncontended redis:// Mutex: redis-py's redis.lock.Lock, acquire +
release in a loop on one connection, for a fixed time. Prints one JSON object: pairs per
second, and the server commands per pair from the INFO commandstats delta (every call the
server made, the redis.call()s inside Lua included, our two INFO calls excluded; and EVALSHA
alone), the same measure turnstile_bench_redis_uncontended reports.

    /usr/bin/python3 bench/redis_py_lock.py redis://HOST:PORT [SECONDS]

Run it with Debian's /usr/bin/python3, which has python3-redis; bench/run.sh --redis does.
"""
import json
import sys
import time

import redis


def command_calls(client):
    return {name: stats["calls"] for name, stats in client.info("commandstats").items()}


def main():
    url = sys.argv[1]
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 2.0
    client = redis.Redis.from_url(url)
    lock = client.lock("bench/redis-py-lock", timeout=30)  # expires like turnstile's 30 s TTL
    for _ in range(200):  # warm up: the first release loads its script
        lock.acquire()
        lock.release()
    stats = redis.Redis.from_url(url)
    before = command_calls(stats)
    pairs = 0
    start = time.perf_counter()
    end = start + seconds
    now = start
    while now < end:
        for _ in range(100):
            lock.acquire()
            lock.release()
        pairs += 100
        now = time.perf_counter()
    elapsed = now - start
    after = command_calls(stats)
    total = sum(calls - before.get(name, 0) for name, calls in after.items() if not name.startswith("cmdstat_info"))
    evalsha = after.get("cmdstat_evalsha", 0) - before.get("cmdstat_evalsha", 0)
    print(json.dumps({
        "mode": "redis-py",
        "redis_py_version": redis.__version__,
        "pairs": pairs,
        "seconds": round(elapsed, 3),
        "per_second": round(pairs / elapsed, 1),
        "ns_per_pair": round(elapsed / pairs * 1e9),
        "commands_per_pair": round(total / pairs, 3),
        "evalsha_per_pair": round(evalsha / pairs, 3),
    }, separators=(",", ":")))


if __name__ == "__main__":
    main()
