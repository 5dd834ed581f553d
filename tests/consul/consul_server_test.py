#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Checks the Consul HTTP API test stand-in (tests/servers/consul_server.py) with a Consul client
nobody here wrote: Debian's python3-consul (python-consul 0.7), plus requests for what it does
not cover (headers, txn). Run with /usr/bin/python3 (Debian's python3-consul lives there).

  consul_server_test.py [unittest arguments]      e.g. ConsulServerTest, SessionTtlTest

The server under test: the URL in the file named by TURNSTILE_CONSUL_URL_FILE (the CTest
fixture's), else one started here with tests/servers/consul.sh. ACL, restart and pause tests
start their own servers with consul.sh in a temporary directory.
"""

import base64
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import unittest
import uuid

import consul
import requests

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "servers", "consul.sh")
LOCK_FLAG_VALUE = 0x2ddccbc058a50c18       # api/lock.go LockFlagValue
SEMAPHORE_FLAG_VALUE = 0xe0f69a2baa414de0  # api/semaphore.go SemaphoreFlagValue

_own_dir = None


def start_server(directory, token=None, tokens=None):
    env = dict(os.environ)
    env.pop("CONSUL_TEST_ACL_TOKEN", None)
    env.pop("CONSUL_TEST_ACL_TOKENS", None)
    if token:
        env["CONSUL_TEST_ACL_TOKEN"] = token
    if tokens:
        env["CONSUL_TEST_ACL_TOKENS"] = json.dumps(tokens)
    subprocess.run([SCRIPT, "start", directory], check=True, env=env, stdout=subprocess.DEVNULL)
    with open(os.path.join(directory, "url")) as f:
        url = f.read().strip()
    return int(url.rsplit(":", 1)[1])


def setUpModule():
    global PORT, _own_dir
    url_file = os.environ.get("TURNSTILE_CONSUL_URL_FILE")
    if url_file:
        with open(url_file) as f:
            PORT = int(f.read().strip().rsplit(":", 1)[1])
    else:
        _own_dir = tempfile.mkdtemp(prefix="consul-test-")
        PORT = start_server(_own_dir)


def tearDownModule():
    if _own_dir:
        subprocess.run([SCRIPT, "stop", _own_dir], check=False)
        shutil.rmtree(_own_dir, ignore_errors=True)


def unique(name):
    return "turnstile-test/%s/%s" % (name, uuid.uuid4().hex[:12])


class Base(unittest.TestCase):
    def setUp(self):
        self.c = consul.Consul(host="127.0.0.1", port=PORT)
        self.base = "http://127.0.0.1:%d" % PORT
        self.sessions = []

    def tearDown(self):
        for sid in self.sessions:
            self.c.session.destroy(sid)

    def session(self, **kw):
        sid = self.c.session.create(**kw)
        self.sessions.append(sid)
        return sid


class ConsulServerTest(Base):
    def test_kv_put_get_and_missing_key(self):
        key = unique("kv")
        index, data = self.c.kv.get(key)
        self.assertIsNone(data)
        self.assertGreaterEqual(int(index), 1, "a 404 carries X-Consul-Index, never 0")
        self.assertTrue(self.c.kv.put(key, b"hello", flags=7))
        index, data = self.c.kv.get(key)
        self.assertEqual(data["Value"], b"hello")
        self.assertEqual(data["Flags"], 7)
        self.assertEqual(data["LockIndex"], 0)
        self.assertEqual(data["CreateIndex"], data["ModifyIndex"])
        self.assertEqual(int(index), data["ModifyIndex"], "one key: the index is its ModifyIndex")
        self.assertNotIn("Session", data)
        # A PUT without ?flags writes Flags 0 (the HTTP handler's default).
        self.assertTrue(self.c.kv.put(key, b"again"))
        _, data2 = self.c.kv.get(key)
        self.assertEqual(data2["Flags"], 0)
        self.assertGreater(data2["ModifyIndex"], data["ModifyIndex"])
        self.assertEqual(data2["CreateIndex"], data["CreateIndex"])
        # Writing what is stored changes nothing, not even the index.
        self.assertTrue(self.c.kv.put(key, b"again"))
        _, data3 = self.c.kv.get(key)
        self.assertEqual(data3["ModifyIndex"], data2["ModifyIndex"])
        raw = requests.get("%s/v1/kv/%s?raw" % (self.base, key))
        self.assertEqual(raw.content, b"again")
        self.assertEqual(raw.headers["Content-Type"], "text/plain")

    def test_kv_cas(self):
        key = unique("cas")
        self.assertTrue(self.c.kv.put(key, b"1", cas=0), "cas=0 creates an absent key")
        self.assertFalse(self.c.kv.put(key, b"2", cas=0), "cas=0 refuses an existing key")
        _, data = self.c.kv.get(key)
        self.assertEqual(data["Value"], b"1")
        self.assertFalse(self.c.kv.put(key, b"3", cas=data["ModifyIndex"] - 1))
        self.assertTrue(self.c.kv.put(key, b"4", cas=data["ModifyIndex"]))
        _, after = self.c.kv.get(key)
        self.assertEqual(after["Value"], b"4")
        self.assertGreater(after["ModifyIndex"], data["ModifyIndex"])
        self.assertFalse(self.c.kv.put(key, b"5", cas=data["ModifyIndex"]), "a stale CAS fails")
        self.assertFalse(self.c.kv.delete(key, cas=data["ModifyIndex"]))
        self.assertTrue(self.c.kv.delete(key, cas=after["ModifyIndex"]))
        self.assertIsNone(self.c.kv.get(key)[1])
        self.assertTrue(self.c.kv.delete(key, cas=after["ModifyIndex"]),
                        "a CAS delete of a missing key answers true (kvsDeleteCASTxn)")
        self.assertFalse(self.c.kv.put(key, b"6", cas=after["ModifyIndex"]),
                         "a CAS with an index on a missing key fails")

    def test_a_write_that_changes_nothing_keeps_the_modify_index(self):
        # kvsSetTxn: an entry equal to the stored one is not written (a CAS too).
        key = unique("same")
        self.assertTrue(self.c.kv.put(key, b"v"))
        index = self.c.kv.get(key)[1]["ModifyIndex"]
        self.assertTrue(self.c.kv.put(key, b"v", cas=index))
        self.assertEqual(self.c.kv.get(key)[1]["ModifyIndex"], index)
        self.assertTrue(self.c.kv.put(key, b"w", cas=index))
        self.assertGreater(self.c.kv.get(key)[1]["ModifyIndex"], index)

    def test_recurse_keys_and_delete_tree(self):
        prefix = unique("tree") + "/"
        for k in ("a", "b/c", "b/d"):
            self.assertTrue(self.c.kv.put(prefix + k, k.encode()))
        index, entries = self.c.kv.get(prefix, recurse=True)
        self.assertEqual([e["Key"] for e in entries], [prefix + "a", prefix + "b/c", prefix + "b/d"])
        self.assertEqual(int(index), max(e["ModifyIndex"] for e in entries))
        _, keys = self.c.kv.get(prefix, keys=True, separator="/")
        self.assertEqual(keys, [prefix + "a", prefix + "b/"])
        self.assertTrue(self.c.kv.delete(prefix, recurse=True))
        index2, entries = self.c.kv.get(prefix, recurse=True)
        self.assertIsNone(entries)
        self.assertGreater(int(index2), int(index), "the tombstone keeps the index from going back")

    def test_acquire_release_and_lock_index(self):
        key = unique("lock")
        s1 = self.session(name="one", ttl=30)
        s2 = self.session(name="two", ttl=30)
        self.assertTrue(self.c.kv.put(key, b"v1", acquire=s1, flags=LOCK_FLAG_VALUE))
        _, data = self.c.kv.get(key)
        self.assertEqual(data["Session"], s1)
        self.assertEqual(data["LockIndex"], 1)
        self.assertEqual(data["Flags"], LOCK_FLAG_VALUE)
        self.assertFalse(self.c.kv.put(key, b"v2", acquire=s2), "held by another session")
        self.assertTrue(self.c.kv.put(key, b"v3", acquire=s1, flags=LOCK_FLAG_VALUE),
                        "the holder may acquire again")
        _, data = self.c.kv.get(key)
        self.assertEqual((data["LockIndex"], data["Value"]), (1, b"v3"),
                         "a re-acquire by the holder keeps LockIndex and writes the value")
        self.assertFalse(self.c.kv.put(key, None, release=s2), "not the holder")
        self.assertTrue(self.c.kv.put(key, None, release=s1, flags=LOCK_FLAG_VALUE))
        _, data = self.c.kv.get(key)
        self.assertNotIn("Session", data)
        self.assertIsNone(data["Value"], "a release writes the request's (empty) value")
        self.assertFalse(self.c.kv.put(key, None, release=s1), "not held any more")
        self.assertTrue(self.c.kv.put(key, b"x", acquire=s2))
        _, data = self.c.kv.get(key)
        self.assertEqual((data["Session"], data["LockIndex"]), (s2, 2))
        bogus = str(uuid.uuid4())
        with self.assertRaises(consul.ConsulException):
            self.c.kv.put(unique("lock"), b"", acquire=bogus)   # 500 invalid session

    def test_blocking_query_returns_on_change(self):
        key = unique("block")
        self.c.kv.put(key, b"1")
        index, _ = self.c.kv.get(key)

        def later():
            time.sleep(0.5)
            self.c.kv.put(key, b"2")
        threading.Thread(target=later).start()
        start = time.monotonic()
        index2, data = self.c.kv.get(key, index=index, wait="10s")
        elapsed = time.monotonic() - start
        self.assertGreater(int(index2), int(index))
        self.assertEqual(data["Value"], b"2")
        self.assertGreater(elapsed, 0.4)
        self.assertLess(elapsed, 5.0)

    def test_blocking_query_on_prefix_and_sessions(self):
        prefix = unique("blockp") + "/"
        index, _ = self.c.kv.get(prefix, recurse=True)
        threading.Timer(0.3, lambda: self.c.kv.put(prefix + "x", b"")).start()
        start = time.monotonic()
        index2, entries = self.c.kv.get(prefix, recurse=True, index=index, wait="10s")
        self.assertLess(time.monotonic() - start, 5.0)
        self.assertEqual([e["Key"] for e in entries], [prefix + "x"])
        self.assertGreater(int(index2), int(index))
        sindex, _ = self.c.session.list()
        holder = []
        threading.Timer(0.3, lambda: holder.append(self.session(name="late"))).start()
        start = time.monotonic()
        sindex2, sessions = self.c.session.list(index=sindex, wait="10s")
        self.assertLess(time.monotonic() - start, 5.0)
        self.assertGreater(int(sindex2), int(sindex))
        self.assertIn("late", [s["Name"] for s in sessions])

    def test_blocking_query_times_out_with_the_same_index(self):
        key = unique("timeout")
        other = unique("other")
        self.c.kv.put(key, b"1")
        index, _ = self.c.kv.get(key)
        # A write to another key does not wake a query on this one.
        threading.Timer(0.2, lambda: self.c.kv.put(other, b"x")).start()
        start = time.monotonic()
        index2, data = self.c.kv.get(key, index=index, wait="1s")
        elapsed = time.monotonic() - start
        self.assertEqual(index2, index)
        self.assertEqual(data["Value"], b"1")
        self.assertGreaterEqual(elapsed, 0.95)
        # Wait plus at most wait/16 of jitter; the bound is loose because a loaded machine may
        # delay the answer (it only has to show the query ended at its wait, not hung).
        self.assertLess(elapsed, 5.0)
        # An index ahead of the server's blocks too, and answers the real (lower) index: the
        # client must reset, as Consul's documentation says.
        start = time.monotonic()
        index3, _ = self.c.kv.get(key, index=int(index) + 1000, wait="1s")
        self.assertGreaterEqual(time.monotonic() - start, 0.95)
        self.assertEqual(index3, index)

    def test_lock_delay_refuses_reacquire(self):
        key = unique("delay")
        holder = self.session(name="holder", lock_delay=1)
        self.assertTrue(self.c.kv.put(key, b"", acquire=holder))
        self.c.session.destroy(holder)
        _, data = self.c.kv.get(key)
        self.assertNotIn("Session", data, "Behavior release: the key stays, unlocked")
        other = self.session(name="other")
        self.assertFalse(self.c.kv.put(key, b"", acquire=other), "lock-delay in force")
        time.sleep(1.2)
        self.assertTrue(self.c.kv.put(key, b"", acquire=other), "lock-delay over")
        # LockDelay 0 disables it; an explicit ?release never starts one.
        key2 = unique("nodelay")
        quick = self.session(name="quick", lock_delay=0)
        self.assertTrue(self.c.kv.put(key2, b"", acquire=quick))
        self.c.session.destroy(quick)
        self.assertTrue(self.c.kv.put(key2, b"", acquire=other))
        self.assertTrue(self.c.kv.put(key2, None, release=other))
        third = self.session(name="third")
        self.assertTrue(self.c.kv.put(key2, b"", acquire=third))

    def test_session_create_validation_info_renew(self):
        # Consul's Session.Apply answers a TTL outside 10s..86400s with an RPC error: 500.
        for ttl in ("5s", "90000s"):
            r = requests.put("%s/v1/session/create" % self.base, json={"TTL": ttl})
            self.assertEqual(r.status_code, 500, ttl)
            self.assertIn("Invalid Session TTL", r.text)
        # Keys are matched case-insensitively (Go's encoding/json), as python-consul sends them.
        r = requests.put("%s/v1/session/create" % self.base, json={"ttl": "10s", "name": "lower"})
        self.assertEqual(r.status_code, 200)
        lower = r.json()["ID"]
        self.sessions.append(lower)
        self.assertEqual(self.c.session.info(lower)[1]["TTL"], "10s")
        r = requests.put("%s/v1/session/create" % self.base, json={"Behavior": "explode"})
        self.assertEqual(r.status_code, 500)
        sid = self.session(name="info", behavior="delete", ttl=15, lock_delay=3)
        index, info = self.c.session.info(sid)
        self.assertEqual(info["ID"], sid)
        self.assertEqual(info["Behavior"], "delete")
        self.assertEqual(info["TTL"], "15s")
        self.assertEqual(info["LockDelay"], 3 * 10**9)
        self.assertGreaterEqual(int(index), info["CreateIndex"])
        renewed = self.c.session.renew(sid)
        self.assertEqual(renewed["ID"], sid)
        self.c.session.destroy(sid)
        self.assertIsNone(self.c.session.info(sid)[1])
        with self.assertRaises(consul.NotFound):
            self.c.session.renew(sid)
        r = requests.put("%s/v1/session/renew/%s" % (self.base, sid))
        self.assertEqual((r.status_code, r.text), (404, "Session id '%s' not found" % sid))

    def test_semaphore_layout_by_hand(self):
        # What api.Semaphore writes: a contender key acquired by a Behavior=delete session and a
        # .lock key changed by CAS; the stand-in must keep flags and values byte for byte.
        prefix = unique("sem")
        sid = self.session(name="Consul API Semaphore", behavior="delete", ttl=15)
        self.assertTrue(self.c.kv.put("%s/%s" % (prefix, sid), None, acquire=sid,
                                      flags=SEMAPHORE_FLAG_VALUE))
        body = ('{"Limit":2,"Holders":{"%s":true}}' % sid).encode()
        self.assertTrue(self.c.kv.put(prefix + "/.lock", body, cas=0, flags=SEMAPHORE_FLAG_VALUE))
        _, entries = self.c.kv.get(prefix, recurse=True)
        by_key = {e["Key"]: e for e in entries}
        self.assertEqual(by_key[prefix + "/.lock"]["Value"], body)
        self.assertEqual(by_key[prefix + "/.lock"]["Flags"], SEMAPHORE_FLAG_VALUE)
        self.assertEqual(by_key["%s/%s" % (prefix, sid)]["Session"], sid)
        self.c.session.destroy(sid)
        _, entries = self.c.kv.get(prefix, recurse=True)
        self.assertEqual([e["Key"] for e in entries], [prefix + "/.lock"],
                         "Behavior delete: the contender key went with its session")

    def test_txn(self):
        key = unique("txn")
        sid = self.session(name="txn")
        value = base64.b64encode(b"v").decode()
        ops = [{"KV": {"Verb": "check-not-exists", "Key": key}},
               {"KV": {"Verb": "lock", "Key": key, "Value": value, "Session": sid,
                       "Flags": LOCK_FLAG_VALUE}},
               {"KV": {"Verb": "get", "Key": key}}]
        r = requests.put("%s/v1/txn" % self.base, json=ops)
        self.assertEqual(r.status_code, 200, r.text)
        results = r.json()["Results"]
        self.assertIsNone(r.json()["Errors"])
        self.assertIsNone(results[0]["KV"]["Value"], "write results carry no value")
        self.assertEqual(results[1]["KV"]["Value"], value)
        self.assertEqual(results[1]["KV"]["Session"], sid)
        modify = results[1]["KV"]["ModifyIndex"]
        bad = [{"KV": {"Verb": "set", "Key": key + "-other", "Value": value}},
               {"KV": {"Verb": "check-index", "Key": key, "Index": modify + 1}}]
        r = requests.put("%s/v1/txn" % self.base, json=bad)
        self.assertEqual(r.status_code, 409)
        self.assertEqual(r.json()["Errors"][0]["OpIndex"], 1)
        self.assertIsNone(self.c.kv.get(key + "-other")[1], "a failed transaction writes nothing")

    def test_kv_keys_are_checked_and_txn_keys_are_not(self):
        # agent/kvs_endpoint.go validateKVKey: other bytes, a file-like ending.
        for key in (unique("pct") + "%25", unique("x") + ".json"):
            r = requests.put("%s/v1/kv/%s" % (self.base, key), data=b"v")
            self.assertEqual(r.status_code, 400, key)
        # Consul 1.21.5 (PR #22682) refused ".." anywhere in a key: 500 "invalid key name".
        for key in (unique("dots") + "..x", unique("dots") + "/..x", unique("dots") + "/a..b"):
            r = requests.put("%s/v1/kv/%s" % (self.base, key), data=b"v")
            self.assertEqual(r.status_code, 500, key)
            self.assertIn("invalid key name", r.text)
        for key in (unique("dots") + ".x./y", unique("dots") + "/.x", unique("dots") + "/x."):
            r = requests.put("%s/v1/kv/%s" % (self.base, key), data=b"v")
            self.assertEqual(r.status_code, 200, key)
        # agent/txn_endpoint.go checks no key: the same key is written by a transaction.
        key = unique("dots") + ".."
        value = base64.b64encode(b"v").decode()
        r = requests.put("%s/v1/txn" % self.base, json=[{"KV": {"Verb": "set", "Key": key, "Value": value}}])
        self.assertEqual(r.status_code, 200, r.text)

    def test_headers_status_and_agent_self(self):
        r = requests.get("%s/v1/kv/%s" % (self.base, unique("hdr")))
        self.assertEqual(r.status_code, 404)
        self.assertEqual(r.headers["X-Consul-KnownLeader"], "true")
        self.assertIn("X-Consul-LastContact", r.headers)
        self.assertTrue(self.c.status.leader())
        self.assertTrue(self.c.agent.self()["Config"]["NodeName"])
        r = requests.get("%s/v1/kv/x?dc=elsewhere" % self.base)
        self.assertEqual(r.status_code, 500)


class AclTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="consul-acl-")
        self.port = start_server(self.dir, token="s3cret-management", tokens={
            "app-token": {"key_prefix": {"": "read", "app/": "write", "app/ro/": "read"},
                          "key": {"app/ro/open": "write"}, "session_prefix": {"": "write"}},
            "no-sessions": {"key_prefix": {"app/": "write"}}})
        self.base = "http://127.0.0.1:%d" % self.port

    def tearDown(self):
        subprocess.run([SCRIPT, "stop", self.dir], check=False)
        shutil.rmtree(self.dir, ignore_errors=True)

    def test_acl_403(self):
        anonymous = consul.Consul(host="127.0.0.1", port=self.port)
        with self.assertRaises(consul.ACLPermissionDenied):
            anonymous.kv.put("k", b"v")
        with self.assertRaises(consul.ACLPermissionDenied):
            anonymous.kv.get("k")
        r = requests.put("%s/v1/session/create" % self.base)
        self.assertEqual((r.status_code, r.text), (403, "Permission denied"))
        wrong = consul.Consul(host="127.0.0.1", port=self.port, token="wrong")
        with self.assertRaises(consul.ACLPermissionDenied):
            wrong.kv.get("k")
        right = consul.Consul(host="127.0.0.1", port=self.port, token="s3cret-management")
        self.assertTrue(right.kv.put("k", b"v"))
        self.assertEqual(right.kv.get("k")[1]["Value"], b"v")
        r = requests.put("%s/v1/session/create" % self.base,
                         headers={"X-Consul-Token": "s3cret-management"})
        self.assertEqual(r.status_code, 200)
        self.assertEqual(requests.get("%s/v1/status/leader" % self.base).status_code, 200)
        with open(os.path.join(self.dir, "url")) as f:
            self.assertTrue(f.read().startswith("consul://s3cret-management@127.0.0.1:"))


    def put(self, path, token, **kw):
        return requests.put("%s%s" % (self.base, path), headers={"X-Consul-Token": token}, **kw)

    def test_key_rules_longest_prefix_wins_and_kv_writes_answer_403(self):
        for key, status in (("app/x", 200), ("app/ro/x", 403), ("app/ro/open", 200), ("other", 403)):
            r = self.put("/v1/kv/" + key, "app-token", data=b"v")
            self.assertEqual((key, r.status_code), (key, status), r.text)
            if status == 403:
                self.assertEqual(r.text, "Permission denied")
        r = requests.get("%s/v1/kv/app/x" % self.base, headers={"X-Consul-Token": "no-sessions"})
        self.assertEqual(r.status_code, 200)
        r = requests.get("%s/v1/kv/other" % self.base, headers={"X-Consul-Token": "no-sessions"})
        self.assertEqual((r.status_code, r.text), (403, "Permission denied"))
        r = requests.get("%s/v1/kv/other?index=100000&wait=5s" % self.base,
                         headers={"X-Consul-Token": "no-sessions"}, timeout=2)
        self.assertEqual(r.status_code, 403, "a blocking read is refused at once")
        # A recursive delete needs write on the prefix and on every rule below it.
        r = requests.delete("%s/v1/kv/app/?recurse" % self.base, headers={"X-Consul-Token": "app-token"})
        self.assertEqual(r.status_code, 403)

    def test_txn_denials_are_409_per_op_and_apply_nothing(self):
        value = base64.b64encode(b"v").decode()
        ops = [{"KV": {"Verb": "set", "Key": "app/a", "Value": value}},
               {"KV": {"Verb": "set", "Key": "elsewhere/b", "Value": value}},
               {"KV": {"Verb": "check-not-exists", "Key": "app/ro/c"}},
               {"KV": {"Verb": "get-tree", "Key": "a"}}]
        r = self.put("/v1/txn", "app-token", json=ops)
        self.assertEqual(r.status_code, 409, r.text)
        self.assertEqual(r.json()["Errors"], [{"OpIndex": 1, "What": "Permission denied"},
                                              {"OpIndex": 2, "What": "Permission denied"}])
        r = requests.get("%s/v1/kv/app/a" % self.base, headers={"X-Consul-Token": "s3cret-management"})
        self.assertEqual(r.status_code, 404, "a refused transaction writes nothing")
        self.put("/v1/kv/app-hidden", "s3cret-management", data=b"h")
        r = self.put("/v1/txn", "no-sessions", json=[ops[0], ops[3]])
        self.assertEqual(r.status_code, 200, r.text)
        self.assertEqual([x["KV"]["Key"] for x in r.json()["Results"]], ["app/a", "app/a"],
                         "get results the token may not read are filtered out")
        # kvsPreApply treats KVGet, KVGetTree and KVGetOrEmpty alike: never refused, filtered.
        reads = [{"KV": {"Verb": "get-or-empty", "Key": "app-hidden"}},
                 {"KV": {"Verb": "get-or-empty", "Key": "app/a"}},
                 {"KV": {"Verb": "get-or-empty", "Key": "app/none"}}]
        r = self.put("/v1/txn", "no-sessions", json=reads)
        self.assertEqual(r.status_code, 200, r.text)
        self.assertEqual([x["KV"]["Key"] for x in r.json()["Results"]], ["app/a", "app/none"],
                         "get-or-empty needs no write, and what may not be read is filtered out")

    def test_sessions_need_session_write(self):
        r = self.put("/v1/session/create", "no-sessions")
        self.assertEqual((r.status_code, r.text), (403, "Permission denied"))
        sid = self.put("/v1/session/create", "app-token").json()["ID"]
        self.assertEqual(self.put("/v1/session/renew/" + sid, "no-sessions").status_code, 403)
        self.assertEqual(self.put("/v1/session/destroy/" + sid, "no-sessions").status_code, 403)
        self.assertEqual(self.put("/v1/session/renew/" + sid, "app-token").status_code, 200)
        self.assertEqual(self.put("/v1/session/destroy/" + sid, "app-token").status_code, 200)
        r = self.put("/v1/session/destroy/" + sid, "app-token")
        self.assertEqual(r.status_code, 500)
        self.assertIn("Unknown session", r.text)


class RestartPauseTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="consul-restart-")
        self.port = start_server(self.dir)
        self.c = consul.Consul(host="127.0.0.1", port=self.port)

    def tearDown(self):
        subprocess.run([SCRIPT, "stop", self.dir], check=False)
        shutil.rmtree(self.dir, ignore_errors=True)

    def test_restart_keeps_state_and_pause_stops_answers(self):
        sid = self.c.session.create(name="survivor", ttl=30)
        self.assertTrue(self.c.kv.put("held", b"v", acquire=sid))
        index, _ = self.c.kv.get("held")
        subprocess.run([SCRIPT, "restart", self.dir], check=True)
        self.c = consul.Consul(host="127.0.0.1", port=self.port)
        index2, data = self.c.kv.get("held")
        self.assertEqual((data["Value"], data["Session"]), (b"v", sid))
        self.assertEqual(index2, index)
        self.assertEqual(self.c.session.info(sid)[1]["ID"], sid)
        self.assertTrue(self.c.kv.put("after", b""))
        self.assertGreater(self.c.kv.get("after")[1]["ModifyIndex"], int(index) + 1,
                           "the index moves on past the restart")
        subprocess.run([SCRIPT, "pause", self.dir], check=True)
        try:
            with self.assertRaises(requests.exceptions.Timeout):
                requests.get("http://127.0.0.1:%d/v1/kv/held" % self.port, timeout=0.5)
        finally:
            subprocess.run([SCRIPT, "resume", self.dir], check=True)
        self.assertEqual(self.c.kv.get("held")[1]["Session"], sid)


    def test_restart_keeps_every_commit(self):
        """The data dir keeps a snapshot and a line per commit: all of them come back."""
        sid = self.c.session.create(name="kept", ttl=30)
        gone = self.c.session.create(name="gone", ttl=30)
        for i in range(40):  # a third of them deleted again
            self.assertTrue(self.c.kv.put("many/%02d" % i, b"%d" % i))
            self.assertTrue(i % 3 or self.c.kv.delete("many/%02d" % i))
        self.assertTrue(self.c.kv.put("many/held", b"h", acquire=sid))
        self.assertTrue(self.c.kv.put("many/went", b"w", acquire=gone))
        self.c.session.destroy(gone)
        before = self.c.kv.get("many/", recurse=True)[1]
        subprocess.run([SCRIPT, "restart", self.dir], check=True)
        self.c = consul.Consul(host="127.0.0.1", port=self.port)
        self.assertEqual(self.c.kv.get("many/", recurse=True)[1], before)
        self.assertEqual(self.c.session.info(sid)[1]["ID"], sid)
        self.assertIsNone(self.c.session.info(gone)[1])


class ConnectionLimitTest(unittest.TestCase):
    """limits.http_max_conns_per_client, as hashicorp/go-connlimit answers it."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="consul-conns-")
        os.environ["CONSUL_TEST_HTTP_MAX_CONNS_PER_CLIENT"] = "3"
        try:
            self.port = start_server(self.dir)
        finally:
            del os.environ["CONSUL_TEST_HTTP_MAX_CONNS_PER_CLIENT"]

    def tearDown(self):
        subprocess.run([SCRIPT, "stop", self.dir], check=False)
        shutil.rmtree(self.dir, ignore_errors=True)

    def test_one_connection_over_the_limit_gets_429_and_is_closed(self):
        held = [socket.create_connection(("127.0.0.1", self.port)) for _ in range(3)]
        try:
            time.sleep(0.2)  # accepted and counted
            with socket.create_connection(("127.0.0.1", self.port), timeout=5) as over:
                answer = chunk = over.recv(4096)  # no request sent: answered, then closed
                while chunk:
                    chunk = over.recv(4096)
                    answer += chunk
            self.assertTrue(answer.startswith(b"HTTP/1.1 429 Too Many Requests\r\n"), answer)
            self.assertIn(b"Connection: close\r\n", answer)
            self.assertTrue(answer.endswith(b"\r\n\r\nYour IP is issuing too many concurrent connections, "
                                            b"please rate limit your calls\n"), answer)
        finally:
            for connection in held:
                connection.close()
        time.sleep(0.2)  # their handlers end: the address is under the limit again
        stats = requests.get("http://127.0.0.1:%d/v1/test-stand-in/stats" % self.port, timeout=5).json()
        self.assertEqual(stats["http connections over the limit"], 1)


class SessionTtlTest(Base):
    """One ~21 s test: TTL 10s sessions are invalidated after TTL x 2, not before."""

    def test_ttl_invalidation_release_and_delete(self):
        release_key, delete_key, kept_key = unique("ttl-r"), unique("ttl-d"), unique("ttl-k")
        start = time.monotonic()
        rel = self.session(name="release", ttl=10, behavior="release")
        dele = self.session(name="delete", ttl=10, behavior="delete")
        kept = self.session(name="renewed", ttl=10, lock_delay=0)
        self.assertTrue(self.c.kv.put(release_key, b"r", acquire=rel))
        self.assertTrue(self.c.kv.put(delete_key, b"d", acquire=dele))
        self.assertTrue(self.c.kv.put(kept_key, b"k", acquire=kept))
        stop = threading.Event()

        def renew():
            while not stop.wait(5):
                self.c.session.renew(kept)
        renewer = threading.Thread(target=renew)
        renewer.start()
        try:
            index, _ = self.c.kv.get(release_key)
            # Still held after the TTL itself (the multiplier is 2).
            time.sleep(max(0.0, 12.5 - (time.monotonic() - start)))
            _, data = self.c.kv.get(release_key)
            self.assertEqual(data.get("Session"), rel, "invalidated before TTL x 2")
            self.assertIsNotNone(self.c.session.info(dele)[1])
            # A blocking query on the key answers when the session goes.
            index2, data = self.c.kv.get(release_key, index=index, wait="30s")
            elapsed = time.monotonic() - start
            self.assertNotIn("Session", data, "Behavior release: the key is unlocked")
            self.assertEqual(data["Value"], b"r", "Behavior release keeps the value")
            self.assertGreater(int(index2), int(index))
            self.assertGreaterEqual(elapsed, 19.5)
            self.assertLess(elapsed, 23.0)
            time.sleep(0.2)
            self.assertIsNone(self.c.kv.get(delete_key)[1], "Behavior delete: the key is gone")
            self.assertIsNone(self.c.session.info(rel)[1])
            self.assertIsNone(self.c.session.info(dele)[1])
            with self.assertRaises(consul.NotFound):
                self.c.session.renew(rel)
            # The invalidated session's key is under its lock-delay (15 s by default).
            self.assertFalse(self.c.kv.put(release_key, b"", acquire=kept))
            # The renewed one lives on.
            self.assertEqual(self.c.kv.get(kept_key)[1]["Session"], kept)
            self.assertIsNotNone(self.c.session.info(kept)[1])
        finally:
            stop.set()
            renewer.join()


if __name__ == "__main__":
    unittest.main(warnings="ignore")
