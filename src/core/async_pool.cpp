// SPDX-License-Identifier: Apache-2.0
// A client's async pool (async_pool.hpp).
#include "core/async_pool.hpp"

#include "core/fork_generation.hpp"

namespace turnstile::detail {

// What the threads share; kept alive by each thread, so that a thread left to end on its own
// (close() from its own task) never touches a freed pool.
struct AsyncPool::Core {
  std::mutex mutex;
  std::condition_variable changed;
  std::deque<Task> tasks;
  std::map<TimerId, Task> timers;
  std::uint64_t next_timer = 0;
  bool closed = false;
  std::uint64_t generation = fork_generation();
  std::vector<std::thread> threads;
};

namespace {
thread_local const void* current_pool_core = nullptr;
}  // namespace

AsyncPool::AsyncPool(std::size_t threads) : threads_(threads == 0 ? 1 : threads) {}

std::shared_ptr<AsyncPool::Core> AsyncPool::core_locked() {
  if (closed_) return nullptr;
  if (core_ && core_->generation != fork_generation()) {
    // A forked child: the threads (and what they run) are the parent's, and the core's mutex
    // may have been held by one of them at the fork. Leaked on purpose, never touched.
    static_cast<void>(new std::shared_ptr<Core>(std::move(core_)));
  }
  if (!core_) {
    core_ = std::make_shared<Core>();
    for (std::size_t i = 0; i < threads_; ++i) core_->threads.emplace_back([core = core_] { work(core); });
    current_core_ = core_.get();
  }
  return core_;
}

bool AsyncPool::post(Task task) {
  std::lock_guard lock(mutex_);
  const auto core = core_locked();
  if (!core) return false;
  {
    std::lock_guard core_lock(core->mutex);
    core->tasks.push_back(std::move(task));
  }
  core->changed.notify_one();
  return true;
}

std::optional<AsyncPool::TimerId> AsyncPool::post_at(SteadyClock::time_point when, Task task) {
  std::lock_guard lock(mutex_);
  const auto core = core_locked();
  if (!core) return std::nullopt;
  TimerId id;
  bool earliest = false;
  {
    std::lock_guard core_lock(core->mutex);
    id = {when, ++core->next_timer};
    core->timers.emplace(id, std::move(task));
    earliest = core->timers.begin()->first == id;
  }
  if (earliest) core->changed.notify_all();  // a thread may sleep until a later timer
  return id;
}

void AsyncPool::cancel(const TimerId& timer) {
  Task dropped;  // destroyed after the mutexes are released (it may own an acquire)
  std::lock_guard lock(mutex_);
  if (!core_ || closed_ || core_->generation != fork_generation()) return;
  std::lock_guard core_lock(core_->mutex);
  const auto found = core_->timers.find(timer);
  if (found == core_->timers.end()) return;
  dropped = std::move(found->second);
  core_->timers.erase(found);
}

void AsyncPool::close() {
  std::shared_ptr<Core> core;
  {
    std::lock_guard lock(mutex_);
    closed_ = true;
    core = std::move(core_);
    current_core_ = nullptr;
  }
  if (!core || core->generation != fork_generation()) return;  // none, or the parent's
  std::deque<Task> tasks;
  std::map<TimerId, Task> timers;
  std::vector<std::thread> threads;
  {
    std::lock_guard lock(core->mutex);
    core->closed = true;
    tasks.swap(core->tasks);
    timers.swap(core->timers);
    threads.swap(core->threads);
  }
  core->changed.notify_all();
  for (auto& thread : threads) {
    if (thread.get_id() == std::this_thread::get_id()) {
      thread.detach();  // our own task called close(): the thread ends after it
    } else {
      thread.join();
    }
  }
}

bool AsyncPool::on_pool_thread() const {
  const Core* core = current_core_.load(std::memory_order_acquire);
  return core && current_pool_core == core;
}

void AsyncPool::work(const std::shared_ptr<Core>& core) {
  current_pool_core = core.get();
  std::unique_lock lock(core->mutex);
  while (!core->closed) {
    Task task;
    if (!core->tasks.empty()) {
      task = std::move(core->tasks.front());
      core->tasks.pop_front();
    } else if (!core->timers.empty() && core->timers.begin()->first.first <= SteadyClock::now()) {
      task = std::move(core->timers.begin()->second);
      core->timers.erase(core->timers.begin());
    } else if (!core->timers.empty()) {
      // A copy: the timer may be cancelled (its node freed) while this thread waits.
      const auto due = core->timers.begin()->first.first;
      core->changed.wait_until(lock, due);
      continue;
    } else {
      core->changed.wait(lock);
      continue;
    }
    lock.unlock();
    task();
    task = nullptr;  // what it owned goes before the lock is taken again
    lock.lock();
  }
}

}  // namespace turnstile::detail
