// SPDX-License-Identifier: Apache-2.0
// Wake-ups without a thread per waiter (local_entries.hpp).
#include "backends/file/local_entries.hpp"

#include <algorithm>

#include "backends/file/state_file.hpp"

namespace turnstile::detail::file_state {
namespace {

class FileWakeArm final : public WakeArm {
 public:
  FileWakeArm(std::shared_ptr<StateFile> file, std::shared_ptr<ArmedWake> wake)
      : file_(std::move(file)), wake_(std::move(wake)) {}
  ~FileWakeArm() override {
    wake_->disarm();
    if (listens_locally_) file_->local_entries().stop_listening(wake_.get());
    // listening_ stops listening to the watched bytes as it goes.
  }

  std::shared_ptr<StateFile> file_;
  std::shared_ptr<ArmedWake> wake_;
  bool listens_locally_ = false;
  ByteWatches::Listening listening_;
};

}  // namespace

void ArmedWake::released() {
  Wake wake;
  {
    std::lock_guard lock(mutex_);
    if (!wake_) return;
    wake = std::exchange(wake_, nullptr);
    running_ = true;
  }
  try {
    wake();
  } catch (...) {
    // A wake only posts the acquire's next step; one that fails leaves it to the deadline.
  }
  wake = nullptr;  // what it captured goes before a disarm may return
  std::lock_guard lock(mutex_);
  running_ = false;
  done_.notify_all();
}

void ArmedWake::disarm() noexcept {
  Wake dropped;
  std::unique_lock lock(mutex_);
  dropped = std::exchange(wake_, nullptr);
  done_.wait(lock, [&] { return !running_; });
  lock.unlock();
}

void LocalEntries::added(std::uint64_t seq, unsigned bytes) { entries_.push_back({seq, bytes}); }

void LocalEntries::dropped(std::uint64_t seq, unsigned bytes) {
  const auto entry = std::find_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.seq == seq; });
  if (entry == entries_.end()) return;
  entry->bytes &= ~bytes;
  if (entry->bytes == 0) entries_.erase(entry);
  // Every listen() ended under the guard we hold: none is missed by reading the count.
  if (listening_.load(std::memory_order_relaxed) == 0) return;
  std::lock_guard lock(mutex_);
  const auto woken = [&](const Listener& listener) { return listener.seq == seq && (listener.bit & bytes) != 0; };
  for (const auto& listener : listeners_) {
    if (woken(listener)) woken_.push_back(listener.listener);
  }
  std::erase_if(listeners_, woken);
  listening_.store(listeners_.size(), std::memory_order_relaxed);
}

// Entries are added in the order of their seqs (tokens grow under the guard), so they are sorted;
// were they not, a miss only sends the caller to the kernel.
bool LocalEntries::holds(std::uint64_t seq, Byte which) const {
  if (abandoned_.load(std::memory_order_relaxed)) return false;
  const auto entry = std::lower_bound(entries_.begin(), entries_.end(), seq,
                                      [](const Entry& e, std::uint64_t s) { return e.seq < s; });
  return entry != entries_.end() && entry->seq == seq && (entry->bytes & byte_bit(which)) != 0;
}

bool LocalEntries::listen(std::uint64_t seq, Byte which, const std::shared_ptr<ReleaseListener>& listener) {
  if (abandoned_.load()) return false;
  const auto entry = std::find_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.seq == seq; });
  if (entry == entries_.end() || (entry->bytes & byte_bit(which)) == 0) return false;
  std::lock_guard lock(mutex_);
  listeners_.push_back({seq, byte_bit(which), listener});
  listening_.store(listeners_.size(), std::memory_order_relaxed);
  return true;
}

void LocalEntries::stop_listening(const ReleaseListener* listener) noexcept {
  std::lock_guard lock(mutex_);
  std::erase_if(listeners_, [&](const Listener& l) { return l.listener.get() == listener; });
  listening_.store(listeners_.size(), std::memory_order_relaxed);
}

void LocalEntries::abandon() noexcept {
  abandoned_.store(true);
  std::vector<std::shared_ptr<ReleaseListener>> told;
  {
    std::lock_guard lock(mutex_);
    for (auto& listener : listeners_) told.push_back(std::move(listener.listener));
    listeners_.clear();
    listening_.store(0, std::memory_order_relaxed);
  }
  tell_released(told);
}

void tell_released(const std::vector<std::shared_ptr<ReleaseListener>>& listeners) noexcept {
  for (const auto& listener : listeners) listener->released();
}

std::unique_ptr<WakeArm> arm_for_release(const std::shared_ptr<StateFile>& file, const std::vector<std::uint64_t>& seqs,
                                         Byte which, Wake wake) {
  auto arm = std::make_unique<FileWakeArm>(file, std::make_shared<ArmedWake>(std::move(wake)));
  std::vector<off_t> watched;  // bytes of other processes' (or other clients') entries
  {
    StateFile::Guard guard(*file);
    for (const auto seq : seqs) {
      if (file->local_entries().listen(seq, which, arm->wake_)) {
        arm->listens_locally_ = true;
      } else {
        watched.push_back(byte_offset(seq, which));
      }
    }
  }
  if (!watched.empty()) arm->listening_ = file->byte_watches().listen(watched, arm->wake_);
  return arm;
}

}  // namespace turnstile::detail::file_state
