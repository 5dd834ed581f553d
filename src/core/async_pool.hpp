// SPDX-License-Identifier: Apache-2.0
// A client's few threads for its async acquires (ClientOptions::async_threads): tasks run in the
// order posted, and timers (the acquires' deadlines and pauses: one timer queue per client, not
// a thread per acquire) run on the same threads when due. The threads start with the first
// task, so a client that never acquires asynchronously has none.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "turnstile/deadline.hpp"

namespace turnstile::detail {

class AsyncPool {
 public:
  using Task = std::function<void()>;
  // A timer's key: when it is due, and a sequence number that tells timers due at once apart.
  using TimerId = std::pair<SteadyClock::time_point, std::uint64_t>;

  explicit AsyncPool(std::size_t threads);
  ~AsyncPool() { close(); }
  AsyncPool(const AsyncPool&) = delete;
  AsyncPool& operator=(const AsyncPool&) = delete;

  // Runs `task` on a pool thread soon. False once closed: the task is dropped.
  bool post(Task task);
  // Runs `task` on a pool thread at `when`, unless cancelled first. nullopt once closed.
  std::optional<TimerId> post_at(SteadyClock::time_point when, Task task);
  // Drops a timer that has not run (a timer that ran or runs now is left alone).
  void cancel(const TimerId& timer);
  // Ends the threads: what is queued is dropped, a task running is waited for, except when
  // close() runs in a pool thread's own task (the last handle of a client dropped in a
  // callback): that thread ends once its task returns, on its own.
  void close();
  // Whether the calling thread is one of this pool's (no lock: asked on every async acquire).
  bool on_pool_thread() const;

 private:
  struct Core;
  // The core of this process (a forked child gets a new one: the parent's threads are not in
  // it); nullptr once closed. Caller holds mutex_.
  std::shared_ptr<Core> core_locked();
  static void work(const std::shared_ptr<Core>& core);

  std::size_t threads_;
  mutable std::mutex mutex_;
  std::shared_ptr<Core> core_;
  std::atomic<const Core*> current_core_ = nullptr;  // core_.get(), for on_pool_thread()
  bool closed_ = false;
};

}  // namespace turnstile::detail
