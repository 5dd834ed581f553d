// SPDX-License-Identifier: Apache-2.0
// A Client's shared state (client_state.hpp).
#include "core/client_state.hpp"

#include <condition_variable>
#include <cstdio>
#include <exception>

#include "core/fork_generation.hpp"
#include "turnstile/error.hpp"

namespace turnstile::detail {
namespace {

// A failed release is retried without a give-up bound: until it is removed, the entry keeps
// excluding everyone else while this client's session (which it keeps renewing) lives, so
// giving up would leave the name held by nobody who knows it. Each attempt is bounded by the
// backend's own release limits, and the pauses grow to 5 s: a long outage costs one call per
// 5 s per hold. The client's end tries once more and then closes the session, which frees it.
constexpr Backoff kReleaseRetry{.first_pause = milliseconds(100), .last_pause = milliseconds(5000), .give_up = {}};
// A client's end tries the pending releases for at most this long (the process may be exiting).
constexpr milliseconds kReleaseDrain{1000};

// What an unlock() cannot throw goes to the error handler.
void report_failure(ClientState& client, const std::exception_ptr& failure) noexcept {
  try {
    std::rethrow_exception(failure);
  } catch (const Error& error) {
    client.report(error);
  } catch (const std::exception& error) {
    client.report(BackendUnavailable(error.what()));
  } catch (...) {
    client.report(BackendUnavailable("the release failed with an unknown error"));
  }
}

}  // namespace

// The pipelined releases of one client whose answer is still due. Their completions may come
// from a backend's thread: they reach the client only until its end has closed this.
class PendingReleases {
 public:
  explicit PendingReleases(ClientState& client) : client_(&client) {}
  void begin() {
    std::lock_guard lock(mutex_);
    ++due_;
  }
  // An answer came: `handle` runs with the client, unless the client's end is past its wait
  // (its sessions, which end with it, take the entry with them).
  template <class Handle>
  void finish(Handle handle) noexcept {
    ClientState* client = nullptr;
    {
      std::lock_guard lock(mutex_);
      client = client_;
      if (client) ++running_;
    }
    if (client) handle(*client);
    {
      std::lock_guard lock(mutex_);
      --due_;
      if (client) --running_;
    }
    changed_.notify_all();
  }
  // The client's end: waits for the answers still due until `until`, then lets go of the client
  // (after the handlers running now end).
  void close(SteadyClock::time_point until) {
    std::unique_lock lock(mutex_);
    changed_.wait_until(lock, until, [&] { return due_ == 0; });
    client_ = nullptr;
    changed_.wait(lock, [&] { return running_ == 0; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  ClientState* client_;
  std::size_t due_ = 0;
  std::size_t running_ = 0;
};

ClientState::ClientState(std::string url, OwnedBackend backend, ClientOptions options, bool usable_after_fork,
                         std::shared_ptr<Telemetry> telemetry)
    : url_(std::move(url)),
      telemetry_(telemetry ? std::move(telemetry)
                           : std::make_shared<Telemetry>("unknown", options.metrics_name_label, options.on_event)),
      backend_(std::move(backend)), usable_after_fork_(usable_after_fork), fork_generation_(fork_generation()),
      options_(std::move(options)), error_handler_(options_.error_handler),
      hold_callbacks_(std::make_shared<const LossSignal::Callbacks>(LossSignal::Callbacks{
          .on_lost = options_.on_hold_lost, .on_state = options_.on_hold_state, .telemetry = telemetry_})),
      pending_releases_(std::make_shared<PendingReleases>(*this)),
      releases_(kReleaseRetry,
                [this](const std::string&, std::exception_ptr error) {
                  try {
                    std::rethrow_exception(error);
                  } catch (const Error& failure) {
                    report(failure);  // lost or refused: nothing left to release
                  } catch (const std::exception& failure) {
                    report(BackendUnavailable(failure.what()));
                  }
                }),
      async_(options_.async_threads, url_) {}

ClientState::~ClientState() {
  // The async acquires still pending leave their queues first, while everything they use lives.
  async_.close();
  // One last try for releases still pending: the process may be about to exit. In a forked
  // child, the parent's are dropped (they are the parent's), as are its connections. The
  // pipelined releases' answers come first: those that fail are retried by the drain.
  const bool forked = fork_generation_ != fork_generation();
  pending_releases_->close(forked ? SteadyClock::now() : SteadyClock::now() + kReleaseDrain);
  releases_.drain(kReleaseDrain);
  if (!usable_after_fork_ && forked) static_cast<void>(backend_.release());
}

Backend& ClientState::backend() {
  if (!usable_after_fork_ && fork_generation_ != fork_generation()) {
    throw BackendUnavailable("this client of '" + url_ +
                             "' was connected before fork(): its connections belong to the parent; connect a new "
                             "Client in the child");
  }
  return *backend_;
}

void ClientState::report(const Error& error) noexcept {
  ErrorHandler handler;
  {
    std::lock_guard lock(handler_mutex_);
    handler = error_handler_;
  }
  try {
    if (handler) {
      handler(error);
      return;
    }
  } catch (...) {
  }
  std::fprintf(stderr, "turnstile: %s\n", error.what());
}

void ClientState::set_error_handler(ErrorHandler handler) {
  std::lock_guard lock(handler_mutex_);
  error_handler_ = std::move(handler);
}

std::shared_ptr<LossSignal> ClientState::new_loss_signal(const std::string& name, std::size_t primitive) {
  return std::make_shared<LossSignal>(name, hold_callbacks_, primitive, &telemetry_->cells(name, primitive));
}

Metrics ClientState::metrics() const { return telemetry_->snapshot(releases_.pending()); }

std::shared_ptr<ThreadHolds> ClientState::thread_holds(const std::string& name) {
  std::lock_guard lock(holds_mutex_);
  auto& slot = thread_holds_[name];
  if (auto holds = slot.lock()) return holds;
  auto holds = std::make_shared<ThreadHolds>(shared_from_this(), name);
  slot = holds;
  return holds;
}

std::unique_ptr<HoldRecord> ClientState::acquire(const QueueRequest& request, Deadline deadline) {
  if (request.stop.stop_requested()) {
    // It never joins a queue it would leave at once, but it was stopped all the same: counted
    // as an acquire stopped while waiting is.
    const auto primitive = metered(request.primitive);
    const auto now = SteadyClock::now();
    telemetry_->acquire_ended(telemetry_->cells(request.name, primitive), primitive, request.name,
                              AcquireOutcome::stopped, now, now);
    return nullptr;
  }
  if (blocking_through_async()) return acquire_through_async(request, deadline);
  const auto started = SteadyClock::now();
  auto loss = new_loss_signal(request.name, metered(request.primitive));
  std::unique_ptr<BackendHold> hold;
  try {
    hold = acquire_in_queue(backend(), request, deadline, loss);
  } catch (const std::exception& error) {
    telemetry_->acquire_ended(*loss->cells(), loss->primitive(), request.name, AcquireOutcome::failed, started,
                              SteadyClock::now(), 0, error.what());
    throw;
  }
  if (!hold) return meter_acquire(request, *loss, started, nullptr);
  auto record = std::make_unique<HoldRecord>(shared_from_this(), request.name, request.permits, std::move(hold), loss);
  return meter_acquire(request, *loss, started, std::move(record));
}

std::unique_ptr<HoldRecord> ClientState::meter_acquire(const QueueRequest& request, const LossSignal& loss,
                                                       SteadyClock::time_point started,
                                                       std::unique_ptr<HoldRecord> record) {
  const auto outcome = record                          ? AcquireOutcome::admitted
                       : request.stop.stop_requested() ? AcquireOutcome::stopped
                                                       : AcquireOutcome::timed_out;
  const auto ended = record ? record->held_since() : SteadyClock::now();
  telemetry_->acquire_ended(*loss.cells(), loss.primitive(), request.name, outcome, started, ended,
                            record ? record->fencing_token() : 0);
  return record;
}

void ClientState::retry_release_later(std::string name, std::shared_ptr<BackendHold> hold) {
  // std::function needs a copyable callable: the hold is shared with the attempt.
  releases_.add("the hold on '" + name + "'", [shared = std::move(hold), telemetry = telemetry_] {
    telemetry->removal_retried();
    shared->release();  // BackendUnavailable: again later; HoldLost and others: reported once
    return Removal::done;
  });
}

void ClientState::release_pipelined(const std::string& name, std::uint64_t token, std::unique_ptr<BackendHold> hold,
                                    std::shared_ptr<LossSignal> loss) noexcept {
  std::shared_ptr<BackendHold> shared = std::move(hold);
  BackendHold* sender = shared.get();
  try {
    BackendHold::ReleaseDone done = [pending = pending_releases_, name, token, loss = std::move(loss),
                                     hold = std::move(shared)](std::exception_ptr error) {
      pending->finish([&](ClientState& client) {
        try {
          if (auto failure = release_outcome(client, name, token, *loss, hold, error)) report_failure(client, failure);
        } catch (...) {
          report_failure(client, std::current_exception());
        }
      });
    };
    pending_releases_->begin();
    sender->release_pipelined(std::move(done));
  } catch (...) {
    report_failure(*this, std::current_exception());
  }
}

}  // namespace turnstile::detail
