// The one queue algorithm's vocabulary: entry kinds, a contender's request, and the predicate
// that says who holds and whom a waiter waits for (queue.cpp).
#pragma once

#include <cstdint>
#include <stop_token>
#include <string>
#include <vector>

namespace turnstile::detail {

enum class EntryKind : std::uint8_t { exclusive = 1, shared = 2, lease = 3 };

const char* to_string(EntryKind kind);

// One contender joining a name's queue.
struct QueueRequest {
  std::string name;
  EntryKind kind = EntryKind::exclusive;
  std::int64_t permits = 1;  // leases only
  std::int64_t limit = 0;    // leases only: the Semaphore's limit
  // Asked through a SharedMutex (a writer or a reader) rather than a Mutex: same queue, but
  // peers like Curator name a read/write lock's nodes differently.
  bool shared_mutex = false;
  // Requested by the caller (a signal in the CLI, a shutting-down service): the waiter leaves
  // the queue and acquire returns nullptr, as on a deadline. Backends wake on it while waiting.
  std::stop_token stop;
};

// Where a contender stands in a queue, backend-neutral (the Curator insight: one queue
// algorithm, a predicate per primitive).
struct QueueEntryView {
  EntryKind kind;
  std::int64_t permits;
};

enum class WaitFor {
  nothing,          // admitted
  leave,            // the entry at `index` leaving (or dying)
  exclusive_end,    // the entry at `index` leaving or downgrading to shared
  admission,        // the entry at `index` being admitted (or leaving)
  any_holder_leave, // any entry ahead leaving: every one ahead holds, none is enough alone
};

struct Verdict {
  WaitFor wait = WaitFor::nothing;
  std::size_t index = 0;
  bool admitted() const { return wait == WaitFor::nothing; }
};

// entries[0..mine] are the live entries up to and including ours, in queue order.
Verdict evaluate_queue(const std::vector<QueueEntryView>& entries, std::size_t mine, std::int64_t limit);

// Checks a request against a queue that already has `mode` ("lock"/"semaphore"/"") and limit.
// Throws KindMismatch or LimitMismatch.
void check_queue_mode(const QueueRequest& request, const std::string& mode, std::int64_t limit);

}  // namespace turnstile::detail
