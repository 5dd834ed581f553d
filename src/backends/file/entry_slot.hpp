// What every entry of a state file's queue does alike: its fencing token, its slot and its
// lock bytes on a description of its own (see state.hpp for the layout).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backends/file/state_file.hpp"
#include "core/queue.hpp"

namespace turnstile::detail::file_state {

// The fencing token (and sequence number) of a new entry: strictly increasing, even across a
// removed or replaced state file (entry_slot.cpp says how).
std::uint64_t next_token(const Header& h);

QueueMode queue_mode(Mode mode);

[[noreturn]] void throw_full(const std::string& name);

// The slot of a new entry of `kind` (EntryKind or kCounterWaiter), made now by this process
// (its label is set when it is appended).
Slot new_slot(std::uint64_t seq, std::int64_t permits, std::uint8_t kind);

// The queue's entries up to and including the one with `seq` (all of them when no slot has it),
// PermitCounter waiters left out. Thread-local and reused: no allocation once warm.
struct QueueScan {
  std::vector<QueueEntryView> views;
  std::vector<std::uint64_t> seqs;
  bool reached(std::uint64_t seq) const { return !seqs.empty() && seqs.back() == seq; }
};
QueueScan& scan_queue(const Header& h, std::uint64_t seq);

// Drops all of a description's locks (it holds only one entry's bytes).
bool unlock_all(const Fd& fd);

// Under the guard: removes our slot and drops its bytes; the description goes back to the pool.
void remove_slot(StateFile& file, std::uint64_t& seq, Fd& fd);

// Leaves the queue or the line (never throws).
void leave_slot(StateFile& file, std::uint64_t& seq, Fd& fd) noexcept;

// Whether a state file we hold open was removed from the tree, or is no longer whole.
bool stale(int fd);

}  // namespace turnstile::detail::file_state
