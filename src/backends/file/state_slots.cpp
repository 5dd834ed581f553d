// SPDX-License-Identifier: Apache-2.0
// The queue's slots in a state file, under its guard (state_file.hpp): appending (and growing
// the file when it is full), labels, removal, repair after a crash, and the liveness of entries.
// The crash-safety argument for each step is in docs/architecture.md ("The embedded backend").
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <bitset>
#include <cstring>
#include <set>

#include "backends/file/state_file.hpp"

namespace turnstile::detail::file_state {
namespace {

// Below this many slots' pages the storage is kept when the queue shrinks: the give-back's
// system call is for queues that grew large, not for every release of a short one.
constexpr std::size_t kKeptSlots = kFirstCapacity;

}  // namespace

// ---- room for slots --------------------------------------------------------------------------

void StateFile::fit_mapping() noexcept {
  const std::size_t wanted = std::atomic_ref<std::uint32_t>(header().capacity).load(std::memory_order_acquire);
  if (wanted == map_.capacity()) return;
  // Capacity only grows, in steps of kFirstCapacity: anything else was not written by turnstile.
  if (wanted < map_.capacity() || wanted > kMaxCapacity || wanted % kFirstCapacity != 0 ||
      !map_.extend(fd_.get(), wanted)) {
    broken_.store(true, std::memory_order_relaxed);
  }
}

// The file is extended before Header::capacity says so, and never shrunk: a process killed in
// between leaves a file larger than its capacity, which is read as it says (every check wants
// at least file_size(capacity) bytes) and extended to the same size by the next growth.
void StateFile::grow() {
  const auto larger = std::min(map_.capacity() * 2, kMaxCapacity);
  int error;
  do {
    error = ftruncate(fd_.get(), static_cast<off_t>(file_size(larger))) == 0 ? 0 : errno;
  } while (error == EINTR);
  if (error != 0) fail_io("cannot grow the queue of '" + name_ + "'", error);
  if (!map_.extend(fd_.get(), larger)) fail_io("cannot map the queue of '" + name_ + "'", ENOMEM);
  std::atomic_ref<std::uint32_t>(header().capacity)
      .store(static_cast<std::uint32_t>(larger), std::memory_order_release);
}

void StateFile::give_back_pages() {
  auto& h = header();
  if (h.slots_backed <= kKeptSlots || h.count > h.slots_backed / 4) return;
  // The page holding the last slot in use stays backed (the next append writes into it without
  // backing it: StateFile::append backs only pages it enters).
  const auto in_use_end = kSlotsOffset + std::size_t{h.count} * sizeof(Slot);
  const auto backed_end = kSlotsOffset + std::size_t{h.slots_backed} * sizeof(Slot);
  give_back_storage(fd_.get(), in_use_end, backed_end + kPage - in_use_end);
  h.slots_backed = h.count;
}

// ---- appending ---------------------------------------------------------------------------------

// The place of `label` in the table: the one that holds it already, else one no slot points to
// (0: none free, the entry goes without its label). Written before the slot pointing to it.
std::uint16_t StateFile::place_label(const std::string& label) {
  auto& h = header();
  const auto length = std::min(label.size(), kMaxLabel);
  const std::size_t written = std::min<std::size_t>(h.label_places, kLabelPlaces);
  for (std::size_t i = 0; i < written; ++i) {
    const auto& text = h.labels[i].text;
    if (strnlen(text, kMaxLabel + 1) == length && std::memcmp(text, label.data(), length) == 0) {
      return static_cast<std::uint16_t>(i + 1);
    }
  }
  std::bitset<kLabelPlaces> used;
  for (std::size_t i = 0; i < h.count; ++i) {
    const auto place = slot(i).label;
    if (place != 0 && place <= kLabelPlaces) used.set(place - 1u);
  }
  std::size_t free = 0;
  while (free < kLabelPlaces && used.test(free)) ++free;
  if (free == kLabelPlaces) return 0;
  back_with_storage(fd_.get(), offsetof(Header, labels) + free * sizeof(Label), length + 1, name_);
  std::memcpy(h.labels[free].text, label.data(), length);
  h.labels[free].text[length] = '\0';
  h.label_places = static_cast<std::uint32_t>(std::max<std::size_t>(written, free + 1));
  return static_cast<std::uint16_t>(free + 1);
}

// Writes whose order matters to a process that finds our state after we were killed between
// two of them: the compiler must not reorder them (the CPU commits a dead thread's stores too).
void StateFile::append(const Slot& entry, const std::string& label) {
  auto& h = header();
  if (h.count == map_.capacity()) grow();
  // A slot that reaches a page no slot reached before: backed first (see back_with_storage).
  const auto begin = kSlotsOffset + std::size_t{h.count} * sizeof(Slot);
  if ((begin + sizeof(Slot) - 1) / kPage != (begin - 1) / kPage) {
    back_with_storage(fd_.get(), begin, sizeof(Slot), name_);
  }
  if (h.count + 1 > h.slots_backed) h.slots_backed = h.count + 1;
  Slot& to = slot(h.count);
  to = entry;
  to.label = label.empty() ? 0 : place_label(label);
  h.next_seq = entry.seq;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  ++h.count;  // only after the slot is written: a crash leaves no half entry
}

std::string StateFile::label_of(const Slot& entry) const {
  if (entry.label == 0 || entry.label > kLabelPlaces) return {};
  const auto& text = map_.get()->labels[entry.label - 1u].text;
  return std::string(text, strnlen(text, kMaxLabel));
}

// ---- finding and removing ----------------------------------------------------------------------

std::ptrdiff_t StateFile::find(std::uint64_t seq) const {
  const std::size_t n = count();
  for (std::size_t i = 0; i < n; ++i) {
    if (slot(i).seq == seq) return static_cast<std::ptrdiff_t>(i);
  }
  return -1;
}

void StateFile::remove_at(std::size_t index) {
  // Slot by slot towards the front, each slot's seq cleared first and written last: killed at
  // any point, we leave complete slots (one possibly twice, identical) and at most one slot
  // with seq 0, which repair() drops. A memmove could leave a torn slot with a valid seq.
  auto& h = header();
  for (std::size_t i = index; i + 1 < h.count; ++i) {
    Slot& to = slot(i);
    const Slot& from = slot(i + 1);
    std::atomic_ref<std::uint64_t>(to.seq).store(0, std::memory_order_relaxed);
    std::atomic_signal_fence(std::memory_order_seq_cst);
    to.permits = from.permits;
    to.since_ns = from.since_ns;
    to.pid = from.pid;
    to.kind = from.kind;
    to.flags = from.flags;
    to.label = from.label;
    to.kept_until_ns = from.kept_until_ns;
    std::atomic_signal_fence(std::memory_order_seq_cst);
    std::atomic_ref<std::uint64_t>(to.seq).store(from.seq, std::memory_order_relaxed);
    std::atomic_signal_fence(std::memory_order_seq_cst);
  }
  --h.count;
  give_back_pages();
}

void StateFile::end_entry_at(std::size_t index) {
  const auto seq = slot(index).seq;
  const bool has_value = (slot(index).flags & kHasValue) != 0;
  remove_at(index);
  if (has_value && !broken()) unlinkat(root_fd_, value_file(seq).c_str(), 0);
}

void StateFile::remove(std::uint64_t seq) {
  if (const auto index = find(seq); index >= 0) end_entry_at(static_cast<std::size_t>(index));
  recompute_mode();
}

void StateFile::repair() {
  // The previous owner died while changing the queue. A slot is complete when its seq is not 0
  // (remove_at writes seq last); a seq seen twice is a slot caught mid-move, whose later copy
  // is the one never overwritten (moves go towards the front). Then drop dead entries. A growth
  // cut short left nothing to repair (StateFile::grow), and fit_mapping ran before this.
  auto& h = header();
  // Or it died removing the file as unused, between the unlink and the mark: no longer at its
  // path, the file is marked now, before anyone (each takes the mutex first) adds to it.
  if (!h.removed && !at_its_path()) std::atomic_ref<std::uint32_t>(h.removed).store(1, std::memory_order_release);
  if (h.count > map_.capacity()) h.count = static_cast<std::uint32_t>(map_.capacity());
  std::set<std::uint64_t> seen;
  for (std::size_t i = h.count; i-- > 0;) {
    const auto seq = slot(i).seq;
    if (seq == 0 || seq > h.next_seq || !seen.insert(seq).second) remove_at(i);
  }
  sweep_dead();
}

// ---- liveness ------------------------------------------------------------------------------------

bool StateFile::kept(const Slot& entry) { return entry.kept_until_ns != 0 && entry.kept_until_ns > boottime_ns(); }

// Our own entries' life bytes are known without asking the kernel: a sweep of a long queue asks
// F_OFD_GETLK once per entry, and each walks every lock of the file (a 10,000-entry sweep held
// the mutex for seconds when the entries were the sweeper's own, as async waiters are).
bool StateFile::alive(const Slot& entry) const {
  if (kept(entry)) return true;
  if (generation_ == current_generation() && local_.holds(entry.seq, Byte::life)) return true;
  return is_locked(fd_.get(), byte_offset(entry.seq, Byte::life), 1);
}

std::int64_t StateFile::kept_until(std::uint64_t seq) const {
  const auto index = find(seq);
  if (index < 0 || !kept(slot(static_cast<std::size_t>(index)))) return 0;
  return slot(static_cast<std::size_t>(index)).kept_until_ns;
}

bool StateFile::remove_if_dead(std::uint64_t seq) {
  const auto index = find(seq);
  if (index < 0 || alive(slot(static_cast<std::size_t>(index)))) return false;
  end_entry_at(static_cast<std::size_t>(index));
  recompute_mode();
  return true;
}

void StateFile::sweep_dead() {
  for (std::size_t i = 0; i < count();) {
    if (!alive(slot(i))) {
      end_entry_at(i);
    } else {
      ++i;
    }
  }
  recompute_mode();
}

void StateFile::recompute_mode() {
  auto& h = header();
  for (std::size_t i = 0; i < h.count; ++i) {
    if (slot(i).kind != kCounterWaiter) return;
  }
  h.mode = Mode::none;
  h.limit = 0;
}

}  // namespace turnstile::detail::file_state
