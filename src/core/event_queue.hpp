// SPDX-License-Identifier: Apache-2.0
// The event hook's own thread (ClientOptions::on_event): events wait in a bounded queue and are
// told in order there, so no acquire, renewal or watcher thread ever runs user code or waits for
// it. A hook that blocks (a sink writing to a pipe nobody reads) once stopped a client's renewals
// until the server expired its holds.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>

#include "turnstile/metrics.hpp"

namespace turnstile::detail {

class EventQueue {
 public:
  // Events beyond this many waiting are dropped (and counted): memory stays bounded whatever the
  // hook does.
  static constexpr std::size_t kMaxWaiting = 10'000;
  // At the client's end, what still waits is told for at most this long, then dropped.
  static constexpr std::chrono::milliseconds kDrainAtEnd{1000};

  explicit EventQueue(EventHandler hook);
  // Tells what waits (for at most kDrainAtEnd), then joins the thread. Never in a child of
  // fork() (see forked()).
  ~EventQueue();
  EventQueue(const EventQueue&) = delete;
  EventQueue& operator=(const EventQueue&) = delete;

  void push(Event event) noexcept;
  // Returns once every event pushed before the call was told (or dropped): for tests.
  void wait_until_told();
  std::uint64_t dropped() const noexcept { return dropped_.load(std::memory_order_relaxed); }
  // In a child of fork(): the thread is the parent's, and its condition variables may count it
  // as a waiter, so destroying the queue would wait for good. Its owner leaves it behind.
  bool forked() const noexcept;

 private:
  void run();

  EventHandler hook_;
  // The hook's thread is not in a child of fork(): there the queue tells nothing (its mutex may
  // have been held at the fork).
  const std::uint64_t generation_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Event> waiting_;
  bool ending_ = false;
  bool telling_ = false;  // the hook is running
  std::condition_variable told_;
  std::atomic<std::uint64_t> dropped_{0};
  std::thread thread_;  // last: it uses the members above
};

}  // namespace turnstile::detail
