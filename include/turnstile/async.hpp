// SPDX-License-Identifier: Apache-2.0
// Asynchronous acquires: Mutex::lock_async(), SharedMutex::lock_shared_async(),
// Semaphore::acquire_async(n), PermitCounter::acquire_async(n) and MultiLock::lock_async()
// return an Acquiring<T>, an acquire in progress that waits without a thread of its own.
//
// The client drives every async acquire on a small pool of its own threads
// (ClientOptions::async_threads, default 2): the storage calls (join, look, hold, leave) run
// there, and while the acquire waits in line it costs no thread: the backend's events (a watch,
// a Pub/Sub message, a watch stream, a blocking query on a shared I/O thread) wake it up.
//
// An Acquiring<T> can be
//   - waited on like a std::future: get() (blocks, returns the result or rethrows), wait(),
//     wait_for(d), ready();
//   - co_awaited from any C++20 coroutine: `auto lease = co_await mutex.lock_async();` (the
//     coroutine resumes on a client pool thread, or goes on at once when the acquire had ended:
//     started on one of its client's pool threads, an acquire takes its first step there, so an
//     uncontended one has ended when lock_async() returns);
//   - given a completion callback: `std::move(acquiring).then([](Acquiring<T> done) {...})`,
//     called once with the ended acquire (its get() does not block) on a client pool thread, or
//     at once in the calling thread when it had ended already. Callbacks and coroutines resumed
//     on a pool thread must not block there for long: the pool is small and drives every acquire
//     of the client.
// cancel(), the AsyncOptions' stop and deadline end the acquire with "not acquired" (nullopt,
// false): it has left the queue and holds nothing, also when it was admitted just as it was
// cancelled (that hold is released). Destroying an Acquiring that has not ended cancels it;
// destroying one that ended with a hold nobody took (get()) releases the hold, and with
// PermitCounter's permits nobody took gives them back (in the background, one try: a change
// of a counter is never applied twice). Ending the client (its
// last handle) ends the acquires still pending with BackendUnavailable.
//
// Holds acquired asynchronously belong to their Lease, not to a thread: any thread (a coroutine
// resumed elsewhere) may use and release them; see docs/guide.md ("Asynchronous acquires").
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <coroutine>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <thread>
#include <utility>

#include "turnstile/deadline.hpp"
#include "turnstile/error.hpp"

namespace turnstile {

// How an async acquire may end early: at `deadline` (none: no time limit; a time already past
// means one attempt, as try_lock()), or when `stop` is requested. Either way the acquire ends
// with "not acquired", after leaving the queue.
struct AsyncOptions {
  Deadline deadline{};
  std::stop_token stop{};
};

template <class T>
class Acquiring;

namespace detail {

// The acquire in progress, as its handle sees it (the client's driver implements it).
class AsyncOperation {
 public:
  virtual ~AsyncOperation() = default;
  // Ends the acquire with "not acquired" unless it has ended; never blocks on the network.
  virtual void cancel() noexcept = 0;
  // Run before a blocking get() or wait() of an acquire that has not ended: throws WouldDeadlock
  // where that wait could never end. Default: no such case.
  virtual void check_blocking_wait() const {}
};

// Counts, per thread, the then() callbacks running at once inside then() (the acquire had
// ended): the driver stops ending acquires inline beyond a depth (async_acquire.hpp).
class InlineContinuation {
 public:
  InlineContinuation() noexcept;
  ~InlineContinuation();
  InlineContinuation(const InlineContinuation&) = delete;
  InlineContinuation& operator=(const InlineContinuation&) = delete;
};

// What an acquire and its handle share: the result, and who to tell when it comes.
template <class T>
class AsyncState {
 public:
  using Continuation = std::function<void()>;

  // The driver's side: called once, from a client pool thread.
  void complete(T value) {
    finish([&] { value_.emplace(std::move(value)); });
  }
  void fail(std::exception_ptr error) {
    finish([&] { error_ = std::move(error); });
  }
  void set_operation(std::weak_ptr<AsyncOperation> operation) {
    std::lock_guard lock(mutex_);
    operation_ = std::move(operation);
  }
  // Whether the result is there (also read without the mutex: set under it, after the result).
  bool ready() const noexcept { return ready_.load(std::memory_order_acquire); }
  // Run once with the result when the last handle goes without having taken it (get()): a
  // PermitCounter gives back the permits nobody learned it took. Must not throw.
  void set_unclaimed(std::function<void(T&)> unclaimed) {
    std::lock_guard lock(mutex_);
    unclaimed_ = std::move(unclaimed);
  }

 private:
  friend class Acquiring<T>;
  template <class Store>
  void finish(Store store) {
    Continuation next;
    std::function<void(T&)> unclaimed;
    {
      std::lock_guard lock(mutex_);
      if (ready_.load(std::memory_order_relaxed)) return;
      store();
      ready_.store(true, std::memory_order_release);
      next = std::move(continuation_);
      continuation_ = nullptr;
      if (next) resuming_ = std::this_thread::get_id();
      if (abandoned_) unclaimed = take_unclaimed_locked();
    }
    ended_.notify_all();
    if (unclaimed) unclaimed(*value_);
    if (!next) return;
    next();
    std::lock_guard lock(mutex_);
    resuming_ = std::thread::id();
    ended_.notify_all();
  }

  void cancel() noexcept {
    std::shared_ptr<AsyncOperation> operation;
    {
      std::lock_guard lock(mutex_);
      if (ready()) return;
      operation = operation_.lock();
    }
    if (operation) operation->cancel();
  }

  // Waits (the mutex held by `lock`) until the result is there, after the operation's check
  // that this wait could end (outside the mutex: it may lock the client's).
  void wait_locked(std::unique_lock<std::mutex>& lock) {
    if (ready()) return;
    if (const auto operation = operation_.lock()) {
      lock.unlock();
      operation->check_blocking_wait();
      lock.lock();
    }
    ended_.wait(lock, [&] { return ready(); });
  }

  // The handle goes away (abandon()). An ended acquire whose result was taken, the common end,
  // needs one look under the mutex; else as forget_continuation(), cancel(), drop_unclaimed().
  void abandon() noexcept {
    {
      std::lock_guard lock(mutex_);
      if (ready() && taken_ && resuming_ == std::thread::id()) {
        continuation_ = nullptr;
        abandoned_ = true;
        return;
      }
    }
    forget_continuation();
    cancel();
    drop_unclaimed();
  }

  // The handle goes away: nobody is to be resumed any more, and a continuation running on
  // another thread (a coroutine being resumed) is waited for.
  void forget_continuation() noexcept {
    std::unique_lock lock(mutex_);
    continuation_ = nullptr;
    ended_.wait(lock, [&] { return resuming_ == std::thread::id() || resuming_ == std::this_thread::get_id(); });
  }

  // The handle goes away: a result it ended with and nobody took goes to set_unclaimed's hook;
  // one that is still coming goes there when it comes (the acquire may be past the point where
  // the handle's cancel() could stop it: it then ends with a result nobody will take).
  void drop_unclaimed() noexcept {
    std::function<void(T&)> unclaimed;
    {
      std::lock_guard lock(mutex_);
      abandoned_ = true;
      if (!ready()) return;
      unclaimed = take_unclaimed_locked();
    }
    if (unclaimed) unclaimed(*value_);
  }
  std::function<void(T&)> take_unclaimed_locked() {
    if (taken_ || !value_ || !unclaimed_) return {};
    taken_ = true;
    return std::move(unclaimed_);
  }

  // Registers `next` unless the result is there (then false: the caller goes on at once).
  bool set_continuation(Continuation next) {
    std::lock_guard lock(mutex_);
    if (ready()) return false;
    continuation_ = std::move(next);
    return true;
  }

  mutable std::mutex mutex_;
  std::condition_variable ended_;
  std::atomic<bool> ready_ = false;
  bool taken_ = false;
  bool abandoned_ = false;  // the last handle went
  std::optional<T> value_;
  std::exception_ptr error_;
  Continuation continuation_;
  std::thread::id resuming_;
  std::weak_ptr<AsyncOperation> operation_;
  std::function<void(T&)> unclaimed_;
};

}  // namespace detail

// An acquire in progress (see above). Movable, not copyable. T is std::optional<Lease> for the
// locks and Semaphore (nullopt: not acquired), bool for PermitCounter (false: not acquired).
template <class T>
class [[nodiscard]] Acquiring {
 public:
  using value_type = T;

  explicit Acquiring(std::shared_ptr<detail::AsyncState<T>> state) : state_(std::move(state)) {}
  // An acquire that ended before it needed a state of its own (tried and admitted on the thread
  // that started it): the handle holds the result. Only for a result that releases itself when
  // dropped untaken (a Lease), as the state's set_unclaimed hook is not there.
  static Acquiring ended(T value) {
    Acquiring handle(nullptr);
    handle.ended_.emplace(std::move(value));
    return handle;
  }
  Acquiring(Acquiring&& other) noexcept
      : state_(std::move(other.state_)), ended_(std::move(other.ended_)), ended_taken_(other.ended_taken_) {
    other.ended_.reset();
  }
  Acquiring& operator=(Acquiring&& other) noexcept {
    if (this != &other) {
      abandon();
      state_ = std::move(other.state_);
      ended_ = std::move(other.ended_);
      ended_taken_ = other.ended_taken_;
      other.ended_.reset();
    }
    return *this;
  }
  Acquiring(const Acquiring&) = delete;
  Acquiring& operator=(const Acquiring&) = delete;
  // Cancels an acquire that has not ended; a result nobody took is dropped (a Lease released).
  ~Acquiring() { abandon(); }

  // Whether the acquire has ended (get() will not block).
  bool ready() const { return ended_ || state().ready(); }
  // Waits for the end. Throws WouldDeadlock, at once, where that wait could never end: on a
  // thread that holds the same name through the thread-bound API (lock()), or on one of the
  // client's pool threads (co_await or then() there instead).
  void wait() const {
    if (ended_) return;
    std::unique_lock lock(state().mutex_);
    state().wait_locked(lock);
  }
  // True when the acquire ended within `timeout`.
  template <class Rep, class Period>
  bool wait_for(const std::chrono::duration<Rep, Period>& timeout) const {
    if (ended_) return true;
    std::unique_lock lock(state().mutex_);
    return state().ended_.wait_for(lock, timeout, [&] { return state().ready(); });
  }
  // Waits for the end, then returns the result (once: a second get() throws InvalidArgument)
  // or rethrows what ended the acquire (KindMismatch, BackendUnavailable, ...).
  T get() {
    if (ended_) {
      if (std::exchange(ended_taken_, true)) throw InvalidArgument(kTakenAlready);
      return std::move(*ended_);
    }
    std::unique_lock lock(state().mutex_);
    state().wait_locked(lock);
    if (state().taken_) throw InvalidArgument(kTakenAlready);
    state().taken_ = true;
    // The error leaves the state: the thread that catches it holds its last reference, so it is
    // destroyed there, not later on a pool thread (whose release TSan cannot order: libstdc++'s
    // exception counts are not instrumented).
    if (state().error_) std::rethrow_exception(std::exchange(state().error_, nullptr));
    return std::move(*state().value_);
  }
  // Ends the acquire with "not acquired" (nullopt, false) unless it has ended already; returns
  // without waiting for the queue to be left (get() or wait() do).
  void cancel() noexcept {
    if (state_) state_->cancel();
  }
  // Calls `callback(Acquiring<T>)` once the acquire has ended, handing it this handle (its get()
  // does not block); see the file comment for the thread it runs on. The callback must not
  // throw. Consumes the handle: `std::move(acquiring).then(...)`.
  template <class Callback>
  void then(Callback callback) && {
    if (ended_) {
      detail::InlineContinuation nested;
      callback(Acquiring<T>(std::move(*this)));
      return;
    }
    auto state = std::move(state_);
    auto run = [state, callback = std::move(callback)]() mutable { callback(Acquiring<T>(state)); };
    auto* handle_state = state.get();
    if (handle_state->set_continuation(run)) return;
    detail::InlineContinuation nested;
    run();
  }

  // The awaitable: `co_await acquiring` (or a temporary) gives get()'s result.
  bool await_ready() const { return ready(); }
  bool await_suspend(std::coroutine_handle<> coroutine) {
    return !ended_ && state().set_continuation([coroutine] { coroutine.resume(); });
  }
  T await_resume() { return get(); }

 private:
  detail::AsyncState<T>& state() const {
    if (!state_) throw InvalidArgument("this Acquiring was moved from");
    return *state_;
  }
  void abandon() noexcept {
    ended_.reset();  // a result nobody took: a Lease releases itself
    if (!state_) return;
    state_->abandon();
    state_.reset();
  }
  static constexpr const char* kTakenAlready = "this acquire's result was taken already";

  std::shared_ptr<detail::AsyncState<T>> state_;
  std::optional<T> ended_;  // see ended(); then there is no state
  bool ended_taken_ = false;
};

}  // namespace turnstile
