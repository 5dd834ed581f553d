// SPDX-License-Identifier: Apache-2.0
// What turnstile writes into Consul's KV store besides the peers' own layouts (layout.cpp): a
// queue entry's value, the api.Semaphore `.lock` document, and where a waiter sleeps.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "backends/consul/keys.hpp"
#include "core/queue.hpp"

namespace turnstile::detail::consul {

// A queue entry's value (JSON). `sessions`: once a lease holds, the session that holds its
// permits in `.lock` (one per lease, whatever its count).
struct EntryValue {
  EntryKind kind = EntryKind::exclusive;
  std::int64_t permits = 1;
  std::int64_t limit = 0;
  bool held = false;
  std::vector<std::string> sessions;
  std::int64_t pid = 0;
  std::string host;
  std::int64_t since_ms = 0;
  std::string label;  // ClientOptions::holder_label
  // Kept after its release (release_after) on a session nobody renews: the writer's estimate
  // of its end, for inspect. 0: not kept.
  std::int64_t kept_until_ms = 0;
  // An election candidate (Primitive::election): its proposal, the leader's value once it leads
  // (the leader's current value is the one in the api.Lock key NAME: election.hpp).
  bool election = false;
  std::string proposal;
};

std::string to_json(const EntryValue& value);
// A value nobody could parse reads as an exclusive entry (it still takes its place).
EntryValue entry_value(const std::string& json);

// api.Semaphore's `.lock` value: {"Limit":N,"Holders":{"<session>":true,...}}. api.Semaphore
// counts one permit per holder session; a turnstile lease holds any count on one session and
// writes it as the holder's value: `true` for 1 (what api.Semaphore writes), the number for more.
// api.Semaphore cannot decode a number, so while such a lease holds, its clients fail with an
// error rather than count it as one (they are never admitted past the limit).
struct SemaphoreLock {
  std::int64_t limit = 0;
  std::map<std::string, std::int64_t> holders;  // session -> permits (false: 0, true: 1)
  std::uint64_t modify_index = 0;               // 0: no .lock key yet (created by CAS with index 0)
};

std::string to_json(const SemaphoreLock& lock);
// Throws KindMismatch when the key is someone else's (other flags, or not the document).
SemaphoreLock semaphore_lock(const KvEntry& entry, const std::string& name);

// A PermitCounter's value (turnstile's own layout): {"n":N}. Earlier versions also kept the
// request ids of its last 32 changes in "r" (ignored now: each change has its own marker key,
// counter_markers.hpp); a plain decimal, as the first versions wrote it, reads as N.
struct CounterValue {
  std::int64_t n = 0;
};

std::string to_json(const CounterValue& value);
CounterValue counter_value_of(const std::string& text);

// The key a waiter blocks on (GET ?index=) until it changes: a predecessor's entry, the
// api.Lock key, or a Semaphore's prefix.
struct WaitTarget {
  std::string key;
  std::uint64_t index = 0;  // 0: unknown, look again at once
  bool recurse = false;
  bool retry = false;  // a lock-delay: wake after a short while even if nothing changes
  // A queue entry not looked at yet (a join that read nothing): woken by the client's shared
  // query's first answer at `index` or later, or at once when it has none.
  bool first_look = false;
};

}  // namespace turnstile::detail::consul
