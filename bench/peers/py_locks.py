# SPDX-License-Identifier: Apache-2.0
"""Python peers of turnstile's uncontended lock+unlock, each acquire + release in a loop on one
connection for a fixed time, printing one JSON object (pairs per second):

    /usr/bin/python3 bench/peers/py_locks.py kazoo 127.0.0.1:PORT SECONDS
        kazoo's Lock recipe (python3-kazoo) on ZooKeeper: create ephemeral-sequential,
        getChildren, delete.
    /usr/bin/python3 bench/peers/py_locks.py consul 127.0.0.1:PORT SECONDS
        python3-consul: one session (TTL 15 s, lock-delay 0), then PUT ?acquire and
        PUT ?release on one key (api.Lock's two requests).

Debian's python modules import only under /usr/bin/python3; bench/all.py runs it so.
"""
import json
import sys
import time


def kazoo_pair(address):
    from kazoo.client import KazooClient

    client = KazooClient(hosts=address)
    client.start(timeout=15)
    lock = client.Lock("/bench/kazoo-lock", "bench")

    def pair():
        lock.acquire()
        lock.release()

    return pair, client.stop


def consul_pair(address):
    import consul

    host, port = address.rsplit(":", 1)
    client = consul.Consul(host=host, port=int(port))
    session = client.session.create(ttl=15, lock_delay=0, behavior="delete")
    key = "bench/python-consul-lock"

    def pair():
        if not client.kv.put(key, "", acquire=session) or not client.kv.put(key, "", release=session):
            raise RuntimeError("refused")

    return pair, lambda: client.session.destroy(session)


def main():
    peer, address, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    pair, close = {"kazoo": kazoo_pair, "consul": consul_pair}[peer](address)
    for _ in range(100):  # warm up
        pair()
    pairs = 0
    start = time.perf_counter()
    now = start
    while now < start + seconds:
        for _ in range(20):
            pair()
        pairs += 20
        now = time.perf_counter()
    close()
    print(json.dumps({"mode": peer, "pairs": pairs, "seconds": round(now - start, 3),
                      "per_second": round(pairs / (now - start), 1)}))


if __name__ == "__main__":
    main()
