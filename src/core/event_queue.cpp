// SPDX-License-Identifier: Apache-2.0
#include "core/event_queue.hpp"

#include <chrono>
#include <optional>

#include "core/fork_generation.hpp"

namespace turnstile::detail {

EventQueue::EventQueue(EventHandler hook)
    : hook_(std::move(hook)), generation_(fork_generation()), thread_([this] { run(); }) {}

EventQueue::~EventQueue() {
  {
    std::lock_guard lock(mutex_);
    ending_ = true;
  }
  wake_.notify_one();
  thread_.join();
}

void EventQueue::push(Event event) noexcept {
  if (forked()) {
    dropped_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  try {
    std::lock_guard lock(mutex_);
    if (ending_ || waiting_.size() >= kMaxWaiting) {
      dropped_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    waiting_.push_back(std::move(event));
  } catch (...) {  // no memory for it: dropped, never an exception into a hold's path
    dropped_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  wake_.notify_one();
}

bool EventQueue::forked() const noexcept { return fork_generation() != generation_; }

void EventQueue::wait_until_told() {
  if (forked()) return;
  std::unique_lock lock(mutex_);
  told_.wait(lock, [&] { return waiting_.empty() && !telling_; });
}

void EventQueue::run() {
  std::optional<std::chrono::steady_clock::time_point> drain_until;
  std::unique_lock lock(mutex_);
  for (;;) {
    wake_.wait(lock, [&] { return ending_ || !waiting_.empty(); });
    if (ending_ && !drain_until) drain_until = std::chrono::steady_clock::now() + kDrainAtEnd;
    if (drain_until && (waiting_.empty() || std::chrono::steady_clock::now() >= *drain_until)) {
      dropped_.fetch_add(waiting_.size(), std::memory_order_relaxed);
      waiting_.clear();
      told_.notify_all();
      return;
    }
    Event event = std::move(waiting_.front());
    waiting_.pop_front();
    telling_ = true;
    lock.unlock();
    try {
      hook_(event);
    } catch (...) {  // a throwing hook loses its own event, nothing else
    }
    lock.lock();
    telling_ = false;
    told_.notify_all();
  }
}

}  // namespace turnstile::detail
