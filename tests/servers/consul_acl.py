# SPDX-License-Identifier: Apache-2.0
"""ACL policies of the Consul test stand-in (consul_server.py beside this file). NOT Consul.

Decided as Consul's acl package decides them (acl/policy_authorizer.go, with default_policy
"deny"), for the rules a lock client meets:
  * key "K" (exact) and key_prefix "P" rules, each "deny", "read", "list" or "write". A key's
    level is its exact rule if there is one, else the longest prefix rule that matches it, else
    deny. read and list allow reading, only write allows writing.
  * KeyWritePrefix (a recursive delete): write on the prefix, and no rule for anything under it
    that is less than write.
  * session "NODE" / session_prefix "P" rules the same way, for the node a session is on.
A token's rules are given as JSON, by token:
  {"TOKEN": {"key_prefix": {"turnstile/": "write", "": "read"}, "session_prefix": {"": "write"}}}
(--acl-tokens or CONSUL_TEST_ACL_TOKENS; "@FILE": read from FILE at every request, so a test
can change a token's rules as an operator updates its policy). The management token (--acl-token) may do anything;
no token is the anonymous token, which may do nothing.

Where Consul asks (agent/consul/kvs_endpoint.go kvsPreApply, txn_endpoint.go preCheck,
session_endpoint.go): a txn's get, get-tree and get-or-empty are not checked but their results
are filtered;
check-session and check-index need read; delete-tree needs KeyWritePrefix; every other verb
(set, cas, lock, unlock, delete, delete-cas, check-not-exists) needs write.
"""

import json

LEVELS = ("deny", "read", "list", "write")
PERMISSION_DENIED = "Permission denied"


class Policy:
    """One token's rules; no rule that matches: deny."""

    def __init__(self, rules=None):
        rules = rules or {}
        self.rules = {}
        for kind in ("key", "key_prefix", "session", "session_prefix"):
            table = rules.get(kind) or {}
            for name, level in table.items():
                if level not in LEVELS:
                    raise ValueError("unknown ACL policy %r for %s %r" % (level, kind, name))
            self.rules[kind] = dict(table)

    def _level(self, kind, name):
        exact = self.rules[kind]
        if name in exact:
            return exact[name]
        prefixes = self.rules[kind + "_prefix"]
        best = max((p for p in prefixes if name.startswith(p)), key=len, default=None)
        return prefixes[best] if best is not None else "deny"

    def key_read(self, key):
        return self._level("key", key) != "deny"

    def key_write(self, key):
        return self._level("key", key) == "write"

    def key_write_prefix(self, prefix):
        if not self.key_write(prefix):
            return False
        below = [level for kind in ("key", "key_prefix") for name, level in self.rules[kind].items()
                 if name.startswith(prefix)]
        return all(level == "write" for level in below)

    def session_read(self, node):
        return self._level("session", node) != "deny"

    def session_write(self, node):
        return self._level("session", node) == "write"


ANONYMOUS = Policy()


def parse_tokens(text):
    """{token: Policy} from the JSON described above (empty text: none)."""
    if not text:
        return {}
    raw = json.loads(text)
    if not isinstance(raw, dict):
        raise ValueError("ACL tokens: a JSON object of token -> rules")
    return {token: Policy(rules) for token, rules in raw.items()}


def tokens(option):
    """The tokens of --acl-tokens: its JSON, or "@FILE"'s (read again each time)."""
    if option.startswith("@"):
        with open(option[1:]) as f:
            return parse_tokens(f.read())
    return parse_tokens(option)


def txn_op_denied(policy, verb, key):
    """kvsPreApply's ACL check of one txn KV operation: True when the token may not do it."""
    if policy is None:
        return False
    if verb == "delete-tree":
        return not policy.key_write_prefix(key)
    if verb in ("get", "get-tree", "get-or-empty"):
        return False  # filtered on the way out (kvsPreApply: KVGet, KVGetTree, KVGetOrEmpty)
    if verb in ("check-session", "check-index"):
        return not policy.key_read(key)
    return not policy.key_write(key)
