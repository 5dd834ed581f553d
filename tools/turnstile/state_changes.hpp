// SPDX-License-Identifier: Apache-2.0
// A hold's suspensions, recoveries and loss, from the library's thread to the loop that
// supervises the command (run) or keeps the hold (hold).
#pragma once

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <stop_token>
#include <string>
#include <utility>

#include <turnstile/turnstile.hpp>

namespace turnstile::cli {

// The hold's suspensions and recoveries (its loss comes through its stop token), from the
// library's thread to the supervising loop: the latest state, and an eventfd that wakes it.
// Made before the client, so it outlives every callback.
class StateChanges {
 public:
  StateChanges() : fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
    if (fd_ < 0) throw std::runtime_error("eventfd: " + std::string(std::strerror(errno)));
  }
  ~StateChanges() { close(fd_); }
  StateChanges(const StateChanges&) = delete;
  StateChanges& operator=(const StateChanges&) = delete;

  void record(const HoldStateChange& change) {
    if (change.state == HoldState::lost) {
      // The loss itself comes through the stop token; this says how long is left.
      std::lock_guard lock(mutex_);
      loss_margin_ = change.margin;
      loss_cv_.notify_all();
      return;
    }
    {
      std::lock_guard lock(mutex_);
      state_ = change.state;
      reason_ = change.reason;
    }
    const std::uint64_t one = 1;
    (void)!write(fd_, &one, sizeof one);
  }
  int fd() const { return fd_; }
  // The library's margin for a loss (how long before the server could hand the hold to someone
  // else), told right after the stop token; nullopt when it did not come within `wait`.
  std::optional<std::chrono::milliseconds> loss_margin(std::chrono::milliseconds wait) {
    std::unique_lock lock(mutex_);
    loss_cv_.wait_for(lock, wait, [this] { return loss_margin_.has_value(); });
    return loss_margin_;
  }
  // The latest state and why; clears the wake-up.
  std::pair<HoldState, std::string> take() {
    std::uint64_t count;
    (void)!read(fd_, &count, sizeof count);
    std::lock_guard lock(mutex_);
    return {state_, reason_};
  }

 private:
  int fd_;
  std::mutex mutex_;
  HoldState state_ = HoldState::held;
  std::string reason_;
  std::condition_variable loss_cv_;
  std::optional<std::chrono::milliseconds> loss_margin_;
};

// An eventfd that becomes readable once the hold's stop token reports its loss, so the loop
// can poll for it beside its other descriptors.
class LossAlarm {
 public:
  explicit LossAlarm(std::stop_token lost) : fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
    if (fd_ < 0) throw std::runtime_error("eventfd: " + std::string(std::strerror(errno)));
    on_loss_.emplace(std::move(lost), Wake{fd_});
  }
  ~LossAlarm() {
    on_loss_.reset();  // waits for a callback running right now, before its descriptor goes
    close(fd_);
  }
  LossAlarm(const LossAlarm&) = delete;
  LossAlarm& operator=(const LossAlarm&) = delete;

  int fd() const { return fd_; }

 private:
  // Runs on the library's watcher thread (or at once if already lost): just wakes the loop.
  struct Wake {
    int fd;
    void operator()() const noexcept {
      const std::uint64_t one = 1;
      (void)!write(fd, &one, sizeof one);
    }
  };
  int fd_;
  std::optional<std::stop_callback<Wake>> on_loss_;
};

}  // namespace turnstile::cli
