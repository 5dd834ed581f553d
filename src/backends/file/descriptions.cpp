// SPDX-License-Identifier: Apache-2.0
// The open file descriptions that own entries' lock bytes (EntryFd, state_file.hpp): a name's pool
// of spare ones, and the one its waiting entries share.
#include <fcntl.h>

#include "backends/file/state_file.hpp"

namespace turnstile::detail::file_state {
namespace {

// A name keeps at most this many spare descriptions (an entry admitted as it joins, a blocking
// wait and a watcher thread take one each).
constexpr std::size_t kSpareDescriptors = 2;

}  // namespace

Fd StateFile::checkout_descriptor() {
  {
    std::lock_guard lock(pool_mutex_);
    if (!pool_.empty()) {
      Fd fd = std::move(pool_.back());
      pool_.pop_back();
      return fd;
    }
  }
  // Reopen through /proc so the new description is of this very file, even if the path changed.
  const std::string self = "/proc/self/fd/" + std::to_string(fd_.get());
  Fd fd(open(self.c_str(), O_RDWR | O_CLOEXEC));
  if (!fd) fail_io("cannot reopen the state of '" + name_ + "'");
  return fd;
}

void StateFile::return_descriptor(Fd fd) {
  std::lock_guard lock(pool_mutex_);
  if (pool_.size() < kSpareDescriptors) pool_.push_back(std::move(fd));
}

// (A forked child never gets here with its parent's description: it opens its own StateFiles.)
void StateFile::share_description(EntryFd& fd) {
  Fd spare;
  {
    std::lock_guard lock(pool_mutex_);
    fd.shared_ = shared_.lock();
    if (!fd.shared_) {
      fd.shared_ = std::make_shared<Fd>(std::move(fd.own_));
      shared_ = fd.shared_;
      return;
    }
    spare = std::move(fd.own_);
  }
  return_descriptor(std::move(spare));
}

void StateFile::let_go(EntryFd& fd, std::uint64_t seq) noexcept {
  if (fd.shared_) {
    let_go_shared(fd, seq);
    return;
  }
  // Our own description: one whole-file unlock, which allocates no lock record.
  try {
    if (fd.own_ && (seq == 0 || set_lock(fd.own_.get(), F_UNLCK, 0, 0, false))) return_descriptor(std::move(fd.own_));
  } catch (...) {
  }
  if (fd.own_) fd.own_.reset();  // not unlocked: closing it drops the locks
}

void StateFile::let_go_shared(EntryFd& fd, std::uint64_t seq) noexcept {
  if (generation_ != current_generation()) {
    fd.reset();  // a parent's description, closed in this forked child at the fork: forgotten
    return;
  }
  bool dropped = seq == 0;
  try {
    // The entry's four bytes (life, exclusive, waiting, unused): the other entries keep theirs.
    if (!dropped) dropped = set_lock(fd.get(), F_UNLCK, byte_offset(seq, Byte::life), 4, false);
  } catch (...) {
  }
  if (!dropped) {
    std::lock_guard lock(pool_mutex_);
    if (shared_.lock() == fd.shared_) shared_.reset();  // retired: closed with its last entry
  }
  fd.reset();
}

void StateFile::sleep_until_free(off_t byte) {
  Fd fd = checkout_descriptor();
  set_lock(fd.get(), F_RDLCK, byte, 1, true);
  if (set_lock(fd.get(), F_UNLCK, 0, 0, false)) return_descriptor(std::move(fd));
}

}  // namespace turnstile::detail::file_state
