// SPDX-License-Identifier: Apache-2.0
// The one queue algorithm's vocabulary: entry kinds, a contender's request, and the predicate
// that says who holds and whom a waiter waits for (queue.cpp).
#pragma once

#include <cstdint>
#include <optional>
#include <stop_token>
#include <string>
#include <vector>

namespace turnstile::detail {

enum class EntryKind : std::uint8_t { exclusive = 1, shared = 2, lease = 3 };

const char* to_string(EntryKind kind);

// Which public primitive a request comes from (declared in turnstile/lock.hpp, whose lock types
// carry it). The queue is the same for all; the core's reentrancy rules tell a Mutex from a
// RecursiveMutex, and a backend that shares its layout with a peer may name entries after it
// (Curator names a read/write lock's nodes differently from a mutex's, a reentrant one's alike).
// An election's candidates are exclusive entries (the head leads) with a value each.
enum class Primitive : std::uint8_t { mutex, recursive_mutex, shared_mutex, semaphore, election };

// What a queue is used as while it has entries: one name is never two of a lock, a Semaphore
// and an election at once, nor a Semaphore with two limits.
enum class QueueMode : std::uint8_t { none, lock, semaphore, election };

const char* to_string(QueueMode mode);

// One contender joining a name's queue.
struct QueueRequest {
  std::string name;
  EntryKind kind = EntryKind::exclusive;
  std::int64_t permits = 1;  // leases only
  std::int64_t limit = 0;    // leases only: the Semaphore's limit
  Primitive primitive = Primitive::mutex;
  // An election candidate's value (Primitive::election only): at most max_election_value bytes,
  // checked by the core before any backend call.
  std::string value{};
  // Requested by the caller (a signal in the CLI, a shutting-down service): the waiter leaves
  // the queue and acquire returns nullptr, as on a deadline. Backends wake on it while waiting.
  std::stop_token stop{};
  // A try whose "not admitted" may be a guess (an async acquire's try on the calling thread,
  // ClientState::try_here: the acquire that follows waits properly): the backend need not make
  // sure those ahead are alive first (file:// skips its sweep of dead entries, which costs a
  // kernel lock query per entry under the name's mutex). Never admits more than a plain try.
  bool optimistic_try = false;
};

// Where a contender stands in a queue, backend-neutral (the Curator insight: one queue
// algorithm, a predicate per primitive).
struct QueueEntryView {
  EntryKind kind;
  std::int64_t permits;
};

enum class WaitFor {
  nothing,           // admitted
  leave,             // the entry at `index` leaving (or dying)
  exclusive_end,     // the entry at `index` leaving or downgrading to shared
  admission,         // the entry at `index` being admitted (or leaving)
  any_holder_leave,  // any entry ahead leaving: every one ahead holds, none is enough alone
};

struct Verdict {
  WaitFor wait = WaitFor::nothing;
  std::size_t index = 0;
  bool admitted() const { return wait == WaitFor::nothing; }
};

// entries[0..mine] are the live entries up to and including ours, in queue order.
Verdict evaluate_queue(const std::vector<QueueEntryView>& entries, std::size_t mine, std::int64_t limit);

// The mode a request puts an empty queue in.
QueueMode mode_of(const QueueRequest& request);

// Checks a request against a queue that already has `mode` (with `limit`, for a semaphore).
// Throws KindMismatch or LimitMismatch.
void check_queue_mode(const QueueRequest& request, QueueMode mode, std::int64_t limit);

// PermitCounter: a line of waiters in arrival order; the first takes its permits once the value
// has them, the others wait for the one just ahead (so a large request is not starved).
enum class CounterWait {
  nothing,      // take the permits now
  value,        // the value changing (we are first in line, or the line is empty)
  predecessor,  // the waiter just ahead leaving
};
CounterWait evaluate_counter_line(std::size_t ahead, std::optional<std::int64_t> value, std::int64_t permits);

}  // namespace turnstile::detail
