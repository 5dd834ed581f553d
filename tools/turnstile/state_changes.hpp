// A hold's suspensions and recoveries, from the library's thread to the loop that supervises
// the command (run) or keeps the hold (hold).
#pragma once

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <optional>
#include <stdexcept>
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

}  // namespace turnstile::cli
