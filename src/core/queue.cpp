// SPDX-License-Identifier: Apache-2.0
// The one queue algorithm behind every primitive: who holds, and whom a waiter waits for.
#include <algorithm>

#include "core/queue.hpp"
#include "turnstile/error.hpp"

namespace turnstile::detail {

const char* to_string(EntryKind kind) {
  switch (kind) {
    case EntryKind::exclusive: return "exclusive";
    case EntryKind::shared: return "shared";
    case EntryKind::lease: return "lease";
  }
  return "unknown";
}

Verdict evaluate_queue(const std::vector<QueueEntryView>& entries, std::size_t mine, std::int64_t limit) {
  const auto& me = entries[mine];
  switch (me.kind) {
    case EntryKind::exclusive:
      // Held when first; waits for the entry just ahead (which may itself be waiting).
      if (mine == 0) return {};
      return {WaitFor::leave, mine - 1};
    case EntryKind::shared:
      // Held when no writer is ahead; waits for the nearest writer ahead to finish writing.
      for (std::size_t i = mine; i-- > 0;) {
        if (entries[i].kind == EntryKind::exclusive) return {WaitFor::exclusive_end, i};
      }
      return {};
    case EntryKind::lease: {
      // Held when the permits of everyone ahead plus ours fit the limit. Since every waiter
      // ahead already failed that test, "fits" also means everyone ahead holds: FIFO.
      // Overflow-free: counts written by peers may be anything, so each is taken as at least 1
      // and the sum stops growing once it passes the limit.
      const auto permits_of = [](const QueueEntryView& entry) { return std::max<std::int64_t>(entry.permits, 1); };
      std::int64_t ahead = 0;  // never above limit: `over` records that the sum passed it
      bool over = limit < 0;
      for (std::size_t i = 0; i < mine && !over; ++i) {
        const auto permits = permits_of(entries[i]);
        if (permits > limit - ahead) over = true;
        else ahead += permits;
      }
      if (!over && permits_of(me) <= limit - ahead) return {};
      if (over && mine > 0) return {WaitFor::admission, mine - 1};  // our predecessor waits too
      return {WaitFor::any_holder_leave, 0};
    }
  }
  return {};
}

const char* to_string(QueueMode mode) {
  switch (mode) {
    case QueueMode::none: return "";
    case QueueMode::lock: return "lock";
    case QueueMode::semaphore: return "semaphore";
    case QueueMode::election: return "election";
  }
  return "unknown";
}

QueueMode mode_of(const QueueRequest& request) {
  if (request.primitive == Primitive::election) return QueueMode::election;
  return request.kind == EntryKind::lease ? QueueMode::semaphore : QueueMode::lock;
}

CounterWait evaluate_counter_line(std::size_t ahead, std::optional<std::int64_t> value, std::int64_t permits) {
  if (ahead > 0) return CounterWait::predecessor;
  return value && *value >= permits ? CounterWait::nothing : CounterWait::value;
}

namespace {
// How a queue in `mode` is named to a contender that cannot join it.
std::string in_use_as(QueueMode mode) {
  switch (mode) {
    case QueueMode::lock: return "a lock";
    case QueueMode::semaphore: return "a Semaphore";
    case QueueMode::election: return "an election";
    case QueueMode::none: break;
  }
  return "something else";
}
}  // namespace

void check_queue_mode(const QueueRequest& request, QueueMode mode, std::int64_t limit) {
  if (mode == QueueMode::none) return;
  const auto wanted = mode_of(request);
  if (wanted != mode) {
    throw KindMismatch("'" + request.name + "' is in use as " + in_use_as(mode) + "; it cannot be " +
                       in_use_as(wanted) + " at the same time");
  }
  if (wanted == QueueMode::semaphore && limit != request.limit) {
    throw LimitMismatch("Semaphore '" + request.name + "' is in use with limit " + std::to_string(limit) +
                        "; this contender asked for limit " + std::to_string(request.limit));
  }
}

}  // namespace turnstile::detail
