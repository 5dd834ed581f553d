// A place in a name's queue: a slot of the state file, and the lock bytes it owns.
#include "backends/file/file_backend.hpp"

#include <fcntl.h>

#include "backends/file/entry_slot.hpp"

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

Verdict FilePlace::evaluate_as_newcomer(const Header& h) {
  auto& scan = scan_queue(h, 0);
  scan.views.push_back({kind_, permits_});
  scan.seqs.push_back(0);
  return evaluate_queue(scan.views, scan.views.size() - 1, limit_);
}

// Locks our bytes (life; exclusive for a writer; waiting for a lease still in line) and appends
// our slot; the mode is ours when the queue had none.
void FilePlace::add_slot(Header& h, std::uint64_t seq, bool admitted) {
  set_lock(fd_.get(), F_WRLCK, byte_offset(seq, Byte::life), kind_ == EntryKind::exclusive ? 2 : 1, false);
  if (kind_ == EntryKind::lease && !admitted) set_lock(fd_.get(), F_WRLCK, byte_offset(seq, Byte::waiting), 1, false);
  seq_ = seq;
  file_->append(new_slot(seq, permits_, static_cast<std::uint8_t>(kind_)), backend_.holder_label());
  if (h.mode == Mode::none) {
    h.mode = kind_ == EntryKind::lease ? Mode::semaphore : Mode::lock;
    h.limit = kind_ == EntryKind::lease ? limit_ : 0;
  }
}

bool FilePlace::join(const QueueRequest& request, bool try_once, Standing& first) {
  fd_ = file_->checkout_descriptor();
  StateFile::Guard guard(*file_);
  file_->check_intact();
  auto& h = file_->header();
  check_mode(request);
  if (h.count == kCapacity) file_->sweep_dead();
  if (h.count == kCapacity) throw_full(request.name);
  Verdict verdict = evaluate_as_newcomer(h);
  if (!verdict.admitted() && try_once) {
    // Nobody will wake us: those ahead must be alive before we fail.
    file_->sweep_dead();
    verdict = evaluate_as_newcomer(h);
    if (!verdict.admitted()) {
      file_->check_intact();
      return false;
    }
  }
  const std::uint64_t seq = next_token(h);
  if (!verdict.admitted()) {
    seen_ = scan_queue(h, 0).seqs;
    seen_.push_back(seq);
  }
  add_slot(h, seq, verdict.admitted());
  file_->check_intact();
  first = decided(verdict, h);
  return true;
}

void FilePlace::gone_with_file() {
  backend_.forget(file_);
  throw QueueEntryGone();
}

Standing FilePlace::look(Deadline) {
  {
    StateFile::Guard guard(*file_);
    if (!file_->broken()) {
      const auto& h = file_->header();
      const auto& scan = scan_queue(h, seq_);
      if (!scan.reached(seq_)) throw QueueEntryGone();
      const Verdict verdict = evaluate_queue(scan.views, scan.views.size() - 1, limit_);
      if (!verdict.admitted()) {
        seen_ = scan.seqs;
      } else if (kind_ == EntryKind::lease) {
        set_lock(fd_.get(), F_UNLCK, byte_offset(seq_, Byte::waiting), 1, false);  // the next lease looks again
      }
      if (!file_->broken()) return decided(verdict, h);  // else truncated while we read
    }
  }
  gone_with_file();  // outside the guard: forget() takes the backend's lock
}

// Every entry ahead holds and none is enough alone: any of them leaving or dying can admit us.
// Dead ones are removed first (their bytes are free already): true when one was.
bool FilePlace::sweep_dead_ahead() {
  StateFile::Guard guard(*file_);
  bool swept = false;
  for (std::size_t i = 0; i + 1 < seen_.size(); ++i) swept |= file_->remove_if_dead(seen_[i]);
  return swept;
}

void FilePlace::wait(const Verdict& verdict, Deadline deadline, const std::stop_token& stop) {
  if (file_->broken()) gone_with_file();
  std::vector<off_t> bytes;
  std::uint64_t target = 0;
  if (verdict.wait == WaitFor::any_holder_leave) {
    if (sweep_dead_ahead()) return;
    // The life bytes of all of them: the kernel's word on liveness, never a process id.
    for (std::size_t i = 0; i + 1 < seen_.size(); ++i) bytes.push_back(byte_offset(seen_[i], Byte::life));
  } else {
    target = seen_.at(verdict.index);
    const Byte which = verdict.wait == WaitFor::leave           ? Byte::life
                       : verdict.wait == WaitFor::exclusive_end ? Byte::exclusive
                                                                : Byte::waiting;
    bytes.push_back(byte_offset(target, which));
  }
  if (bytes.size() == 1 && !deadline && !stop.stop_possible()) {
    // Nothing else can end this wait: block in the kernel on our own description.
    set_lock(fd_.get(), F_RDLCK, bytes.front(), 1, true);
    set_lock(fd_.get(), F_UNLCK, bytes.front(), 1, false);
  } else {
    file_->wait_for_any_release(bytes, deadline, stop);
  }
  if (target != 0) {
    StateFile::Guard guard(*file_);
    file_->remove_if_dead(target);  // released by death rather than by leaving
  }
}

std::unique_ptr<BackendHold> FilePlace::hold(std::shared_ptr<LossSignal> loss) {
  // A hold is handed out only once its name is pinned in a file still at its path. Admitted in
  // a file removed or moved away meanwhile, the admission excludes nobody: leave, and the core
  // joins again, in the file now at the path.
  if (!file_->pin_if_current()) {
    leave();
    backend_.forget(file_);
    return nullptr;
  }
  auto hold = std::make_unique<FileHold>(backend_, file_, std::move(fd_), seq_, kind_, std::move(loss));
  seq_ = 0;  // the hold owns the entry now
  return hold;
}

void FilePlace::leave() noexcept { leave_slot(*file_, seq_, fd_); }

}  // namespace turnstile::detail
