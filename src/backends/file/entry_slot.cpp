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
  return mode == Mode::lock ? QueueMode::lock : mode == Mode::semaphore ? QueueMode::semaphore : QueueMode::none;
}

[[noreturn]] void throw_full(const std::string& name) {
  throw QueueFull("'" + name + "' already has " + std::to_string(kCapacity) + " contenders");
}

Slot new_slot(std::uint64_t seq, std::int64_t permits, std::uint8_t kind) {
  return Slot{.seq = seq,
              .permits = permits,
              .since_ns = realtime_ns(),
              .pid = my_pid(),
              .kind = kind,
              .reserved = 0,
              .label = 0};
}

QueueScan& scan_queue(const Header& h, std::uint64_t seq) {
  thread_local QueueScan scan;
  scan.views.clear();
  scan.seqs.clear();
  for (std::size_t i = 0; i < h.count; ++i) {
    const auto& slot = h.slots[i];
    if (slot.kind == kCounterWaiter) continue;
    scan.views.push_back({static_cast<EntryKind>(slot.kind), slot.permits});
    scan.seqs.push_back(slot.seq);
    if (slot.seq == seq) break;
  }
  return scan;
}

// Drops all of a description's locks (it holds only one entry's bytes): unlocking the whole file
// drops the same locks, and the kernel skips allocating the two lock records that splitting a
// range may need (a ranged unlock allocates them on every call).
bool unlock_all(const Fd& fd) { return set_lock(fd.get(), F_UNLCK, 0, 0, false); }

// Under the guard: removes our slot and drops its bytes; the description goes back to the pool.
void remove_slot(StateFile& file, std::uint64_t& seq, Fd& fd) {
  file.remove(std::exchange(seq, 0));
  if (fd && unlock_all(fd)) file.return_descriptor(std::move(fd));
  fd.reset();
}

// Leaves the queue or the line (never throws). A description whose locks could not be dropped
// is closed instead, which drops them: whoever finds the slot then removes it as dead.
void leave_slot(StateFile& file, std::uint64_t& seq, Fd& fd) noexcept {
  if (seq != 0) {
    try {
      StateFile::Guard guard(file);
      remove_slot(file, seq, fd);
    } catch (...) {
      seq = 0;
      fd.reset();
    }
  }
  if (fd) file.return_descriptor(std::move(fd));
}

// Whether a state file we hold open was removed from the tree, or is no longer whole.
bool stale(int fd) {
  struct stat st {};
  return fstat(fd, &st) != 0 || st.st_nlink == 0 || st.st_size != static_cast<off_t>(sizeof(Header));
}

}  // namespace turnstile::detail::file_state
