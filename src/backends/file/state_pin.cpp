// SPDX-License-Identifier: Apache-2.0
// A state file's place in the directory: whether it is still the one at its path, and the pin on
// the directory that keeps its name from being made afresh while this client uses it
// (state_file.hpp, StateFile::pin_for_hold; the safety argument is in docs/architecture.md).
#include <fcntl.h>
#include <sys/stat.h>

#include <mutex>

#include "backends/file/directory.hpp"
#include "backends/file/state_file.hpp"

namespace turnstile::detail::file_state {

bool StateFile::at_its_path() const {
  struct stat now {};
  return fstatat(root_fd_, state_name_.c_str(), &now, AT_SYMLINK_NOFOLLOW) == 0 && now.st_dev == dev_ &&
         now.st_ino == ino_ && now.st_size >= static_cast<off_t>(file_size(map_.capacity()));
}

bool StateFile::unlinked_or_cut() const {
  struct stat st {};
  return fstat(fd_.get(), &st) != 0 || st.st_nlink == 0 || st.st_size < static_cast<off_t>(file_size(map_.capacity()));
}

StateFile::HoldPin StateFile::pin_for_hold(bool checked) {
  std::lock_guard lock(pin_mutex_);
  // Kept, the pin has been held without a break since a hold found the file in place after
  // taking it (a kept pin is only let go once the file stops being kept, for good).
  const bool kept = pinned_ && keep_pin_;
  if (!pinned_) {
    pins_->pin(pin_byte_);
    pinned_ = true;
  }
  // Kept, no process can have made another file for the name since (every creator sees the
  // pin): this one is still the name's unless removed or replaced by a rename over it, which an
  // fstat tells (the join's, when `checked`). A pin just taken needs the path looked up.
  const bool in_place = kept ? checked || !unlinked_or_cut() : at_its_path();
  if (!in_place) {
    keep_pin_ = false;
    if (holds_ == 0) release_pin_locked();
    return HoldPin::not_in_place;
  }
  ++holds_;
  return kept || !keep_pin_ ? HoldPin::pinned : HoldPin::newly_kept;
}

void StateFile::hold_ended() {
  std::lock_guard lock(pin_mutex_);
  if (holds_ > 0) --holds_;
  if (holds_ == 0 && !keep_pin_) release_pin_locked();
}

void StateFile::stop_keeping_pin() {
  std::lock_guard lock(pin_mutex_);
  keep_pin_ = false;
  if (holds_ == 0) release_pin_locked();
}

bool StateFile::keeps_pin_in_place() {
  std::lock_guard lock(pin_mutex_);
  if (!pinned_ || !keep_pin_) return false;
  if (holds_ == 0 && !at_its_path()) {
    keep_pin_ = false;
    release_pin_locked();
    return false;
  }
  return true;
}

void StateFile::release_pin_locked() {
  if (!pinned_) return;
  pins_->unpin(pin_byte_);
  pinned_ = false;
}

}  // namespace turnstile::detail::file_state
