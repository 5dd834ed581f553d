// SPDX-License-Identifier: Apache-2.0
// The default QueuePlace::arm and CounterLine::arm: the blocking wait() on a thread of its own.
// Correct on any backend, but a thread per waiter: each backend overrides arm() with the events
// it has (a watch callback, a Pub/Sub message, a watch stream, a blocking query on a shared
// I/O thread), which is what lets thousands of async acquires wait on a few threads.
#include <stop_token>
#include <thread>

#include "core/queue_store.hpp"

namespace turnstile::detail {
namespace {

class ThreadWakeArm final : public WakeArm {
 public:
  template <typename Wait>
  ThreadWakeArm(Wait wait, Wake wake)
      : thread_([wait = std::move(wait), wake = std::move(wake)](std::stop_token stop) {
          try {
            wait(stop);
          } catch (...) {
            // The backend can no longer watch (its entry vanished, the connection failed): the
            // wake's look tells what happened.
          }
          // Disarmed meanwhile (the core's deadline or stop): the wake must not run.
          if (!stop.stop_requested()) wake();
        }) {}
  // std::jthread requests the stop and joins: wait() ends on the stop, and a wake already
  // running is waited for.
  ~ThreadWakeArm() override = default;

 private:
  std::jthread thread_;
};

}  // namespace

std::unique_ptr<WakeArm> QueuePlace::arm(const Verdict& verdict, Deadline deadline, Wake wake) {
  return std::make_unique<ThreadWakeArm>(
      [this, verdict, deadline](const std::stop_token& stop) { wait(verdict, deadline, stop); }, std::move(wake));
}

std::unique_ptr<WakeArm> CounterLine::arm(CounterWait what, Deadline deadline, Wake wake) {
  return std::make_unique<ThreadWakeArm>(
      [this, what, deadline](const std::stop_token& stop) { wait(what, deadline, stop); }, std::move(wake));
}

}  // namespace turnstile::detail
