// SPDX-License-Identifier: Apache-2.0
// What a Client shares with every primitive it made: the backend, the error handler, the
// per-name thread-hold tables, and the background removal of holds whose release failed.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "core/async_acquire.hpp"
#include "core/backend.hpp"
#include "core/backend_loader.hpp"
#include "core/guaranteed_removal.hpp"
#include "core/hold_record.hpp"
#include "core/thread_holds.hpp"
#include "turnstile/async.hpp"
#include "turnstile/lease.hpp"

namespace turnstile::detail {

class PendingReleases;  // client_state.cpp
class AsyncHolds;       // async_holds.hpp

// The lock object an async acquire is made through (LockHandle): its async holds learn of the
// hold (reentrancy per object), and a blocking wait on a thread holding the name through the
// thread-bound API is refused (see ClientState::check_blocking_wait).
struct AsyncLockObject {
  std::shared_ptr<AsyncHolds> holds;
  bool shared = false;
  std::weak_ptr<ThreadHolds> thread_holds;
};

class ClientState : public std::enable_shared_from_this<ClientState> {
 public:
  // `usable_after_fork`: the backend works in a forked child (the embedded one does); else
  // every call in a child throws BackendUnavailable and the child's copy is never torn down.
  // `telemetry`: the client's counters and event hook, whose BackendReports `backend` uses
  // (none: a fresh one, for a backend made without it).
  ClientState(std::string url, OwnedBackend backend, ClientOptions options, bool usable_after_fork,
              std::shared_ptr<Telemetry> telemetry = nullptr);
  ~ClientState();

  const std::string& url() const { return url_; }
  // Throws BackendUnavailable in a forked child when the backend does not survive fork.
  Backend& backend();
  void report(const Error& error) noexcept;
  void set_error_handler(ErrorHandler handler);
  // The loss signal of a hold on `name` to be acquired through `primitive` (a metered() index):
  // it carries the cells the acquire, the hold and its losses are counted in.
  std::shared_ptr<LossSignal> new_loss_signal(const std::string& name, std::size_t primitive);
  const std::shared_ptr<Telemetry>& telemetry() const { return telemetry_; }
  Metrics metrics() const;
  // The table of the threads' holds of lock `name` (one per name while any lock handle lives).
  std::shared_ptr<ThreadHolds> thread_holds(const std::string& name);
  // Takes over a hold whose release failed and retries it in the background until it succeeds,
  // fails for good (reported), or the client ends.
  void retry_release_later(std::string name, std::shared_ptr<BackendHold> hold);
  // unlock()'s release of the hold on `name` (BackendHold::release_pipelined): sent now, its
  // outcome handled as release_outcome() says when the answer comes (reported, retried). The
  // client's end waits for the answers still due (bounded, with the background retries).
  void release_pipelined(const std::string& name, std::uint64_t token, std::unique_ptr<BackendHold> hold,
                         std::shared_ptr<LossSignal> loss) noexcept;
  bool unlock_without_waiting() const { return options_.unlock_without_waiting; }
  // Acquires through the backend and wraps the result; nullptr on timeout or a requested stop.
  std::unique_ptr<HoldRecord> acquire(const QueueRequest& request, Deadline deadline);
  // The same without a thread (async_acquires.cpp), its hold as a Lease; `object`: the lock
  // object it is made through, if any. The request's own stop is replaced by the acquire's
  // (options.stop, cancel(), the client's end).
  Acquiring<std::optional<Lease>> acquire_async(QueueRequest request, const AsyncOptions& options,
                                                const AsyncLockObject* object = nullptr);
  // An async queue acquire whose end goes to `on_end` as the record itself (an election's
  // campaign): told once, on a pool thread (or at once: a stop requested already), with the
  // record, nothing (not admitted) or the error. Returns the acquire, for cancel() (nullptr when
  // it ended at once); a blocking wait for it on a pool thread is WouldDeadlock.
  using RecordCallback = std::function<void(std::unique_ptr<HoldRecord> record, std::exception_ptr error)>;
  std::shared_ptr<AsyncOperation> start_record_async(QueueRequest request, const AsyncOptions& options,
                                                     RecordCallback on_end);
  // acquire_async()'s try on the calling thread (QueueStore::tries_locally): the hold when it
  // was admitted at once; nullopt when it was not tried, not admitted, or failed (the async
  // acquire then joins as usual, and meets an error again to hand it to get()).
  std::optional<Lease> try_here(QueueRequest& request, const AsyncOptions& options, const AsyncLockObject* object);
  // The test suites' second entry point (TURNSTILE_TEST_BLOCKING_THROUGH_ASYNC=1 in the
  // environment, read once): every blocking acquire of the process runs as an async acquire
  // that the calling thread waits for, so the conformance suite's acquire tests exercise the
  // async driver and each backend's arm(). Off otherwise: the blocking path has no thread hop.
  static bool blocking_through_async();
  std::unique_ptr<HoldRecord> acquire_through_async(const QueueRequest& request, Deadline deadline);
  bool counter_acquire_through_async(const std::string& name, std::int64_t permits, Deadline deadline,
                                     const std::stop_token& stop);
  // What a blocking get() or wait() of an async acquire checks first (AsyncOperation's
  // check_blocking_wait): WouldDeadlock on one of this client's pool threads (it would hold up
  // the pool that must drive the acquire) and, given the name's thread holds, on a thread that
  // holds the name through the thread-bound API (the acquire would wait for the thread that
  // waits for it).
  void check_blocking_wait(const std::weak_ptr<ThreadHolds>& holds);
  AsyncDriver& async_driver() { return async_; }
  // PermitCounter::acquire_async.
  Acquiring<bool> counter_acquire_async(std::string name, std::int64_t permits, const AsyncOptions& options);
  // Releases a hold nobody wants (an async acquire admitted as it was cancelled) without
  // throwing: through `client` (failures reported, retried in the background), or plainly when
  // the client is ending (none).
  static void release_unwanted(const std::shared_ptr<ClientState>& client, const std::string& name,
                               std::int64_t permits, std::unique_ptr<BackendHold> hold,
                               std::shared_ptr<LossSignal> loss) noexcept;

 private:
  // The acquire's end (its outcome and wait) in `loss`'s cells; nullptr or the record, as given.
  std::unique_ptr<HoldRecord> meter_acquire(const QueueRequest& request, const LossSignal& loss,
                                            SteadyClock::time_point started, std::unique_ptr<HoldRecord> record);

  std::string url_;
  std::shared_ptr<Telemetry> telemetry_;  // before backend_: its BackendReports outlive the backend
  OwnedBackend backend_;
  bool usable_after_fork_;
  std::uint64_t fork_generation_;  // when connected
  ClientOptions options_;
  std::mutex handler_mutex_;
  ErrorHandler error_handler_;
  std::shared_ptr<const LossSignal::Callbacks> hold_callbacks_;  // shared by every LossSignal, not copied

  std::mutex holds_mutex_;
  std::unordered_map<std::string, std::weak_ptr<ThreadHolds>> thread_holds_;

  // The pipelined releases whose answer is still due (shared with their completions, which may
  // come from a backend's thread until the client's end closes it).
  std::shared_ptr<PendingReleases> pending_releases_;
  // After backend_ (its attempts use the backend) and the handler (it reports): destroyed first.
  GuaranteedRemoval releases_;
  // Closed first by the destructor: its acquires use the backend and report.
  AsyncDriver async_;
};

}  // namespace turnstile::detail
