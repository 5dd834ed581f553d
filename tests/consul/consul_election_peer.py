#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""A leader-election candidate as Consul's leader-election guide describes it, written with
Debian's python3-consul (0.7.1), driven through stdin like tests/zookeeper/CuratorPeer.java.

    python3 consul_election_peer.py HOST PORT
prints "ready", then one answer line per command line:

    campaign KEY VALUE MS [FLAGS]  -> leader | timeout
        PUT KEY?acquire=<session> (flags only when given: the guide's curl and python-consul
        send none, so Flags is 0; api.Lock's LockFlagValue to take part as api.Lock does),
        else a blocking GET on KEY while it has a Session, then acquire again.
    leader KEY          -> leader <value> | none   (a Session on KEY means a leader)
    lockindex KEY       -> <LockIndex> <Session or ->
    proclaim KEY VALUE [FLAGS] -> true | false     (acquire again with the same session)
    resign KEY          -> true | false            (PUT ?release=<session>)
    kill-session        -> destroyed               (its locks released, lock-delay begins)
    quit

Values are one word each (no spaces). The session: TTL 10 s, renewed every 5 s, behavior
release, lock-delay 1 s.
"""
import sys
import threading
import time

import consul


def main():
    client = consul.Consul(host=sys.argv[1], port=int(sys.argv[2]))
    state = {"sid": None}
    lock = threading.Lock()

    def session():
        with lock:
            if state["sid"] is None:
                state["sid"] = client.session.create(name="peer", ttl=10, behavior="release", lock_delay=1)
            return state["sid"]

    def renew():
        while True:
            time.sleep(5)
            with lock:
                sid = state["sid"]
            if sid:
                try:
                    client.session.renew(sid)
                except Exception:  # destroyed on purpose (kill-session), or the server is gone
                    pass

    threading.Thread(target=renew, daemon=True).start()

    def held_by(key):
        _, data = client.kv.get(key)
        return data if data and data.get("Session") else None

    def campaign(key, value, ms, flags):
        deadline = time.monotonic() + ms / 1000.0
        while True:
            if client.kv.put(key, value, acquire=session(), flags=flags):
                return "leader"
            index, data = client.kv.get(key)
            while data and data.get("Session") and time.monotonic() < deadline:
                index, data = client.kv.get(key, index=index, wait="1s")
            if time.monotonic() >= deadline:
                return "timeout"
            time.sleep(0.1)  # free but refused: a lock-delay (the guide: try again later)

    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        command, args = words[0], words[1:]
        if command == "quit":
            break
        if command == "campaign":
            flags = int(args[3]) if len(args) > 3 else None
            answer = campaign(args[0], args[1], int(args[2]), flags)
        elif command == "leader":
            data = held_by(args[0])
            answer = "leader " + data["Value"].decode() if data else "none"
        elif command == "lockindex":
            _, data = client.kv.get(args[0])
            answer = "%d %s" % (data["LockIndex"], data.get("Session") or "-") if data else "absent"
        elif command == "proclaim":
            flags = int(args[2]) if len(args) > 2 else None
            answer = str(client.kv.put(args[0], args[1], acquire=session(), flags=flags)).lower()
        elif command == "resign":
            answer = str(client.kv.put(args[0], "", release=session())).lower()
        elif command == "kill-session":
            with lock:
                sid, state["sid"] = state["sid"], None
            if sid:
                client.session.destroy(sid)
            answer = "destroyed"
        else:
            answer = "unknown command " + command
        print(answer, flush=True)


if __name__ == "__main__":
    main()
