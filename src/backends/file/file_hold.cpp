// A hold on a name, and the watcher that tells holds their state file was taken away.
#include "backends/file/file_backend.hpp"

#include <fcntl.h>

#include "backends/file/entry_slot.hpp"

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
    file_->header().slots[index].kind = static_cast<std::uint8_t>(EntryKind::shared);
  }
  kind_ = EntryKind::shared;
  set_lock(fd_.get(), F_UNLCK, byte_offset(seq_, Byte::exclusive), 1, false);  // readers behind wake
}

void FileHold::release() {
  if (!fd_) return;
  refuse_if_inherited();
  backend_.unwatch(this);
  bool found = false;
  bool broken;
  {
    StateFile::Guard guard(*file_);
    broken = file_->broken();
    if (!broken) {
      found = file_->find(seq_) >= 0;
      file_->remove(seq_);
    }
    unlock_all(fd_);
  }
  file_->return_descriptor(std::move(fd_));
  file_->unpin();
  if (broken) {
    loss_->lose("the state file of '" + file_->name() + "' was truncated or overwritten");
  } else if (!found) {
    loss_->lose("its entry vanished from the state file");
  }
}

void FileBackend::watch(FileHold* hold) {
  std::lock_guard lock(watch_->mutex);
  if (watch_->generation != current_generation()) {
    // A forked child: the parent's holds are not ours to watch, and its thread is not here.
    watch_->holds = nullptr;
    watch_->started = false;
    watch_->checking = false;
    watch_->generation = current_generation();
  }
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
        loss->lose("the state file of '" + file->name() + "' was removed, replaced or truncated");
      }
    }
    holds.clear();
    lock.lock();
    state->checking = false;
    state->cv.notify_all();
  }
}

}  // namespace turnstile::detail
