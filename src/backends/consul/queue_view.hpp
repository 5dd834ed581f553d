// SPDX-License-Identifier: Apache-2.0
// One read of a queue (turnstile/q/<name>/), parsed once for every waiter of the client that
// decides on it (queue_view.cpp): a client's thousands of waiters on one name look at the
// answer of its one shared blocking query (blocking_queries.hpp) instead of each reading and
// parsing the whole queue again.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backends/consul/keys.hpp"
#include "backends/consul/layout.hpp"

namespace turnstile::detail::consul {

// What a look needs of one entry (its value's JSON parsed once).
struct QueuedEntry {
  std::string key;
  std::string session;
  std::uint64_t create_index = 0;
  std::uint64_t modify_index = 0;
  EntryKind kind = EntryKind::exclusive;
  std::int64_t permits = 1;
  std::int64_t limit = 0;
  std::vector<std::string> sessions;  // a lease's permit sessions
  bool election = false;              // an election candidate (its queue is an election's)
};

// The entries directly under the queue's prefix, by CreateIndex, as Consul had them at `index`
// (X-Consul-Index of the read; for a read without one, the highest ModifyIndex it returned: the
// state read was at least that new).
struct QueueView {
  std::uint64_t index = 0;
  std::vector<QueuedEntry> entries;
};

// `entries` may hold other keys (a transaction's other reads, a nested name's queue): only the
// queue's own are kept. `index` 0: the highest ModifyIndex among them. An entry `previous` has
// unchanged (key and ModifyIndex) is copied from it rather than its value parsed again.
QueueView make_queue_view(const std::vector<KvEntry>& entries, const std::string& prefix, std::uint64_t index,
                          const QueueView* previous = nullptr);

}  // namespace turnstile::detail::consul
