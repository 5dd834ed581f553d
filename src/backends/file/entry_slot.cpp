// SPDX-License-Identifier: Apache-2.0
// An entry's slot and lock bytes (entry_slot.hpp).
#include "backends/file/entry_slot.hpp"

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>

#include "turnstile/error.hpp"

namespace turnstile::detail::file_state {

// The fencing token (and sequence number) of a new entry: max(last + 1, CLOCK_REALTIME in µs),
// as on Redis. Strictly increasing while the state file lives, and still above every earlier
// token of the name when the file was removed, truncated or replaced (a cleaner, rm -rf), as
// long as the clock was not stepped back by more than the time since the last token.
// (2^40 + 4·token stays below the largest lock offset, 2^63 - 1, for some 70,000 years.)
std::uint64_t next_token(const Header& h) {
  const auto now_us = static_cast<std::uint64_t>(std::max<std::int64_t>(realtime_ns() / 1000, 0));
  return std::max(h.next_seq + 1, now_us);
}

QueueMode queue_mode(Mode mode) {
  switch (mode) {
    case Mode::lock: return QueueMode::lock;
    case Mode::semaphore: return QueueMode::semaphore;
    case Mode::election: return QueueMode::election;
    case Mode::none: break;
  }
  return QueueMode::none;
}

[[noreturn]] void throw_full(const std::string& name) {
  throw QueueFull("'" + name + "' already has " + std::to_string(kMaxCapacity) + " contenders");
}

Slot new_slot(std::uint64_t seq, std::int64_t permits, std::uint8_t kind) {
  return Slot{.seq = seq,
              .permits = permits,
              .since_ns = realtime_ns(),
              .pid = my_pid(),
              .kind = kind,
              .flags = 0,
              .label = 0,
              .kept_until_ns = 0};
}

QueueScan& scan_queue(const StateFile& file, std::uint64_t seq) {
  thread_local QueueScan scan;
  scan.views.clear();
  scan.seqs.clear();
  const std::size_t n = file.count();
  for (std::size_t i = 0; i < n; ++i) {
    const auto& slot = file.slot(i);
    if (slot.kind == kCounterWaiter) continue;
    scan.views.push_back({static_cast<EntryKind>(slot.kind), slot.permits});
    scan.seqs.push_back(slot.seq);
    if (slot.seq == seq) break;
  }
  return scan;
}

// Under the guard: removes our slot and drops its bytes; the description goes back to the pool
// (or, shared, stays with the other entries on it).
void remove_slot(StateFile& file, std::uint64_t& seq, EntryFd& fd) {
  file.local_entries().dropped(seq, kAllBytes);  // its armed waiters wake as the guard ends
  file.remove(seq);
  file.let_go(fd, std::exchange(seq, 0));
}

// Leaves the queue or the line (never throws). Bytes that could not be dropped under the guard
// are dropped without it: whoever finds the slot then removes it as dead.
void leave_slot(StateFile& file, std::uint64_t& seq, EntryFd& fd) noexcept {
  if (seq != 0) {
    try {
      StateFile::Guard guard(file);
      remove_slot(file, seq, fd);
    } catch (...) {
      file.local_entries().abandon();  // its waiters look again (and watch bytes from now on)
    }
  }
  file.let_go(fd, std::exchange(seq, 0));
}

}  // namespace turnstile::detail::file_state
