// SPDX-License-Identifier: Apache-2.0
// A client's blocking queries (?index=&wait=) without a thread per waiter (blocking_queries.cpp):
// every armed wait's queries run on ONE libcurl multi handle, driven by one I/O thread of the
// client (started at the first wait). Waits on entries of one queue share one query: a client's
// only waiter on a queue blocks on the entry it waits for (a release wakes that one query, in
// whichever process it waits); from its second waiter on, all of them wait on ONE recursive query
// of the queue, and each answer wakes only the waiters whose entry's ModifyIndex changed (so a
// release still wakes one waiter, and a client keeps one connection per queue, not per waiter:
// Consul allows 200 per client address, limits.http_max_conns_per_client). A wait's wake runs on that thread once, when
// the first of its queries ends: answered (the index moved, or Consul's wait time ran out), failed (then after a short
// pause, so that a server that drops every query is not asked again in a hot loop) or cut by its timeout. A wait
// without queries is a timer on the same thread. This is what QueuePlace::arm and CounterLine::arm use, and the
// blocking waits too (an arm and a condition variable): one implementation of Consul's waits.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backends/consul/http.hpp"
#include "backends/consul/queue_view.hpp"
#include "core/queue_store.hpp"

namespace turnstile::detail::consul {

// A wait's wake: null, or the typed error of an answer nobody expects (a 403 of the ACL, a
// 500): the waiter throws it where it would have thrown a blocking wait's. `answer`: the index
// of its queue's shared answer that woke it (its view is published first: view()), else 0.
using QueryWake = std::function<void(std::exception_ptr error, std::uint64_t answer)>;

// A wait on one entry of a queue (turnstile's own prefixes) that may share its client's one
// query on the whole queue: woken when the entry's ModifyIndex is no longer `index` (changed or
// gone). `query` is its own query's place in the plan's queries, sent instead while it is the
// client's only waiter on that queue.
struct SharedTarget {
  std::string prefix;  // the queue: the key up to its last '/'
  std::string key;
  std::uint64_t index = 0;
  std::size_t query = 0;
  // Woken by the queue's first answer at `index` or later instead (a join that has not seen
  // the queue yet: its first look is that answer's view).
  bool until_answer = false;
};

// What one wait sends: its queries (the first to end wakes it), each cut after `timeout`; no
// queries: a timer of `pause`. `wait` is the time Consul is asked to block (a shared target's
// wait ends then, as its own query would).
struct BlockingPlan {
  std::vector<Request> queries;
  std::vector<std::string> keys;  // each query's key, for errors
  std::chrono::milliseconds timeout{0};
  std::chrono::milliseconds pause{0};
  std::chrono::milliseconds wait{0};
  std::optional<SharedTarget> shared;
};

class BlockingQueries {
 public:
  explicit BlockingQueries(Endpoint endpoint);
  // Stops the I/O thread and cuts every query (their connections are closed); no wake runs
  // after it, an arm destroyed later only marks itself.
  ~BlockingQueries();
  BlockingQueries(const BlockingQueries&) = delete;
  BlockingQueries& operator=(const BlockingQueries&) = delete;

  // Sends `plan` from the I/O thread; `wake` runs there at most once, never inside arm(). The
  // arm's destruction disarms (QueuePlace::arm's contract): its queries are taken out of the
  // multi handle, and a wake running meanwhile is waited for. Throws BackendUnavailable when
  // libcurl cannot make a handle.
  std::unique_ptr<WakeArm> arm(BlockingPlan plan, QueryWake wake);

  // The last answer of the client's shared query on `prefix` when its index is `at_least` or
  // more, else null. Kept while the client has waiters on that queue's shared query.
  std::shared_ptr<const QueueView> view(const std::string& prefix, std::uint64_t at_least) const;

  // The number of I/O threads running (0 or 1), for the tests.
  std::size_t io_threads() const;

  class Loop;

 private:
  std::shared_ptr<Loop> loop_;
};

}  // namespace turnstile::detail::consul
