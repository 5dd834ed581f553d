// SPDX-License-Identifier: Apache-2.0
// A place in a name's queue: a slot of the state file, and the lock bytes it owns.
#include "backends/file/file_backend.hpp"

#include <fcntl.h>

#include <optional>
#include <utility>

#include "backends/file/entry_slot.hpp"
#include "backends/file/values.hpp"

namespace turnstile::detail {

using namespace file_state;

Standing FilePlace::decided(const Verdict& verdict, const Header& h) const {
  Standing standing;
  standing.decided = verdict;
  standing.mode = queue_mode(h.mode);
  standing.limit = h.limit;
  return standing;
}

void FilePlace::check_mode(const QueueRequest& request) {
  const auto& h = file_->header();
  try {
    check_queue_mode(request, queue_mode(h.mode), h.limit);
  } catch (const Error&) {
    file_->sweep_dead();  // the entries that set the mode may belong to dead processes
    check_queue_mode(request, queue_mode(h.mode), h.limit);
  }
}

Verdict FilePlace::evaluate_as_newcomer() {
  auto& scan = scan_queue(*file_, 0);
  scan.views.push_back({kind_, permits_});
  scan.seqs.push_back(0);
  return evaluate_queue(scan.views, scan.views.size() - 1, limit_);
}

// Locks our bytes (life; exclusive for a writer; waiting for a lease still in line) and appends
// our slot; the mode is ours when the queue had none. An entry that waits locks them on the
// process's shared description of the name (EntryFd): no descriptor per waiter. A candidate's
// value file is in place already (`has_value`: values.hpp).
void FilePlace::add_slot(Header& h, std::uint64_t seq, bool admitted, bool has_value) {
  if (!admitted) file_->share_description(fd_);
  seq_ = seq;  // from here on, leave() drops what is locked
  set_lock(fd_.get(), F_WRLCK, byte_offset(seq, Byte::life), kind_ == EntryKind::exclusive ? 2 : 1, false);
  if (kind_ == EntryKind::lease && !admitted) set_lock(fd_.get(), F_WRLCK, byte_offset(seq, Byte::waiting), 1, false);
  auto slot = new_slot(seq, permits_, static_cast<std::uint8_t>(kind_));
  if (has_value) slot.flags = kHasValue;
  file_->append(slot, backend_.holder_label());
  unsigned bytes = byte_bit(Byte::life);
  if (kind_ == EntryKind::exclusive) bytes |= byte_bit(Byte::exclusive);
  if (kind_ == EntryKind::lease && !admitted) bytes |= byte_bit(Byte::waiting);
  file_->local_entries().added(seq, bytes);
  if (h.mode == Mode::none) {
    h.mode = has_value ? Mode::election : kind_ == EntryKind::lease ? Mode::semaphore : Mode::lock;
    h.limit = kind_ == EntryKind::lease ? limit_ : 0;
  }
}

FilePlace::Joined FilePlace::join(const QueueRequest& request, bool try_once, Standing& first) {
  fd_ = EntryFd(file_->checkout_descriptor());
  // A candidate's value is written before the guard is taken and placed under it before its
  // slot is appended; a join that adds no slot removes it (ValueDraft's end).
  std::optional<ValueDraft> value;
  if (request.primitive == Primitive::election) value.emplace(*file_, request.value);
  StateFile::Guard guard(*file_);
  file_->check_intact();
  // Not marked, it stays in place while our entry is in it (StateFile::remove_if_unused).
  if (file_->removed_as_unused()) return Joined::file_removed;
  auto& h = file_->header();
  check_mode(request);
  if (file_->full()) file_->sweep_dead();
  if (file_->full()) throw_full(request.name);
  Verdict verdict = evaluate_as_newcomer();
  if (!verdict.admitted() && try_once && request.optimistic_try) {
    file_->check_intact();
    return Joined::not_admitted;  // the async acquire that follows joins and waits
  }
  if (!verdict.admitted() && try_once) {
    // Nobody will wake us: those ahead must be alive before we fail.
    file_->sweep_dead();
    verdict = evaluate_as_newcomer();
    if (!verdict.admitted()) {
      file_->check_intact();
      return Joined::not_admitted;
    }
  }
  const std::uint64_t seq = next_token(h);
  if (!verdict.admitted()) {
    const auto& ahead = scan_queue(*file_, 0).seqs;
    remember_waited(verdict, ahead, ahead.size());
  }
  if (value) value->place(seq);
  try {
    add_slot(h, seq, verdict.admitted(), value.has_value());
  } catch (...) {
    if (value && file_->find(seq) < 0) unlinkat(file_->root_fd(), file_->value_file(seq).c_str(), 0);
    throw;
  }
  file_->check_intact();
  first = decided(verdict, h);
  return Joined::in_queue;
}

void FilePlace::gone_with_file() {
  backend_.forget(file_);
  throw QueueEntryGone();
}

// Under the guard: the entries whose release may admit us, as `verdict` (about `seqs`, the
// entries up to ours, `ahead` of them ahead of us) names them. Only those are kept, so that a
// waiter's memory does not grow with the queue ahead of it.
void FilePlace::remember_waited(const Verdict& verdict, const std::vector<std::uint64_t>& seqs, std::size_t ahead) {
  if (verdict.wait == WaitFor::any_holder_leave) {
    waited_for_.assign(seqs.begin(), seqs.begin() + static_cast<std::ptrdiff_t>(ahead));
  } else {
    waited_for_.assign(1, seqs.at(verdict.index));
  }
}

Standing FilePlace::look(Deadline) {
  {
    StateFile::Guard guard(*file_);
    if (std::exchange(check_waited_, false) && !file_->broken()) {
      for (const auto seq : waited_for_) file_->remove_if_dead(seq);
    }
    if (!file_->broken()) {
      const auto& scan = scan_queue(*file_, seq_);
      if (!scan.reached(seq_)) throw QueueEntryGone();
      const Verdict verdict = evaluate_queue(scan.views, scan.views.size() - 1, limit_);
      if (!verdict.admitted()) {
        remember_waited(verdict, scan.seqs, scan.seqs.size() - 1);
      } else if (kind_ == EntryKind::lease) {
        set_lock(fd_.get(), F_UNLCK, byte_offset(seq_, Byte::waiting), 1, false);  // the next lease looks again
        file_->local_entries().dropped(seq_, byte_bit(Byte::waiting));
      }
      if (!file_->broken()) return decided(verdict, file_->header());  // else truncated while we read
    }
  }
  gone_with_file();  // outside the guard: forget() takes the backend's lock
}

// Every entry ahead holds and none is enough alone: any of them leaving or dying can admit us.
// Dead ones are removed first (their bytes are free already): true when one was.
bool FilePlace::sweep_dead_ahead() {
  StateFile::Guard guard(*file_);
  bool swept = false;
  for (const auto seq : waited_for_) swept |= file_->remove_if_dead(seq);
  return swept;
}

// Kept entries (release_after) have no lock bytes to wait on: the wait ends when the first of
// `waited` that is kept ends instead (a timer, not a poll), and their seqs leave `waited`.
Deadline FilePlace::until_first_kept_end(std::vector<std::uint64_t>& waited, Deadline deadline) {
  std::int64_t first_end = 0;
  {
    StateFile::Guard guard(*file_);
    std::erase_if(waited, [&](std::uint64_t seq) {
      const auto end = file_->kept_until(seq);
      if (end != 0 && (first_end == 0 || end < first_end)) first_end = end;
      return end != 0;
    });
  }
  if (first_end == 0) return deadline;
  const auto end = SteadyClock::now() + std::chrono::nanoseconds(first_end - boottime_ns());
  return deadline && *deadline < end ? deadline : Deadline(end);
}

namespace {

// The byte of the waited entries whose release may admit us.
Byte byte_waited(const Verdict& verdict) {
  return verdict.wait == WaitFor::exclusive_end ? Byte::exclusive
         : verdict.wait == WaitFor::admission   ? Byte::waiting
                                                : Byte::life;  // the kernel's word on liveness
}

}  // namespace

void FilePlace::wait(const Verdict& verdict, Deadline deadline, const std::stop_token& stop) {
  waited_ = true;  // the file may have been moved away meanwhile: hold() looks again
  if (file_->broken()) gone_with_file();
  if (verdict.wait == WaitFor::any_holder_leave && sweep_dead_ahead()) return;
  auto waited = waited_for_;
  deadline = until_first_kept_end(waited, deadline);
  std::vector<off_t> bytes;
  for (const auto seq : waited) bytes.push_back(byte_offset(seq, byte_waited(verdict)));
  if (bytes.size() == 1 && !deadline && !stop.stop_possible()) {
    // Nothing else can end this wait: block in the kernel.
    file_->sleep_until_free(bytes.front());
  } else {
    file_->wait_for_any_release(bytes, deadline, stop);
  }
  // Released by death rather than by leaving? The next look, under the guard it takes anyway,
  // removes it (one mutex round trip per wake-up, not two).
  check_waited_ = verdict.wait != WaitFor::any_holder_leave;
}

// wait() without a thread: our own entries ahead wake us themselves, a shared watcher thread
// per byte does for other processes' (local_entries.hpp; the argument: docs/backends/file.md).
std::unique_ptr<WakeArm> FilePlace::arm(const Verdict& verdict, Deadline deadline, Wake wake) {
  waited_ = true;
  if (file_->broken()) gone_with_file();
  auto waited = waited_for_;
  until_first_kept_end(waited, deadline);
  // A kept entry ahead has no bytes to wait on, only its end: wait()'s timer, on a thread of
  // its own (release_after is rare, and the waiters behind wait on this waiter's bytes).
  if (waited.size() != waited_for_.size()) return QueuePlace::arm(verdict, deadline, std::move(wake));
  // A dead entry's bytes are free: its watcher wakes us at once, and the next look removes it.
  check_waited_ = true;
  return arm_for_release(file_, waited, byte_waited(verdict), std::move(wake));
}

std::unique_ptr<BackendHold> FilePlace::hold(std::shared_ptr<LossSignal> loss) {
  // A hold is handed out only once its name is pinned in a file still at its path. Admitted in
  // a file removed by hand or moved away meanwhile, the admission excludes nobody: leave, and the
  // core joins again, in the file now at the path. (Removal as unused never takes a file with
  // an entry in it: FilePlace::join.)
  const auto pin = file_->pin_for_hold(!waited_);
  if (pin == StateFile::HoldPin::not_in_place) {
    leave();
    backend_.forget(file_);
    return nullptr;
  }
  if (pin == StateFile::HoldPin::newly_kept) {
    try {
      backend_.check_kept_pin(file_);
    } catch (...) {
      file_->hold_ended();  // counted by pin_for_hold for the hold not made
      throw;
    }
  }
  auto hold = std::make_unique<FileHold>(backend_, file_, std::move(fd_), seq_, kind_, std::move(loss));
  seq_ = 0;  // the hold owns the entry now
  return hold;
}

void FilePlace::leave() noexcept { leave_slot(*file_, seq_, fd_); }

}  // namespace turnstile::detail
