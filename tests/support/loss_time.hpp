// SPDX-License-Identifier: Apache-2.0
// When a hold was reported lost: a stop callback on its lost_token() stamps the time.
//
// std::stop_source::request_stop() sets the token's flag first and only then runs the
// callbacks, on the reporting thread: another thread may see stop_requested() (or a HoldLost
// that follows from it) before the stamp exists. A test that compares times therefore waits for
// the stamp (stamped()) instead of reading it as soon as the flag is seen.
#pragma once

#include <atomic>
#include <chrono>
#include <stop_token>
#include <thread>

namespace turnstile_test {

class LossTime {
 public:
  using Clock = std::chrono::steady_clock;

  explicit LossTime(std::stop_token token) : callback_(std::move(token), Stamp{&at_}) {}
  bool reported() const { return at_.load() != 0; }
  Clock::time_point at() const { return Clock::time_point(Clock::duration(at_.load())); }
  // Waits (at most `patience`) for the stamp of a loss whose flag is already set; false if the
  // callback never ran in that time.
  bool stamped(std::chrono::milliseconds patience = std::chrono::milliseconds(2000)) const {
    const auto give_up = Clock::now() + patience;
    while (!reported()) {
      if (Clock::now() >= give_up) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return true;
  }

 private:
  struct Stamp {
    std::atomic<Clock::rep>* at;
    void operator()() const noexcept { at->store(Clock::now().time_since_epoch().count()); }
  };
  std::atomic<Clock::rep> at_{0};  // before callback_: it may run in callback_'s constructor
  std::stop_callback<Stamp> callback_;
};

}  // namespace turnstile_test
