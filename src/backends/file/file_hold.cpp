// SPDX-License-Identifier: Apache-2.0
// A hold on a name, and the watcher that tells holds their state file was taken away.
#include "backends/file/file_backend.hpp"

#include <fcntl.h>

#include <algorithm>

#include "backends/file/entry_slot.hpp"
#include "backends/file/values.hpp"

namespace turnstile::detail {

using namespace file_state;

namespace {

// How often held names' state files are checked to be still in place, whole: the bound on
// telling a holder that `rm -rf` or a tmp cleaner took its state file.
constexpr std::chrono::milliseconds kValidityCheckInterval{500};

}  // namespace

void FileHold::downgrade() {
  if (!fd_ || kind_ != EntryKind::exclusive) return;
  refuse_if_inherited();
  StateFile::Guard guard(*file_);
  if (auto index = file_->find(seq_); index >= 0) {
    file_->slot(static_cast<std::size_t>(index)).kind = static_cast<std::uint8_t>(EntryKind::shared);
  }
  kind_ = EntryKind::shared;
  set_lock(fd_.get(), F_UNLCK, byte_offset(seq_, Byte::exclusive), 1, false);  // readers behind wake
  file_->local_entries().dropped(seq_, byte_bit(Byte::exclusive));
}

// The new value is written aside, then renamed over the old one under the guard once our slot
// is found still there: readers see the old value or the new one, and observers are woken by
// the rename (FileLeaderWatch). Local: its outcome is always known.
void FileHold::proclaim(const std::string& value) {
  if (!fd_) throw HoldLost("the leadership of '" + file_->name() + "' was resigned; nothing was proclaimed");
  refuse_if_inherited();
  ValueDraft draft(*file_, value);
  bool ours = false;
  {
    StateFile::Guard guard(*file_);
    const auto index = file_->find(seq_);
    const bool found = index >= 0 && !file_->broken();
    if (found && (file_->slot(static_cast<std::size_t>(index)).flags & kHasValue) == 0) {
      throw InvalidArgument("'" + file_->name() + "' is not an election: it has no leader value to change");
    }
    // In a file no longer at its path (rm, a tmp cleaner) our leadership excludes nobody.
    ours = found && file_->still_valid();
    if (ours) draft.place(seq_);
  }
  if (!ours) {
    loss_->lose("its entry is gone from the state file of '" + file_->name() + "' (found by a proclaim)",
                LossCause::entry_gone);
    throw HoldLost("the leadership of '" + file_->name() + "' (fencing token " + std::to_string(seq_) +
                   ") was lost: its entry is gone; nothing was proclaimed");
  }
}

void FileHold::release_after(std::chrono::milliseconds keep_for) {
  leave_keeping(boottime_ns() + std::chrono::nanoseconds(keep_for).count());
}

void FileHold::leave_keeping(std::int64_t kept_until_ns) {
  if (!fd_) return;
  refuse_if_inherited();
  backend_.unwatch(this);
  bool found = false;
  bool broken;
  {
    StateFile::Guard guard(*file_);
    file_->local_entries().dropped(seq_, kAllBytes);  // its armed waiters wake as the guard ends
    broken = file_->broken();
    if (!broken) {
      const auto index = file_->find(seq_);
      found = index >= 0;
      if (!found || kept_until_ns == 0) {
        file_->remove(seq_);
      } else {
        file_->slot(static_cast<std::size_t>(index)).kept_until_ns = kept_until_ns;
      }
    }
  }
  // After the guard: the waiter this wakes takes the mutex at once, and would otherwise sleep on
  // it until we let go (a second wake-up per handoff). Our entry is gone (or kept) already, so
  // whoever looks in between sees it so; a waiter is woken only now, and finds it gone.
  file_->let_go(fd_, seq_);
  file_->hold_ended();
  if (broken) {
    loss_->lose("the state file of '" + file_->name() + "' was truncated or overwritten", LossCause::entry_gone);
  } else if (!found) {
    loss_->lose("its entry vanished from the state file", LossCause::entry_gone);
  }
}

// Under watch_->mutex.
void FileBackend::adopt_watch_after_fork_locked() {
  if (watch_->generation == current_generation()) return;
  // A forked child: the parent's holds are not ours to watch, and its thread is not here.
  watch_->holds = nullptr;
  watch_->kept_pins.clear();
  watch_->started = false;
  watch_->checking = false;
  watch_->generation = current_generation();
}

void FileBackend::check_kept_pin(const std::shared_ptr<StateFile>& file) {
  std::lock_guard lock(watch_->mutex);
  adopt_watch_after_fork_locked();
  watch_->kept_pins.push_back({file.get(), file});  // the hold about to be made starts the watcher
}

void FileBackend::watch(FileHold* hold) {
  std::lock_guard lock(watch_->mutex);
  adopt_watch_after_fork_locked();
  hold->watch_prev = nullptr;
  hold->watch_next = watch_->holds;
  if (watch_->holds) watch_->holds->watch_prev = hold;
  watch_->holds = hold;
  if (!watch_->started) {
    std::thread watcher([state = watch_] { watch_loop(state); });
    watch_->thread = watcher.get_id();
    watcher.detach();
    watch_->started = true;
  }
}

void FileBackend::unwatch(FileHold* hold) {
  std::lock_guard lock(watch_->mutex);
  if (hold->watch_prev) {
    hold->watch_prev->watch_next = hold->watch_next;
  } else if (watch_->holds == hold) {
    watch_->holds = hold->watch_next;
  } else {
    return;  // not in the list
  }
  if (hold->watch_next) hold->watch_next->watch_prev = hold->watch_prev;
  hold->watch_prev = hold->watch_next = nullptr;
}

// The embedded backend's keep-alive: the kernel keeps our locks for as long as we live, but a
// state file removed, replaced or truncated under us (rm -rf, a tmp cleaner) no longer
// excludes anyone.
void FileBackend::watch_loop(const std::shared_ptr<WatchState>& state) {
  std::unique_lock lock(state->mutex);
  for (;;) {
    state->cv.wait_for(lock, kValidityCheckInterval, [&] { return state->stop; });
    if (state->stop) return;
    std::vector<std::pair<std::shared_ptr<StateFile>, std::shared_ptr<LossSignal>>> holds;
    for (auto* hold = state->holds; hold; hold = hold->watch_next) holds.emplace_back(hold->file(), hold->loss());
    state->checking = true;
    lock.unlock();  // lose() runs the user's callback, which may release holds
    for (const auto& [file, loss] : holds) {
      if (!loss->lost() && !file->still_valid()) {
        file->stop_keeping_pin();  // its name's pin goes with its last hold
        loss->lose("the state file of '" + file->name() + "' was removed, replaced or truncated",
                   LossCause::entry_gone);
      }
    }
    holds.clear();
    lock.lock();
    check_kept_pins(*state, lock);
    state->checking = false;
    state->cv.notify_all();
  }
}

// Under state.mutex, with checking set. A name's pin kept by a file nobody holds (a process
// that used the name and keeps it open) would otherwise keep the name from being made afresh
// after its file was removed by hand (rm, a tmp cleaner) for as long as the client keeps it.
void FileBackend::check_kept_pins(WatchState& state, std::unique_lock<std::mutex>& lock) {
  std::vector<std::shared_ptr<StateFile>> files;
  for (const auto& kept : state.kept_pins) {
    if (auto file = kept.owner.lock()) files.push_back(std::move(file));
  }
  lock.unlock();
  std::vector<const StateFile*> let_go;
  for (const auto& file : files) {
    if (!file->keeps_pin_in_place()) let_go.push_back(file.get());
  }
  lock.lock();
  // `files` keeps those let go alive meanwhile: no new file can be at one's address.
  std::erase_if(state.kept_pins, [&](const WatchState::KeptPin& kept) {
    return kept.owner.expired() || std::find(let_go.begin(), let_go.end(), kept.file) != let_go.end();
  });
  lock.unlock();
  files.clear();  // the last owner may be us: closed outside the mutex
  lock.lock();
}

}  // namespace turnstile::detail
