// SPDX-License-Identifier: Apache-2.0
// Reentrancy for holds acquired asynchronously: per lock object (and its copies), not per
// thread, since a coroutine may resume on any thread. While a lock object's async write hold
// lives (a Lease of it), another lock_async through the same object is nested: a RecursiveMutex
// or SharedMutex counts it (the new Lease shares the hold; the last one released leaves the
// queue), a Mutex refuses it with WouldDeadlock, and a write asked for on top of the object's
// read hold is refused too (upgrades deadlock by nature). Other objects queue as other
// processes would.
#pragma once

#include <memory>
#include <mutex>
#include <string>

#include "core/hold_record.hpp"
#include "core/queue.hpp"
#include "turnstile/error.hpp"

namespace turnstile::detail {

class AsyncHolds {
 public:
  // The hold a nested acquire counts on (nullptr: none, queue as usual). Throws WouldDeadlock
  // as above, HoldLost when the hold it would count on may have been lost.
  std::shared_ptr<HoldRecord> nested(const std::string& name, Primitive primitive, bool shared) {
    std::lock_guard lock(mutex_);
    auto held = write_.lock();
    const bool writing = held && !held->released();
    if (!writing) held = read_.lock();
    if (!held || held->released()) return nullptr;
    if (!writing && !shared) {
      throw WouldDeadlock(
          "this SharedMutex object holds the read lock of '" + name +
          "' (lock_shared_async); asking for the write lock would deadlock (upgrades are not supported)");
    }
    if (writing && primitive == Primitive::mutex) {
      throw WouldDeadlock("this Mutex object holds '" + name +
                          "' through lock_async and Mutex is not reentrant (a RecursiveMutex counts a nested lock)");
    }
    if (held->hold_state() == HoldState::lost) {
      throw HoldLost("this lock object's hold of '" + name + "' may have been lost (" + held->loss_reason() +
                     "); a nested acquire cannot count on it: release it and acquire again");
    }
    return held;
  }
  // A hold this object's async acquire was admitted to.
  void admitted(const std::shared_ptr<HoldRecord>& record, bool shared) {
    std::lock_guard lock(mutex_);
    (shared ? read_ : write_) = record;
  }

 private:
  std::mutex mutex_;
  std::weak_ptr<HoldRecord> write_, read_;
};

}  // namespace turnstile::detail
