// SPDX-License-Identifier: Apache-2.0
// The core's async driver: an acquire's step machine (queue_machine.hpp) driven by events on
// the client's pool (async_pool.hpp) instead of a blocked thread. A step runs the storage calls
// on a pool thread; when the machine must wait, the backend arms a wake-up (QueuePlace::arm,
// CounterLine::arm) whose wake posts the next step; a pause before a retry and the deadline are
// the pool's timers; a stop, cancel() and the client's end request the machine's own stop (so
// that a storage call in flight ends) and post a step, which then ends the acquire after leaving
// the queue. One step of an acquire runs at a time; the wake, the timers and the stop only post.
#pragma once

#include <atomic>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>

#include "core/async_pool.hpp"
#include "core/fork_generation.hpp"
#include "core/queue_machine.hpp"
#include "turnstile/async.hpp"

namespace turnstile::detail {

class AsyncAcquire;

// A client's async acquires in progress and the pool that drives them.
class AsyncDriver {
 public:
  // `url`: the client's (named in errors); it outlives the driver.
  AsyncDriver(std::size_t threads, const std::string& url)
      : url_(url), generation_(fork_generation()), pool_(threads) {}
  ~AsyncDriver() { close(); }
  AsyncPool& pool() { return pool_; }
  const std::string& url() const { return url_; }
  // Whether an acquire started on the calling thread takes its first step (join, look, and
  // the hold when admitted at once) right here instead of on the pool. Only on this client's
  // own pool threads: there a step would run anyway, so taking it inline only saves the hop,
  // and an uncontended acquire ends before its starter returns (co_await does not suspend,
  // then() runs at once). Any other thread chose async so as not to wait for a round trip: its
  // first step is posted. Not inside more than kMaxInlineContinuations nested then() callbacks
  // run at once either, so that a chain of callbacks that each start an acquire that ends at
  // once cannot grow the stack without bound (posted, the chain unwinds).
  bool first_step_here() const;
  static constexpr int kMaxInlineContinuations = 16;
  // Keeps `acquire` (it is pending) until remove(), for close() to end it. False when the client
  // is ending: then `acquire` has ended already. A list threaded through the acquires: no
  // allocation, and an acquire that ends in its first step is never added (see start()).
  bool add(const std::shared_ptr<AsyncAcquire>& acquire);
  void remove(AsyncAcquire* acquire);
  // The client's end: every acquire still pending leaves its queue and ends with
  // BackendUnavailable; the pool's threads end (a storage call in flight is stopped first).
  // The leaves share one deadline, kLeavesAtEnd from then: with a server that does not answer
  // the end takes that long, not one leave's patience per acquire; what is not confirmed goes
  // to the backend's background removal (drained by its own bound as the backend ends).
  void close() noexcept;
  static constexpr std::chrono::milliseconds kLeavesAtEnd{1000};

 private:
  const std::string& url_;
  std::mutex mutex_;
  AsyncAcquire* first_ = nullptr;  // the pending acquires (each keeps itself while listed)
  bool closed_ = false;
  std::uint64_t generation_;  // fork_generation() when made
  AsyncPool pool_;
};

class AsyncAcquire : public AsyncOperation, public std::enable_shared_from_this<AsyncAcquire> {
 public:
  AsyncAcquire(AsyncDriver& driver, Deadline deadline)
      : driver_(driver), deadline_(deadline), generation_(fork_generation()) {}
  // Follows `user_stop` and takes the first step here (AsyncDriver::first_step_here) or posts
  // it. Its caller holds a handle of the client (a lock object, a Semaphore, the ClientState),
  // so the client's end cannot begin before start() returns: an acquire whose first step here
  // ends it is never registered with the driver, nor given a deadline timer.
  void start(const std::stop_token& user_stop);
  void cancel() noexcept override;
  // The driver's close(): first told (the machine's stop), then ended once no step runs.
  void client_ending() noexcept;
  // Leaves the queue waiting for the server no later than `leave_by`, then ends.
  void end_at_client_end(Deadline leave_by) noexcept;

 protected:
  // The machine's stop: the user's stop, cancel() and the client's end request it.
  std::stop_token stop_token() const { return stop_.get_token(); }
  bool cancelled() const { return stop_.stop_requested(); }
  bool client_ended() const { return client_ended_.load(); }
  AsyncDriver& driver() const { return driver_; }
  virtual MachineStep step() = 0;
  virtual std::unique_ptr<WakeArm> arm(Wake wake) = 0;
  // Leaves the queue; by `deadline` when given (the client's end: QueuePlace::leave_by).
  virtual void abandon(std::optional<Deadline> deadline = std::nullopt) noexcept = 0;
  // The acquire ended (`error`: what a step threw): the result to its handle, once.
  virtual void deliver(std::exception_ptr error) noexcept = 0;

 private:
  Wake waker();
  void wake() noexcept;
  void post_drive_locked();
  // Registers with the driver and sets the deadline's timer: before the acquire waits. False
  // when the client is ending (the acquire has ended).
  bool register_pending();
  void drive() noexcept;
  // Waits for the next event, or (true) steps again at once because one came already.
  bool wait_for_event(const MachineStep& next, std::unique_ptr<WakeArm> armed);
  // Ends: no wake, timer or stop callback runs afterwards; `leave_by` (the client's end) leaves
  // the queue first, by that deadline; then the handle is told.
  void finish(std::exception_ptr error, std::optional<Deadline> leave_by = std::nullopt) noexcept;
  // In a forked child the acquire is the parent's: its entry, its storage calls and the stop
  // callbacks registered by the parent's threads (which may act on open file descriptions the
  // child shares with the parent) are not the child's to touch (see fork_generation.hpp).
  bool inherited() const noexcept { return generation_ != fork_generation(); }

  AsyncDriver& driver_;
  Deadline deadline_;
  std::uint64_t generation_;  // fork_generation() when made
  std::stop_source stop_;
  std::optional<std::stop_callback<std::function<void()>>> follow_user_stop_;
  mutable std::mutex mutex_;
  bool scheduled_ = false;  // a step is posted or running
  bool waiting_ = false;    // armed or pausing: a wake or timer posts the next step
  bool woken_ = false;      // an event came since the last step began
  bool finished_ = false;
  std::atomic<bool> client_ended_ = false;
  // The driver's list (its mutex): the neighbours, and this acquire kept alive while listed.
  friend class AsyncDriver;
  AsyncAcquire* previous_ = nullptr;
  AsyncAcquire* next_ = nullptr;
  std::shared_ptr<AsyncAcquire> listed_;
  std::atomic<bool> registered_ = false;  // added to the driver (set once, before it can end)
  std::unique_ptr<WakeArm> arm_;
  std::optional<AsyncPool::TimerId> deadline_timer_, pause_timer_;
};

}  // namespace turnstile::detail
