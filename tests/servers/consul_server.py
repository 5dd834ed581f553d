#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""A TEST STAND-IN for a Consul agent's HTTP API. It is NOT Consul.

No Consul can be installed on the machines this project is built on, so the consul:// backend is
tested against this single-file server, written from Consul's documentation and from reading its
sources (hashicorp/consul: agent/kvs_endpoint.go, agent/session_endpoint.go, agent/txn_endpoint.go,
agent/consul/kvs_endpoint.go, agent/consul/session_endpoint.go, agent/consul/session_ttl.go,
agent/consul/state/kvs.go, agent/consul/state/session.go, agent/consul/state/txn.go,
agent/consul/rpc.go (blockingQuery), api/lock.go, api/semaphore.go). It reimplements only what a
lock or semaphore client uses; what Consul does that is not listed here, it does not do.

Implemented (one datacenter, one server that is always the leader):
  * One Raft-like index, bumped by every write that Consul would put through Raft, including a
    CAS or an acquire that answers false (the FSM decides those); a lock refused because of a
    lock-delay is decided before Raft and bumps nothing. The first index is --initial-index (10).
    Table indexes as in the state store: a KV read answers the KV table's index, a session read
    the sessions table's.
  * X-Consul-Index (never 0), X-Consul-KnownLeader: true, X-Consul-LastContact: 0 on reads.
  * Blocking queries (?index=N&wait=D) on KV GET (one key, ?recurse, ?keys) and on session
    info/list: answered at once while the index is above N; otherwise the query is run again
    each time something it watches changes (the key; the prefix; the session; the session table;
    a write wakes only the queries that watch what it changed, as Consul's watch sets do)
    and answers once its index is above N, or when wait (default 5 min, at most 10 min, plus a
    random jitter of up to wait/16) runs out, with the same index. An index that went backwards
    is simply above nothing: the client resets, as Consul's documentation says.
    One key: the index is its ModifyIndex, or the KV table index (at least 1) when missing.
    A prefix: the highest ModifyIndex or tombstone under it, else the KV table index.
  * KV: GET (JSON array of LockIndex, Key, Flags, Value (base64, null when empty), Session (only
    when locked), CreateIndex, ModifyIndex; 404 with X-Consul-Index when missing), ?recurse,
    ?keys with ?separator, ?raw. PUT with a body, ?flags= (a PUT without it writes Flags 0),
    ?cas= (0: only if absent), ?acquire=, ?release=; answers true/false. DELETE with ?recurse or
    ?cas= (true when the key is already gone). As in kvsSetTxn: a write equal to what is stored
    changes nothing (no index); a plain or CAS PUT keeps the Session but writes LockIndex 0;
    an acquire by a new session bumps LockIndex, by the holder keeps it; a release writes the
    request's value and flags. Keys of the KV endpoint are checked as current Consul's
    validateKVKey does (agent/kvs_endpoint.go: letters, digits and ,-_./; no "../", none that
    starts or ends with ".."; no file-like ending such as .json), and no ".." anywhere, as
    1.21.5 refused (500 "invalid key name"), unless --lax-keys; keys in a
    /v1/txn are not checked (agent/txn_endpoint.go does not call it).
  * Sessions: PUT /v1/session/create (JSON, keys matched case-insensitively like Go's
    encoding/json: Name, Node, TTL "15s" (10s..86400s or 0), Behavior release|delete,
    LockDelay "15s" or nanoseconds (values below 1000 taken as seconds, as FixupLockDelay does),
    Checks/NodeChecks/ServiceChecks stored, not checked), renew (the session in an array; 404
    "Session id 'X' not found"), destroy, info/ID, list, node/NODE. A TTL session is invalidated
    when not renewed for TTL x 2 (SessionTTLMultiplier). Invalidation or destroy: Behavior
    release clears the Session of every key it holds (a write, ModifyIndex bumped), delete
    deletes them; either way each key gets a lock-delay of min(LockDelay, 60 s) during which
    ?acquire answers false for every session.
  * /v1/txn (PUT, at most 64 operations) with KV verbs set, cas, lock, unlock, get,
    get-or-empty, get-tree, check-index, check-session, check-not-exists, delete, delete-cas,
    delete-tree: all or nothing; 200 {"Results":[{"KV":...}],"Errors":null} (values only for
    get verbs), or 409 {"Results":null,"Errors":[{"OpIndex":i,"What":"..."}]}. Node, service
    and check operations are not implemented (400).
  * ACL: with --acl-token (or CONSUL_TEST_ACL_TOKEN, the management token) every request except
    /v1/status/* is checked (token from X-Consul-Token, Authorization: Bearer, or ?token=)
    against the token's rules, as consul_acl.py decides them: no token is the anonymous token
    (no rights), a token of --acl-tokens (CONSUL_TEST_ACL_TOKENS; @FILE: read at every request) has its key/key_prefix and
    session/session_prefix rules, any other token answers 403 "ACL not found". Refused: a KV
    GET of one key, PUT or DELETE 403 "Permission denied"; a ?recurse/?keys listing and a
    session listing filtered (404 when nothing is left); a session create, renew or destroy
    403 "Permission denied" (destroy of an unknown session 500 'Unknown session "ID"'); a txn
    409 with {"OpIndex":i,"What":"Permission denied"} for every op refused (agent/consul/
    txn_endpoint.go preCheck) and nothing applied, its get results filtered; /v1/agent/self
    for any token but the management one 403. Without --acl-token, open.
  * /v1/status/leader, /v1/status/peers, /v1/agent/self (Config.NodeName, Config.Datacenter).
  * ?dc= other than --datacenter (dc1): 500 "No path to datacenter".
  * --data-dir DIR: the Raft state (index, KV, sessions; not tombstones) is written there after
    every write and read back on start, as a restarted server keeps its Raft log; on start the
    index moves on by one (a new leader's barrier) and every session's TTL timer starts again
    (initializeSessionTimers). Lock-delays are in memory only.
  * Pausing: send SIGSTOP / SIGCONT to the process (tests/servers/consul.sh pause|resume).
  * limits.http_max_conns_per_client (--http-max-conns-per-client, env
    CONSUL_TEST_HTTP_MAX_CONNS_PER_CLIENT; 200 as Consul's default): a connection from an IP that
    has that many open gets "HTTP/1.1 429 Too Many Requests" (Connection: close, Consul's text)
    before its request is read, and is closed (hashicorp/go-connlimit, agent/agent.go); counted
    in the stats as "http connections over the limit".
  * Tombstones are reaped after --tombstone-ttl (Consul's tombstone_ttl, 15 min; env
    CONSUL_TEST_TOMBSTONE_TTL), so a prefix's index may go back to its live keys' highest.
  * GET /v1/test-stand-in/stats (NOT a Consul API): requests answered per method and endpoint,
    blocking queries by how they ended, HTTP connections open now, KV entries returned by
    prefix reads (?recurse, get-tree: "kv entries listed"); for the benchmarks
    (bench/consul_run.sh) and the tests.
  * PUT /v1/test-stand-in/delay?path=P&seconds=S (NOT a Consul API; TEST-ONLY): every later
    request whose path starts with P is answered S seconds late (each in its own thread, so
    concurrent ones overlap, as a slow server's would); seconds=0 removes it. For the tests of
    slow renewals.
  * PUT /v1/test-stand-in/race?key=K (NOT a Consul API; TEST-ONLY): after every later read that
    returns K (a GET of K or of a prefix of it without ?index, a transaction's get, get-or-empty
    or get-tree that applied), before it is answered, K's value is rewritten with one trailing
    space added or taken away (the same JSON, other bytes: its ModifyIndex moves), as a peer
    that changes K between every reader's read and its CAS would; ?off removes it. For the tests
    of CAS races.

Not implemented: catalog, health, agent services and checks (session checks are never
evaluated), events, prepared queries, namespaces/partitions, ?consistent/?stale differences
(both accepted), hash-based blocking, TLS, gzip, ?pretty.
Standard library only; run it with /usr/bin/python3.
"""

import argparse
import collections
import base64
import bisect
import http.server
import json
import os
import random
import re
import select
import signal
import socket
import sys
import threading
import time
import urllib.parse
import uuid

import consul_acl

SESSION_TTL_MIN = 10.0            # seconds (config SessionTTLMin default)
SESSION_TTL_MAX = 86400.0         # structs.SessionTTLMax
SESSION_TTL_MULTIPLIER = 2        # structs.SessionTTLMultiplier
MAX_LOCK_DELAY = 60.0             # structs.MaxLockDelay
DEFAULT_LOCK_DELAY = 15.0         # SessionCreate default
DEFAULT_QUERY_TIME = 300.0        # defaultQueryTime
MAX_QUERY_TIME = 600.0            # maxQueryTime
JITTER_FRACTION = 16              # jitterFraction
MAX_TXN_OPS = 64                  # maxTxnOps
KV_MAX_VALUE_SIZE = 512 * 1024    # kv_max_value_size default
LOCK_DELAY_MIN_THRESHOLD = 1000   # lockDelayMinThreshold (nanoseconds)

_UNITS = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "\u03bcs": 1e-6, "ms": 1e-3, "s": 1.0,
          "m": 60.0, "h": 3600.0}
_DURATION_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|\u00b5s|\u03bcs|ms|s|m|h)")


def parse_go_duration(text):
    """Seconds from a Go time.ParseDuration string ("15s", "1m30s", "0"); ValueError if bad."""
    s = text
    sign = 1.0
    if s[:1] in "+-" and s:
        sign = -1.0 if s[0] == "-" else 1.0
        s = s[1:]
    if s == "0":
        return 0.0
    if not s:
        raise ValueError('time: invalid duration "%s"' % text)
    total = 0.0
    pos = 0
    while pos < len(s):
        m = _DURATION_PART.match(s, pos)
        if not m:
            if re.match(r"(\d+\.?\d*|\.\d+)", s[pos:]):
                raise ValueError('time: missing unit in duration "%s"' % text)
            raise ValueError('time: invalid duration "%s"' % text)
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    return sign * total


def go_duration_string(seconds):
    """Go's Duration.String() for the few values printed in error messages."""
    if seconds == 0:
        return "0s"
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    if h:
        return "%dh%dm%gs" % (h, m, s)
    if m:
        return "%dm%gs" % (m, s)
    return "%gs" % s


_KEY_CHARS = re.compile(r"[a-zA-Z0-9,\-_./]*")
_SUSPICIOUS_EXTENSIONS = (
    ".js", ".css", ".html", ".htm", ".xml", ".json", ".txt", ".log", ".php", ".asp", ".jsp",
    ".cgi", ".pl", ".py", ".rb", ".sh", ".exe", ".dll", ".bat", ".cmd", ".com", ".scr", ".vbs",
    ".pdf", ".doc", ".docx", ".xls", ".xlsx", ".ppt", ".pptx", ".zip", ".rar", ".tar", ".gz",
    ".7z", ".bz2", ".jpg", ".jpeg", ".png", ".gif", ".svg", ".ico", ".bmp", ".mp3", ".mp4",
    ".avi", ".mov", ".wmv", ".flv", ".swf", ".woff", ".woff2", ".ttf", ".eot", ".otf")


def key_error(key):
    """What current Consul's validateKVKey says about a non-empty key, or None."""
    if key.startswith("/"):
        return "key must not begin with a '/'"
    m = _KEY_CHARS.match(key)
    if m.end() != len(key):
        return ("key contains invalid character '%s' at position %d. Only alphanumeric "
                "characters and ,-_./ are allowed" % (key[m.end()], len(key[:m.end()].encode())))
    # pathTraversalPattern: "../" anywhere, ".." at the start or the end.
    if "../" in key or key.startswith("..") or key.endswith(".."):
        return "key contains path traversal sequence"
    lower = key.lower()
    for ext in _SUSPICIOUS_EXTENSIONS:
        if lower.endswith(ext):
            return ("key contains suspicious file extension '%s' that may be cached by proxies"
                    % ext)
    return None


# Consul 1.21.5 (hashicorp/consul PR #22682, backported to 1.18-1.21 as e.g. PR #22696) refused
# every KV-endpoint key containing "..", anywhere, as an RPC error: HTTP 500 "invalid key name"
# (issue #22835 quotes its answer). PR #22850 (1.22, backported as #22931) relaxed it again to
# path traversal only. The strictest shipped rule is checked first.
def key_error_1_21_5(key):
    if ".." in key:
        return "invalid key name, keys should not contain '..' (Consul 1.21.5)"
    return None


class ConsulError(Exception):
    """An error answered as an HTTP status with a text body."""

    def __init__(self, status, text):
        super().__init__(text)
        self.status = status
        self.text = text


class TxnAbort(Exception):
    pass


class Watcher:
    """One blocking query waiting: what it watches, and its own condition on the state's lock."""

    def __init__(self, watches, cond):
        self.watches = watches
        self.cond = cond
        self.fired = False


class PrefixIndexed(dict):
    """A dict that also keeps its keys sorted, so a prefix read finds its keys by bisection
    instead of scanning the whole store (the suite's shared stand-in holds every test's keys,
    and a queue of thousands is read on every change). Answers are the same as a scan's."""

    def __init__(self):
        super().__init__()
        self.order = []

    def __setitem__(self, key, value):
        if key not in self:
            bisect.insort(self.order, key)
        super().__setitem__(key, value)

    def __delitem__(self, key):
        super().__delitem__(key)
        del self.order[bisect.bisect_left(self.order, key)]

    def pop(self, key, *default):
        if key in self:
            value = self[key]
            del self[key]
            return value
        return super().pop(key, *default)

    def prefixed(self, prefix):
        """The keys starting with `prefix`, sorted."""
        start = bisect.bisect_left(self.order, prefix)
        end = start
        while end < len(self.order) and self.order[end].startswith(prefix):
            end += 1
        return self.order[start:end]


class State:
    """The Raft state of one server (always the leader), guarded by one lock.

    KV entries and sessions are treated as immutable dicts: a write stores a new dict, so a
    transaction rolls back by putting the old maps back.
    """

    def __init__(self, args):
        self.args = args
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)  # the reaper's: every commit wakes it
        # Blocking queries waiting now, each with its own condition on the state's lock: a
        # commit wakes only those that watch something it changed, as Consul's watch sets do
        # (a thousand waiting queries are not a thousand threads woken by every write).
        self.watchers = set()
        self.notified = 0        # changes (absolute, as changes_base) the watchers were told of
        self.stats_lock = threading.Lock()
        self.undo = None         # inside a transaction: key -> (entry, tombstone) before it
        self.stats = {}
        self.delays = {}         # TEST-ONLY: path prefix -> seconds (/v1/test-stand-in/delay)
        self.raced = set()       # TEST-ONLY: keys changed after every read (/v1/test-stand-in/race)
        self.raft_index = args.initial_index
        self.kvs = PrefixIndexed()         # key -> entry dict (Value: bytes or None)
        self.texts = {}                    # key -> (entry, its JSON text): entry_text's
        self.tombstones = PrefixIndexed()  # key -> index of its deletion (the graveyard)
        self.buried = collections.deque()  # (monotonic time, key, index): for the reaper
        self.kvs_index = 0       # max of the kvs and tombstones table indexes
        self.sessions = {}       # id -> session dict
        self.sessions_index = 0
        self.lock_delays = {}    # key -> time.monotonic() when the delay ends
        self.deadlines = {}      # session id -> time.monotonic() of invalidation
        # What changed, for blocking queries: (kind, name), kind "kv" or "session".
        self.changes = []
        self.changes_base = 0
        self.data_file = None
        self.saved_changes = 0   # changes (absolute, as changes_base) written to the data file
        self.log_lines = None    # commits appended after its snapshot (None: write a snapshot)
        if args.data_dir:
            os.makedirs(args.data_dir, exist_ok=True)
            self.data_file = os.path.join(args.data_dir, "raft.json")
            self._load()

    # ---- persistence -------------------------------------------------------------------------

    def _load(self):
        """The data file: a snapshot line, then a line per commit with what it changed (a torn
        last line, from a kill in the middle of its write, is left out)."""
        try:
            with open(self.data_file) as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return
        saved = json.loads(lines[0])
        # Tombstones are not kept (as if reaped on the restart): a prefix's index may go back to
        # its live keys' highest; the table index does not.
        self.tombstones = PrefixIndexed()
        for e in saved["kvs"]:
            self._load_entry(e["Key"], e)
        self.sessions = {s["ID"]: s for s in saved["sessions"]}
        for line in lines[1:]:
            try:
                record = json.loads(line)
            except ValueError:
                break
            saved = record
            for key, e in record["kv"].items():
                self._load_entry(key, e)
            for sid, s in record["sessions"].items():
                if s is None:
                    self.sessions.pop(sid, None)
                else:
                    self.sessions[sid] = s
        self.raft_index = saved["raft_index"] + 1   # the new leader's barrier entry
        self.kvs_index = saved["kvs_index"]
        self.sessions_index = saved["sessions_index"]
        now = time.monotonic()
        for s in self.sessions.values():
            self._reset_timer(s, now)

    def _load_entry(self, key, e):
        if e is None:
            self.kvs.pop(key, None)
            return
        e = dict(e)
        e["Value"] = None if e["Value"] is None else base64.b64decode(e["Value"])
        e.setdefault("Session", "")   # entry_json leaves it out when unlocked
        self.kvs[key] = e

    def _indexes(self):
        return {"raft_index": self.raft_index, "kvs_index": self.kvs_index,
                "sessions_index": self.sessions_index}

    def _save(self):
        """After every commit, as Raft's log: a line with what the commit changed, appended (a
        rewrite of the whole state made every write cost the size of the store: a queue of ten
        thousand took hours); the whole state again once the lines outnumber its entries."""
        if not self.data_file:
            return
        start = self.saved_changes - self.changes_base
        entries = len(self.kvs) + len(self.sessions)
        if self.log_lines is None or start < 0 or self.log_lines >= max(1000, entries):
            saved = dict(self._indexes(), kvs=[self.entry_json(e) for e in self.kvs.values()],
                         sessions=list(self.sessions.values()))
            tmp = self.data_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(json.dumps(saved) + "\n")
            os.replace(tmp, self.data_file)
            self.log_lines = 0
        else:
            kv, sessions = {}, {}
            for kind, name in self.changes[start:]:
                if kind == "kv":
                    e = self.kvs.get(name)
                    kv[name] = None if e is None else self.entry_json(e)
                else:
                    sessions[name] = self.sessions.get(name)
            with open(self.data_file, "a") as f:
                f.write(json.dumps(dict(self._indexes(), kv=kv, sessions=sessions)) + "\n")
            self.log_lines += 1
        self.saved_changes = self.changes_base + len(self.changes)

    # ---- helpers -----------------------------------------------------------------------------

    @staticmethod
    def entry_json(e, with_value=True):
        out = {"LockIndex": e["LockIndex"], "Key": e["Key"], "Flags": e["Flags"],
               "Value": None}
        if with_value and e["Value"] is not None:
            out["Value"] = base64.b64encode(e["Value"]).decode()
        if e["Session"]:
            out["Session"] = e["Session"]
        out["CreateIndex"] = e["CreateIndex"]
        out["ModifyIndex"] = e["ModifyIndex"]
        return out

    def entry_text(self, e):
        """entry_json(e) as compact JSON text, kept while e is the key's entry (an entry is never
        changed in place): a queue of thousands is read on every change, and encoding each entry
        again for every read made the stand-in, not the client, the bottleneck. Under the lock."""
        cached = self.texts.get(e["Key"])
        if cached is not None and cached[0] is e:
            return cached[1]
        text = json.dumps(self.entry_json(e), separators=(",", ":"))
        self.texts[e["Key"]] = (e, text)
        return text

    def _changed(self, kind, name):
        self.changes.append((kind, name))
        if len(self.changes) > 20000:
            drop = 10000
            del self.changes[:drop]
            self.changes_base += drop

    def _commit(self):
        """After a Raft write: persist and wake the reaper and the blocking queries it concerns."""
        self._save()
        self._wake_watchers()
        self.cond.notify_all()

    def _wake_watchers(self):
        end = self.changes_base + len(self.changes)
        start = self.notified - self.changes_base
        self.notified = end
        if start < 0:
            new = None                 # trimmed before they were told: every query runs again
        else:
            new = self.changes[start:]
            if not new:
                return
        for w in self.watchers:
            if not w.fired and (new is None or any(w.watches(k, n) for k, n in new)):
                w.fired = True
                w.cond.notify()

    def _next_index(self):
        self.raft_index += 1
        return self.raft_index

    # ---- KV state operations (as agent/consul/state/kvs.go) ---------------------------------

    def _set(self, idx, entry, update_session):
        """kvsSetTxn: CreateIndex kept, Session kept unless update_session; equal: no write."""
        existing = self.kvs.get(entry["Key"])
        entry = dict(entry)
        entry["CreateIndex"] = existing["CreateIndex"] if existing else idx
        if not update_session:
            entry["Session"] = existing["Session"] if existing else ""
        if existing is not None and all(
                existing[f] == entry[f] for f in ("LockIndex", "Key", "Flags", "Value", "Session")):
            return existing
        entry["ModifyIndex"] = idx
        self._remember(entry["Key"])
        self.kvs[entry["Key"]] = entry
        self.kvs_index = idx
        self._changed("kv", entry["Key"])
        return entry

    def _remember(self, key):
        """Inside a transaction: the key's entry and tombstone before its first change, so a
        failed transaction is undone by what it touched (Consul's MemDB aborts the same way)."""
        if self.undo is not None and key not in self.undo:
            self.undo[key] = (self.kvs.get(key), self.tombstones.get(key))

    def _delete(self, idx, key):
        if key not in self.kvs:
            return
        self._remember(key)
        del self.kvs[key]
        self.texts.pop(key, None)
        self.tombstones[key] = idx
        self.buried.append((time.monotonic(), key, idx))
        self.kvs_index = idx
        self._changed("kv", key)

    def _delete_cas(self, idx, cas, key):
        e = self.kvs.get(key)
        if e is None or e["ModifyIndex"] != cas:
            return e is None
        self._delete(idx, key)
        return True

    def _delete_tree(self, idx, prefix):
        doomed = self.kvs.prefixed(prefix)
        if not doomed:
            return
        for k in doomed:
            self._remember(k)
            del self.kvs[k]
            self.texts.pop(k, None)
            self._changed("kv", k)
        self._remember(prefix)
        self.tombstones[prefix] = idx
        self.buried.append((time.monotonic(), prefix, idx))
        self.kvs_index = idx

    def _cas(self, idx, entry, cas):
        existing = self.kvs.get(entry["Key"])
        if cas == 0 and existing is not None:
            return None
        if cas != 0 and (existing is None or existing["ModifyIndex"] != cas):
            return None
        return self._set(idx, entry, False)

    def _lock(self, idx, entry):
        session = entry["Session"]
        if not session:
            raise ConsulError(500, "missing session")
        if session not in self.sessions:
            raise ConsulError(500, 'invalid session "%s"' % session)
        entry = dict(entry)
        existing = self.kvs.get(entry["Key"])
        if existing is not None:
            if existing["Session"] == session:
                entry["LockIndex"] = existing["LockIndex"]
            elif existing["Session"]:
                return None
            else:
                entry["LockIndex"] = existing["LockIndex"] + 1
        else:
            entry["LockIndex"] = 1
        return self._set(idx, entry, True)

    def _unlock(self, idx, entry):
        if not entry["Session"]:
            raise ConsulError(500, "missing session")
        existing = self.kvs.get(entry["Key"])
        if existing is None or existing["Session"] != entry["Session"]:
            return None
        entry = dict(entry)
        entry["Session"] = ""
        entry["LockIndex"] = existing["LockIndex"]
        return self._set(idx, entry, True)

    def lock_delayed(self, key):
        end = self.lock_delays.get(key)
        if end is None:
            return False
        if end > time.monotonic():
            return True
        del self.lock_delays[key]
        return False

    def kv_write(self, op, entry, cas=None):
        """One KVS.Apply: answers True/False, or raises ConsulError."""
        with self.cond:
            if op == "lock" and self.lock_delayed(entry["Key"]):
                return False             # kvsPreApply: refused before Raft
            idx = self._next_index()
            try:
                if op == "set":
                    self._set(idx, entry, False)
                    return True
                if op == "cas":
                    return self._cas(idx, entry, cas) is not None
                if op == "lock":
                    return self._lock(idx, entry) is not None
                if op == "unlock":
                    return self._unlock(idx, entry) is not None
                if op == "delete":
                    self._delete(idx, entry["Key"])
                    return True
                if op == "delete-cas":
                    return self._delete_cas(idx, cas, entry["Key"])
                if op == "delete-tree":
                    self._delete_tree(idx, entry["Key"])
                    return True
                raise ConsulError(500, "unknown op")
            finally:
                self._commit()

    # ---- KV reads (as agent/consul/kvs_endpoint.go + state) ---------------------------------

    def kv_get(self, key):
        e = self.kvs.get(key)
        if e is None:
            return max(self.kvs_index, 1), None
        return e["ModifyIndex"], e

    def kv_list(self, prefix):
        entries = [self.kvs[k] for k in self.kvs.prefixed(prefix)]
        self.count("kv entries listed", len(entries))
        if prefix:
            lindex = max([e["ModifyIndex"] for e in entries] +
                         [self.tombstones[k] for k in self.tombstones.prefixed(prefix)] + [0])
        else:
            lindex = self.kvs_index
        idx = lindex if lindex else self.kvs_index
        return max(idx, 1), entries

    # ---- sessions (as agent/consul/state/session.go, session_ttl.go) ------------------------

    def _reset_timer(self, s, now=None):
        ttl = s.get("_ttl_seconds", 0)
        if ttl:
            self.deadlines[s["ID"]] = (now or time.monotonic()) + ttl * SESSION_TTL_MULTIPLIER

    def session_create(self, s):
        with self.cond:
            sid = str(uuid.uuid4())
            while sid in self.sessions:
                sid = str(uuid.uuid4())
            idx = self._next_index()
            s = dict(s, ID=sid, CreateIndex=idx, ModifyIndex=idx)
            self.sessions[sid] = s
            self.sessions_index = idx
            self._changed("session", sid)
            self._reset_timer(s)
            self._commit()
            return sid

    def _invalidate(self, sid, idx):
        """deleteSessionTxn: the session goes; its keys are released or deleted, lock-delayed."""
        s = self.sessions.pop(sid, None)
        self.deadlines.pop(sid, None)
        if s is None:
            return
        self.sessions_index = idx
        self._changed("session", sid)
        delay = min(s["LockDelay"] / 1e9, MAX_LOCK_DELAY)
        now = time.monotonic()
        held = [e for e in self.kvs.values() if e["Session"] == sid]
        for e in held:
            if s["Behavior"] == "delete":
                self._delete(idx, e["Key"])
            else:
                self._set(idx, dict(e, Session=""), True)
            if delay > 0:
                self.lock_delays[e["Key"]] = now + delay

    def session_destroy(self, sid):
        with self.cond:
            idx = self._next_index()
            self._invalidate(sid, idx)
            self._commit()

    def session_renew(self, sid):
        with self.cond:
            s = self.sessions.get(sid)
            if s is not None:
                self._reset_timer(s)
            return s

    def public_session(self, s):
        return {k: v for k, v in s.items() if not k.startswith("_")}

    def reaper(self):
        """The leader's session timers: invalidate what was not renewed within TTL x 2."""
        with self.cond:
            while True:
                now = time.monotonic()
                expired = [sid for sid, t in self.deadlines.items() if t <= now]
                for sid in expired:
                    idx = self._next_index()
                    self._invalidate(sid, idx)
                    log("session %s invalidated: TTL x %d without renewal"
                        % (sid, SESSION_TTL_MULTIPLIER))
                if expired:
                    self._commit()
                self._reap_tombstones(now)
                nxt = min(self.deadlines.values(), default=now + 1.0)
                self.cond.wait(max(0.005, min(nxt - time.monotonic(), 1.0)))

    def _reap_tombstones(self, now):
        """Consul's tombstone GC (tombstone_ttl, 15 min by default): a prefix's index may then go
        back to its live keys' highest, which is why clients reset an index that goes backwards.
        The table index (kvs_index) never goes back."""
        ttl = self.args.tombstone_ttl
        while self.buried and self.buried[0][0] + ttl <= now:
            _, key, idx = self.buried.popleft()
            if self.tombstones.get(key) == idx:
                del self.tombstones[key]

    # ---- blocking queries (as agent/consul/rpc.go blockingQuery) ----------------------------

    def race(self, key):
        """TEST-ONLY (/v1/test-stand-in/race): a peer's change of `key` right after a read."""
        with self.cond:
            e = self.kvs.get(key)
            if e is None or key not in self.raced:
                return
            value = e["Value"] or b""
            changed = dict(e, Value=value[:-1] if value.endswith(b" ") else value + b" ")
            self._set(self._next_index(), changed, False)
            self._commit()

    def race_under(self, key, prefix=False):
        """TEST-ONLY: race() every raced key that a read of `key` (a prefix: `prefix`) returned."""
        if not self.raced:
            return  # the usual case: no lock taken (a set's truth is read atomically)
        with self.cond:
            raced = [k for k in self.raced if k == key or (prefix and k.startswith(key))]
        for k in raced:
            self.race(k)

    def count(self, what, amount=1):
        """Test-only counters (GET /v1/test-stand-in/stats; not a Consul API)."""
        with self.stats_lock:
            self.stats[what] = self.stats.get(what, 0) + amount

    def blocking(self, min_index, wait, run, watches, client_gone=lambda: False):
        """run() -> (index, result) under the lock; watches(kind, name) -> bool. A query woken
        after its client closed the connection (a client that stopped waiting) is counted apart
        from one woken for a waiting client: the counts say how many waiters a change woke."""
        with self.cond:
            index, result = run()
            index = max(index, 1)
            if min_index == 0 or index > min_index:
                if min_index:
                    self.count("blocking answered at once")
                return index, result
            if wait > MAX_QUERY_TIME:
                wait = MAX_QUERY_TIME
            elif wait <= 0:
                wait = DEFAULT_QUERY_TIME
            wait += random.uniform(0, wait / JITTER_FRACTION)
            deadline = time.monotonic() + wait
            watcher = Watcher(watches, threading.Condition(self.lock))
            self.watchers.add(watcher)
            try:
                while True:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        self.count("blocking timed out")
                        return index, result
                    watcher.cond.wait(remaining)
                    if not watcher.fired:
                        continue
                    watcher.fired = False
                    index, result = run()
                    index = max(index, 1)
                    if index > min_index:
                        self.count("blocking woken, client gone" if client_gone() else "blocking woken")
                        return index, result
            finally:
                self.watchers.discard(watcher)

    # ---- transactions (as agent/txn_endpoint.go, agent/consul/txn_endpoint.go, state/txn.go) -

    def txn(self, ops, writes, denied=()):
        """`denied`: the ACL's refusals (consul_acl.txn_op_denied), in preCheck's order."""
        denied = {d["OpIndex"]: d for d in denied}
        with self.cond:
            errors = []
            for i, op in enumerate(ops):      # preCheck (kvsPreApply)
                if not op["Key"] and op["Verb"] != "delete-tree":
                    errors.append({"OpIndex": i, "What": "Must provide key"})
                elif i in denied:
                    errors.append(denied[i])
                elif op["Verb"] == "lock" and self.lock_delayed(op["Key"]):
                    errors.append({"OpIndex": i, "What": 'failed to lock key "%s" due to lock delay'
                                   % op["Key"]})
            if errors:
                return None, errors
            idx = self._next_index() if writes else 0
            saved = (self.kvs_index, len(self.changes), self.changes_base)
            self.undo = {}
            results, errors = [], []
            try:
                for i, op in enumerate(ops):
                    try:
                        results.extend(self._txn_op(idx, op))
                    except (TxnAbort, ConsulError) as err:
                        errors.append({"OpIndex": i, "What": str(err)})
                undo = self.undo
            finally:
                self.undo = None
            if errors:
                for key, (entry, tombstone) in undo.items():
                    for table, value in ((self.kvs, entry), (self.tombstones, tombstone)):
                        if value is None:
                            table.pop(key, None)
                        else:
                            table[key] = value
                self.kvs_index = saved[0]
                if self.changes_base == saved[2]:
                    del self.changes[saved[1]:]
                if writes:
                    self._commit()
                return None, errors
            if writes:
                self._commit()
            return results, None

    def _txn_op(self, idx, op):
        verb, key = op["Verb"], op["Key"]
        entry = {"Key": key, "Value": op["Value"], "Flags": op["Flags"], "Session": op["Session"],
                 "LockIndex": 0}
        out = None
        if verb == "set":
            out = self._set(idx, entry, False)
        elif verb == "delete":
            self._delete(idx, key)
        elif verb == "delete-cas":
            if not self._delete_cas(idx, op["Index"], key):
                raise TxnAbort('failed to delete key "%s", index is stale' % key)
        elif verb == "delete-tree":
            self._delete_tree(idx, key)
        elif verb == "cas":
            out = self._cas(idx, entry, op["Index"])
            if out is None:
                raise TxnAbort('failed to set key "%s", index is stale' % key)
        elif verb == "lock":
            out = self._lock(idx, entry)
            if out is None:
                raise TxnAbort('failed to lock key "%s", lock is already held' % key)
        elif verb == "unlock":
            out = self._unlock(idx, entry)
            if out is None:
                raise TxnAbort('failed to unlock key "%s", lock isn\'t held, or is held by '
                               'another session' % key)
        elif verb in ("get", "get-or-empty"):
            e = self.kvs.get(key)
            if e is None:
                if verb == "get":
                    raise TxnAbort('key "%s" doesn\'t exist' % key)
                e = dict(entry, Value=None, CreateIndex=0, ModifyIndex=op["Index"])
            return [{"KV": self.entry_json(e)}]
        elif verb == "get-tree":
            return [{"KV": self.entry_json(e)} for e in self.kv_list(key)[1]]
        elif verb in ("check-session", "check-index"):
            what = verb[len("check-"):]
            out = self.kvs.get(key)
            if out is None:
                raise TxnAbort('failed to check %s, key "%s" doesn\'t exist' % (what, key))
            field, want, label, form = (("Session", op["Session"], "session", '"%s"')
                                        if what == "session" else
                                        ("ModifyIndex", op["Index"], "modify index", "%d"))
            if out[field] != want:
                message = 'failed %s check for key "%%s", current %s %s != %s' % (
                    what, label, form, form)
                raise TxnAbort(message % (key, out[field], want))
        elif verb == "check-not-exists":
            if key in self.kvs:
                raise TxnAbort('key "%s" exists' % key)
        else:
            raise TxnAbort('unknown KV verb "%s"' % verb)
        return [{"KV": self.entry_json(out, with_value=False)}] if out is not None else []


TXN_WRITE_VERBS = {"set", "delete", "delete-cas", "delete-tree", "cas", "lock", "unlock"}


def log(message):
    sys.stderr.write("%s consul-test-server: %s\n" % (time.strftime("%Y-%m-%dT%H:%M:%S"), message))
    sys.stderr.flush()


def ci_get(obj, name, default=None):
    """A JSON object member matched case-insensitively, as Go's encoding/json does."""
    if name in obj:
        return obj[name]
    lower = name.lower()
    for k, v in obj.items():
        if k.lower() == lower:
            return v
    return default


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "consul-test-stand-in"
    sys_version = ""

    def setup(self):
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, fmt, *args):
        if self.server.args.verbose:
            log("%s %s" % (self.address_string(), fmt % args))

    # ---- plumbing ----------------------------------------------------------------------------

    def send(self, status, body=b"", content_type="application/json", headers=None):
        if isinstance(body, str):
            body = body.encode()
        reason = http.server.BaseHTTPRequestHandler.responses.get(status, ("",))[0]
        lines = ["HTTP/1.1 %d %s" % (status, reason),
                 "Date: " + self.date_time_string(),
                 "Content-Length: %d" % len(body)]
        if body or content_type != "application/json":
            lines.append("Content-Type: " + content_type)
        for k, v in (headers or {}).items():
            lines.append("%s: %s" % (k, v))
        self.wfile.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        self.log_request(status, len(body))

    def send_json(self, status, obj, headers=None):
        self.send(status, json.dumps(obj, separators=(",", ":")), headers=headers)

    def read_body(self):
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def client_gone(self):
        """Whether the client closed this connection (EOF waiting on it), as Go's net/http notices
        with its background read while a handler runs."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def meta(self, index):
        return {"X-Consul-Index": str(index), "X-Consul-KnownLeader": "true",
                "X-Consul-LastContact": "0"}

    def do_GET(self):
        self.dispatch("GET")

    def do_PUT(self):
        self.dispatch("PUT")

    def do_POST(self):
        self.dispatch("POST")

    def do_DELETE(self):
        self.dispatch("DELETE")

    def dispatch(self, method):
        self.state = self.server.state
        try:
            body = self.read_body()
            url = urllib.parse.urlsplit(self.path)
            self.params = urllib.parse.parse_qs(url.query, keep_blank_values=True)
            path = urllib.parse.unquote(url.path)
            if path != "/v1/test-stand-in/stats":
                self.state.count("%s %s" % (method, "/".join(path.split("/")[:4 if "/session/" in path else 3])))
            with self.state.stats_lock:
                delay = max([s for p, s in self.state.delays.items() if path.startswith(p)] + [0])
            if delay:
                time.sleep(delay)  # TEST-ONLY: a slow answer (/v1/test-stand-in/delay)
            self.route(method, path, body)
        except ConsulError as err:
            self.send(err.status, err.text, content_type="text/plain; charset=utf-8")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as err:  # a bug here: answer 500 and say it in the log
            log("internal error on %s %s: %r" % (method, self.path, err))
            self.send(500, "test server internal error: %r" % err, content_type="text/plain")

    def param(self, name, default=None):
        values = self.params.get(name)
        return values[-1] if values else default

    def has(self, name):
        return name in self.params

    def uint_param(self, name, what):
        try:
            value = int(self.param(name), 10)
            if value < 0 or value >= 1 << 64:
                raise ValueError
            return value
        except (TypeError, ValueError):
            raise ConsulError(400, what)

    # ---- ACL ---------------------------------------------------------------------------------

    def token_policy(self):
        """None: may do anything (no ACLs, or the management token); else a consul_acl.Policy.
        A token nobody made: 403 "ACL not found"."""
        args = self.server.args
        if not args.acl_token:
            return None
        token = self.headers.get("X-Consul-Token") or ""
        auth = self.headers.get("Authorization") or ""
        if not token and auth.lower().startswith("bearer "):
            token = auth[7:].strip()
        if not token:
            token = self.param("token", "") or ""
        if not token:
            return consul_acl.ANONYMOUS
        if token == args.acl_token:
            return None
        policy = consul_acl.tokens(args.acl_tokens).get(token)
        if policy is None:
            raise ConsulError(403, "ACL not found")
        return policy

    def may_read_key(self, key):
        return self.policy is None or self.policy.key_read(key)

    def require(self, allowed):
        if not allowed:
            raise ConsulError(403, consul_acl.PERMISSION_DENIED)

    # ---- routes ------------------------------------------------------------------------------

    def route(self, method, path, body):
        if path == "/v1/test-stand-in/stats":
            # Not a Consul API: what the stand-in has answered so far (requests by method and
            # endpoint, blocking queries by how they ended), for the benchmarks. No ACL.
            with self.state.stats_lock:
                stats = dict(self.state.stats)
            with self.server.conns_lock:  # a gauge: connections open now, from every client
                stats["http connections open"] = sum(self.server.conns.values())
            return self.send_json(200, stats)
        if path == "/v1/test-stand-in/delay" and method == "PUT":
            # Not a Consul API, TEST-ONLY: answer requests under ?path= ?seconds= late. No ACL.
            prefix, seconds = self.param("path", ""), float(self.param("seconds", "0"))
            with self.state.stats_lock:
                if seconds > 0:
                    self.state.delays[prefix] = seconds
                else:
                    self.state.delays.pop(prefix, None)
            return self.send_json(200, True)
        if path == "/v1/test-stand-in/race" and method == "PUT":
            # Not a Consul API, TEST-ONLY: a peer that wins every CAS race on ?key=. No ACL.
            with self.state.cond:
                if self.has("off"):
                    self.state.raced.discard(self.param("key", ""))
                else:
                    self.state.raced.add(self.param("key", ""))
            return self.send_json(200, True)
        if path.startswith("/v1/status/"):
            if path == "/v1/status/leader":
                return self.send_json(200, "127.0.0.1:8300")
            if path == "/v1/status/peers":
                return self.send_json(200, ["127.0.0.1:8300"])
            raise ConsulError(404, "")
        self.policy = self.token_policy()
        self.check_query_options()
        if path.startswith("/v1/kv/") or path == "/v1/kv":
            return self.kv(method, path[len("/v1/kv/"):], body)
        if path.startswith("/v1/session/"):
            return self.session(method, path[len("/v1/session/"):], body)
        if path == "/v1/txn":
            if method != "PUT":
                raise ConsulError(405, "method %s not allowed" % method)
            return self.txn(body)
        if path == "/v1/agent/self":
            self.require(self.policy is None)
            args = self.server.args
            return self.send_json(200, {
                "Config": {"NodeName": args.node_name, "Datacenter": args.datacenter,
                           "Server": True, "Version": "test-stand-in"},
                "Member": {"Name": args.node_name, "Addr": "127.0.0.1", "Port": 8301},
                "Meta": {"consul-test-stand-in": "true"}})
        raise ConsulError(404, "no such endpoint in the Consul test stand-in: %s" % path)

    def check_query_options(self):
        dc = self.param("dc")
        if dc and dc != self.server.args.datacenter:
            raise ConsulError(500, "No path to datacenter")
        if self.has("stale") and self.has("consistent"):
            raise ConsulError(400, "Cannot specify ?stale with ?consistent, conflicting semantics.")

    def blocking_options(self):
        min_index = 0
        wait = 0.0
        if self.has("index"):
            min_index = self.uint_param("index", "Invalid index")
        if self.has("wait"):
            try:
                wait = parse_go_duration(self.param("wait"))
            except ValueError:
                raise ConsulError(400, "Invalid wait time")
        return min_index, wait

    # ---- KV ----------------------------------------------------------------------------------

    def kv(self, method, key, body):
        if key and not self.server.args.lax_keys:
            problem = key_error_1_21_5(key)
            if problem:
                raise ConsulError(500, problem)
            problem = key_error(key)
            if problem:
                raise ConsulError(400, problem)
        if method == "GET":
            return self.kv_get(key)
        if method == "PUT":
            return self.kv_put(key, body)
        if method == "DELETE":
            return self.kv_delete(key)
        raise ConsulError(405, "method %s not allowed" % method)

    def kv_get(self, key):
        state = self.state
        min_index, wait = self.blocking_options()
        if self.has("keys"):
            sep = self.param("separator", self.param("seperator", "")) or ""

            def run():
                idx, entries = state.kv_list(key)
                entries = self.readable(entries)
                keys, seen = [], set()
                for e in entries:
                    if not sep:
                        keys.append(e["Key"])
                        continue
                    after = e["Key"][len(key):]
                    cut = after.find(sep)
                    k = e["Key"][:len(key) + cut + len(sep)] if cut >= 0 else e["Key"]
                    if k not in seen:
                        seen.add(k)
                        keys.append(k)
                return idx, keys
            index, keys = state.blocking(min_index, wait, run,
                                         lambda kind, n: kind == "kv" and n.startswith(key), self.client_gone)
            headers = self.meta(index)
            if self.filtered:
                headers["X-Consul-Results-Filtered-By-ACLs"] = "true"
            if not keys and key:
                return self.send(404, headers=headers)
            return self.send_json(200, keys, headers)
        if self.has("recurse"):
            def run():
                idx, entries = state.kv_list(key)
                return idx, [state.entry_text(e) for e in self.readable(entries)]
            index, entries = state.blocking(min_index, wait, run,
                                            lambda kind, n: kind == "kv" and n.startswith(key), self.client_gone)
            if min_index == 0:
                state.race_under(key, prefix=True)  # TEST-ONLY: /v1/test-stand-in/race
            headers = self.meta(index)
            if self.filtered:
                headers["X-Consul-Results-Filtered-By-ACLs"] = "true"
            if not entries:
                return self.send(404, headers=headers)
            # The same text as send_json of the entries: each is its compact JSON already.
            return self.send(200, "[" + ",".join(entries) + "]", headers=headers)
        if not key:
            raise ConsulError(400, "Missing key name")

        def run():
            idx, e = state.kv_get(key)
            return idx, e
        # KVS.Get: refused by the query's first run, so a blocking one is refused at once too.
        self.require(self.may_read_key(key))
        index, e = state.blocking(min_index, wait, run,
                                  lambda kind, n: kind == "kv" and n == key, self.client_gone)
        if e is None:
            return self.send(404, headers=self.meta(index))
        if self.has("raw"):
            headers = self.meta(index)
            headers["X-Content-Type-Options"] = "nosniff"
            headers["Content-Security-Policy"] = "sandbox"
            return self.send(200, e["Value"] or b"", content_type="text/plain", headers=headers)
        answer = [state.entry_json(e)]
        if min_index == 0:
            state.race_under(key)  # TEST-ONLY: a no-op unless /v1/test-stand-in/race named the key
        return self.send_json(200, answer, self.meta(index))

    def readable(self, entries):
        """FilterDirEnt: the entries the token may read (self.filtered: some were not)."""
        kept = [e for e in entries if self.may_read_key(e["Key"])]
        self.filtered = len(kept) != len(entries)
        return kept

    def conflicting(self, *names):
        if sum(1 for n in names if self.has(n)) > 1:
            raise ConsulError(400, "Conflicting flags: %s\n" % urllib.parse.urlencode(
                sorted((k, v) for k, vs in self.params.items() for v in vs)))

    def kv_put(self, key, body):
        if not key:
            raise ConsulError(400, "Missing key name")
        self.conflicting("cas", "acquire", "release")
        entry = {"Key": key, "Flags": 0, "Value": body or None, "Session": "", "LockIndex": 0}
        op, cas = "set", None
        if self.has("flags"):
            entry["Flags"] = self.uint_param("flags", 'strconv.ParseUint: parsing "%s": invalid '
                                             'syntax' % self.param("flags"))
        if self.has("cas"):
            cas = self.uint_param("cas", 'strconv.ParseUint: parsing "%s": invalid syntax'
                                  % self.param("cas"))
            op = "cas"
        if self.has("acquire"):
            entry["Session"] = self.param("acquire")
            op = "lock"
        if self.has("release"):
            entry["Session"] = self.param("release")
            op = "unlock"
        if len(body) > KV_MAX_VALUE_SIZE:
            raise ConsulError(413, "Request body(%d bytes) too large, max size: %d bytes."
                              % (len(body), KV_MAX_VALUE_SIZE))
        self.require(self.policy is None or self.policy.key_write(key))
        ok = self.state.kv_write(op, entry, cas)
        self.send_json(200, True if op == "set" else ok)

    def kv_delete(self, key):
        self.conflicting("recurse", "cas")
        entry = {"Key": key}
        op, cas = "delete", None
        if self.has("recurse"):
            op = "delete-tree"
        elif not key:
            raise ConsulError(400, "Missing key name")
        if self.has("cas"):
            cas = self.uint_param("cas", 'strconv.ParseUint: parsing "%s": invalid syntax'
                                  % self.param("cas"))
            op = "delete-cas"
        self.require(not consul_acl.txn_op_denied(self.policy, op, key))
        ok = self.state.kv_write(op, entry, cas)
        self.send_json(200, ok if op == "delete-cas" else True)

    # ---- sessions ----------------------------------------------------------------------------

    def session(self, method, rest, body):
        state = self.state
        action, _, arg = rest.partition("/")
        if action == "create":
            if method != "PUT":
                raise ConsulError(405, "method %s not allowed" % method)
            return self.session_create(body)
        if action in ("destroy", "renew"):
            if method != "PUT":
                raise ConsulError(405, "method %s not allowed" % method)
            if not arg:
                raise ConsulError(400, "Missing session")
            existing = state.sessions.get(arg)
            if action == "destroy":
                if self.policy is not None:  # Session.Apply looks the session up first
                    if existing is None:
                        raise ConsulError(500, 'Unknown session "%s"' % arg)
                    self.require(self.policy.session_write(existing["Node"]))
                state.session_destroy(arg)
                return self.send_json(200, True)
            if existing is not None and self.policy is not None:
                self.require(self.policy.session_write(existing["Node"]))
            s = state.session_renew(arg)
            if s is None:
                raise ConsulError(404, "Session id '%s' not found" % arg)
            return self.send_json(200, [state.public_session(s)])
        if action in ("info", "list", "node"):
            if method != "GET":
                raise ConsulError(405, "method %s not allowed" % method)
            if action != "list" and not arg:
                raise ConsulError(400, "Missing session" if action == "info" else
                                  "Missing node name")
            min_index, wait = self.blocking_options()

            def run():
                if action == "info":
                    s = state.sessions.get(arg)
                    found = [s] if s else []
                elif action == "node":
                    found = [s for s in state.sessions.values() if s["Node"] == arg]
                else:
                    found = list(state.sessions.values())
                found.sort(key=lambda s: s["ID"])
                if self.policy is not None:
                    found = [s for s in found if self.policy.session_read(s["Node"])]
                return state.sessions_index, [state.public_session(s) for s in found]
            if action == "info":
                def watches(kind, name):
                    return kind == "session" and name == arg
            else:
                def watches(kind, name):
                    return kind == "session"
            index, found = state.blocking(min_index, wait, run, watches)
            return self.send_json(200, found, self.meta(index))
        raise ConsulError(404, "no such endpoint in the Consul test stand-in: /v1/session/" + rest)

    def session_create(self, body):
        args = self.server.args
        req = {}
        if body:
            try:
                req = json.loads(body)
            except ValueError as err:
                raise ConsulError(400, "Request decode failed: %s" % err)
            if not isinstance(req, dict):
                raise ConsulError(400, "Request decode failed: not a JSON object")
        lock_delay = DEFAULT_LOCK_DELAY * 1e9
        raw = ci_get(req, "LockDelay")
        if isinstance(raw, str):
            try:
                lock_delay = parse_go_duration(raw) * 1e9
            except ValueError as err:
                raise ConsulError(400, "Request decode failed: %s" % err)
        elif isinstance(raw, (int, float)) and not isinstance(raw, bool):
            lock_delay = float(raw)
        if lock_delay < LOCK_DELAY_MIN_THRESHOLD:
            lock_delay *= 1e9
        behavior = ci_get(req, "Behavior") or "release"
        if behavior not in ("release", "delete"):
            raise ConsulError(500, "Invalid Behavior setting '%s'" % behavior)
        ttl = ci_get(req, "TTL") or ""
        ttl_seconds = 0.0
        if ttl:
            try:
                ttl_seconds = parse_go_duration(ttl)
            except ValueError as err:
                raise ConsulError(500, "Session TTL '%s' invalid: %s" % (ttl, err))
            ttl_min = self.server.args.session_ttl_min
            if ttl_seconds != 0 and not ttl_min <= ttl_seconds <= SESSION_TTL_MAX:
                raise ConsulError(500, "Invalid Session TTL '%d', must be between [%s=%s]" % (
                    round(ttl_seconds * 1e9), go_duration_string(ttl_min),
                    go_duration_string(SESSION_TTL_MAX)))
        checks = ["serfHealth"]
        node_checks = ci_get(req, "NodeChecks")
        if ci_get(req, "Checks") is not None:
            checks = ci_get(req, "Checks")
        elif node_checks is not None:
            checks = node_checks
        elif any(k.lower() == "checks" for k in req):
            checks = []
        s = {
            "Name": ci_get(req, "Name") or "",
            "Node": ci_get(req, "Node") or args.node_name,
            "LockDelay": int(round(lock_delay)),
            "Behavior": behavior,
            "TTL": ttl,
            "NodeChecks": checks,
            "ServiceChecks": ci_get(req, "ServiceChecks"),
            "_ttl_seconds": ttl_seconds,
        }
        if self.policy is not None:
            self.require(self.policy.session_write(s["Node"]))
        sid = self.state.session_create(s)
        self.send_json(200, {"ID": sid})

    # ---- transactions ------------------------------------------------------------------------

    def txn(self, body):
        try:
            raw_ops = json.loads(body or b"null")
            if not isinstance(raw_ops, list):
                raise ValueError("a transaction is a JSON array of operations")
        except ValueError as err:
            raise ConsulError(400, "Failed to parse body: %s" % err)
        if len(raw_ops) > MAX_TXN_OPS:
            raise ConsulError(413, "Transaction contains too many operations (%d > %d)"
                              % (len(raw_ops), MAX_TXN_OPS))
        ops, writes = [], 0
        for raw in raw_ops:
            kv = ci_get(raw, "KV") if isinstance(raw, dict) else None
            if not isinstance(kv, dict):
                raise ConsulError(400, "the Consul test stand-in implements KV operations only")
            value = ci_get(kv, "Value")
            try:
                value = base64.b64decode(value, validate=True) if value is not None else None
            except (ValueError, TypeError) as err:
                raise ConsulError(400, "Failed to parse body: failed to decode value: %s" % err)
            op = {"Verb": ci_get(kv, "Verb") or "", "Key": ci_get(kv, "Key") or "",
                  "Value": value or None, "Flags": int(ci_get(kv, "Flags") or 0),
                  "Index": int(ci_get(kv, "Index") or 0), "Session": ci_get(kv, "Session") or ""}
            if op["Verb"] in TXN_WRITE_VERBS:
                writes += 1
            ops.append(op)
        denied = [{"OpIndex": i, "What": consul_acl.PERMISSION_DENIED} for i, op in enumerate(ops)
                  if consul_acl.txn_op_denied(self.policy, op["Verb"], op["Key"])]
        results, errors = self.state.txn(ops, writes, denied)
        if results:
            results = [r for r in results if self.may_read_key(r["KV"]["Key"])]
        headers = {"X-Consul-KnownLeader": "true", "X-Consul-LastContact": "0"} if not writes \
            else None
        if errors:
            return self.send_json(409, {"Results": None, "Errors": errors}, headers)
        for op in ops:  # TEST-ONLY: /v1/test-stand-in/race
            if op["Verb"] in ("get", "get-or-empty", "get-tree"):
                self.state.race_under(op["Key"], prefix=op["Verb"] == "get-tree")
        return self.send_json(200, {"Results": results, "Errors": None}, headers)


# What Consul answers a connection over limits.http_max_conns_per_client (hashicorp/go-connlimit's
# HTTPConnStateFuncWithDefault429Handler, as agent/agent.go installs it on the HTTP server's
# ConnState): written at once, before the request is read, then the connection is closed.
TOO_MANY_CONNS_MSG = b"Your IP is issuing too many concurrent connections, please rate limit your calls\n"
TOO_MANY_CONNS = (b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
                  b"Connection: close\r\n\r\n%s" % (len(TOO_MANY_CONNS_MSG), TOO_MANY_CONNS_MSG))


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    max_conns_per_client = 0   # limits.http_max_conns_per_client (0: none), set by main()
    # Consul's HTTP server is Go's net/http, whose listener takes the kernel's somaxconn (4096 on
    # Debian 12) as its backlog: a burst of a thousand waiters' connections queues there instead
    # of being dropped (a SYN dropped waits a second or more for its resend).
    request_queue_size = 4096

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.conns_lock = threading.Lock()
        self.conns = {}  # client IP -> connections open now (go-connlimit's Limiter, by IP)

    def process_request(self, request, client_address):
        """go-connlimit's Accept at StateNew: over the limit, the 429 and the connection closed."""
        ip = client_address[0]
        with self.conns_lock:
            open_now = self.conns.get(ip, 0)
            over = 0 < self.max_conns_per_client <= open_now
            if not over:
                self.conns[ip] = open_now + 1
        if not over:
            return super().process_request(request, client_address)
        self.state.count("http connections over the limit")
        try:
            request.settimeout(0.01)  # Consul's write deadline: 10 ms
            request.sendall(TOO_MANY_CONNS)
        except OSError:
            pass
        self.shutdown_request(request)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.conns_lock:  # StateClosed: freeConn
                left = self.conns.get(client_address[0], 1) - 1
                if left > 0:
                    self.conns[client_address[0]] = left
                else:
                    self.conns.pop(client_address[0], None)


def main():
    parser = argparse.ArgumentParser(
        description="A Consul HTTP API TEST STAND-IN (not Consul) for turnstile's tests.")
    parser.add_argument("--bind", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8500, help="0: any free port")
    parser.add_argument("--port-file", help="write the port listened on here once ready")
    parser.add_argument("--data-dir", help="keep the Raft state here across restarts")
    parser.add_argument("--acl-token", default=os.environ.get("CONSUL_TEST_ACL_TOKEN", ""),
                        help="the management token; every request needs it")
    parser.add_argument("--acl-tokens", default=os.environ.get("CONSUL_TEST_ACL_TOKENS", ""),
                        help="JSON: more tokens and their rules (see consul_acl.py)")
    parser.add_argument("--node-name", default="consul-test-node")
    parser.add_argument("--datacenter", default="dc1")
    parser.add_argument("--initial-index", type=int, default=10)
    # Consul's server option session_ttl_min (default 10s): the turnstile tests lower it, so
    # that a killed holder's session ends within their short bounds.
    parser.add_argument("--session-ttl-min", type=parse_go_duration, default=SESSION_TTL_MIN)
    # Consul's tombstone_ttl (15 min): deleted keys' tombstones are reaped after it. The
    # benchmarks lower it, so that the graveyard of many short-lived keys stays small.
    parser.add_argument("--tombstone-ttl", type=parse_go_duration,
                        default=parse_go_duration(os.environ.get("CONSUL_TEST_TOMBSTONE_TTL", "15m")))
    # Consul's limits.http_max_conns_per_client (default 200): connections open at once from one
    # client IP; one more is answered 429 and closed (0: no limit).
    parser.add_argument("--http-max-conns-per-client", type=int,
                        default=int(os.environ.get("CONSUL_TEST_HTTP_MAX_CONNS_PER_CLIENT", "200")))
    parser.add_argument("--lax-keys", action="store_true",
                        help="accept any key, as Consul before its key validation did")
    parser.add_argument("--verbose", action="store_true", help="log every request")
    args = parser.parse_args()

    state = State(args)
    server = Server((args.bind, args.port), Handler)
    server.state = state
    server.args = args
    server.max_conns_per_client = args.http_max_conns_per_client
    consul_acl.tokens(args.acl_tokens)  # refused at start when malformed
    threading.Thread(target=state.reaper, daemon=True, name="session-ttl").start()

    def stop(signum, frame):
        threading.Thread(target=server.shutdown, daemon=True).start()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    port = server.server_address[1]
    if args.port_file:
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write("%d\n" % port)
        os.replace(tmp, args.port_file)
    log("Consul HTTP API test stand-in (not Consul) listening on %s:%d, index %d%s"
        % (args.bind, port, state.raft_index, ", ACLs enforced" if args.acl_token else ""))
    server.serve_forever(poll_interval=0.2)
    log("stopped")


if __name__ == "__main__":
    main()
