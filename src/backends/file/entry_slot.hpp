// SPDX-License-Identifier: Apache-2.0
// What every entry of a state file's queue does alike: its fencing token, its slot and its
// lock bytes (see state.hpp for the layout, EntryFd for the description that owns them).
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
QueueScan& scan_queue(const StateFile& file, std::uint64_t seq);

// Under the guard: removes our slot and drops its bytes (StateFile::let_go).
void remove_slot(StateFile& file, std::uint64_t& seq, EntryFd& fd);

// Leaves the queue or the line (never throws).
void leave_slot(StateFile& file, std::uint64_t& seq, EntryFd& fd) noexcept;

}  // namespace turnstile::detail::file_state
