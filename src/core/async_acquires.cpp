// SPDX-License-Identifier: Apache-2.0
// The async acquires a client starts: a queue's (locks, Semaphore leases) and a PermitCounter's,
// each its step machine driven by the core's async driver (async_acquire.hpp).
#include <cstdlib>
#include <string_view>

#include "core/async_acquire.hpp"
#include "core/async_holds.hpp"
#include "core/client_state.hpp"
#include "turnstile/error.hpp"

namespace turnstile::detail {
namespace {

BackendUnavailable client_ended_error(const std::string& url, const std::string& name) {
  return BackendUnavailable("the client of '" + url + "' ended while an acquire of '" + name + "' was pending");
}

// What both acquires share: the client (not kept alive: its end ends them) and a machine.
template <class Machine>
class MachineAcquire : public AsyncAcquire {
 public:
  // A blocking wait for it checks that it could end (ClientState::check_blocking_wait).
  void check_blocking_wait() const override {
    if (!check_blocking_) return;
    if (const auto client = client_.lock()) client->check_blocking_wait(thread_holds_);
  }
  void check_blocking(std::weak_ptr<ThreadHolds> thread_holds) {
    check_blocking_ = true;
    thread_holds_ = std::move(thread_holds);
  }

 protected:
  // `make(stop)` makes the machine on the acquire's own stop.
  template <class Make>
  MachineAcquire(ClientState& client, Deadline deadline, Make make)
      : AsyncAcquire(client.async_driver(), deadline), client_(client.weak_from_this()), machine_(make(stop_token())) {}
  MachineStep step() override { return machine_.step(); }
  std::unique_ptr<WakeArm> arm(Wake wake) override { return machine_.arm(std::move(wake)); }
  void abandon(std::optional<Deadline> deadline) noexcept override { machine_.abandon(deadline); }
  // What ended the acquire: `error`, else the client's end (an error too), else nothing. While
  // the acquire ends the driver lives (see AsyncAcquire::finish), and with it the client's URL.
  std::exception_ptr ending_error(std::exception_ptr error, const std::string& name) const {
    if (error || !client_ended()) return error;
    return std::make_exception_ptr(client_ended_error(driver().url(), name));
  }

  std::weak_ptr<ClientState> client_;
  Machine machine_;
  bool check_blocking_ = false;
  std::weak_ptr<ThreadHolds> thread_holds_;
};

// Counts an async acquire's end in `cells` (its wait since `started`), told as an event when
// asked: admitted with a hold, failed with an error, else stopped or timed out.
void meter_async_end(Telemetry* telemetry, PrimitiveCells* cells, std::size_t primitive, const std::string& name,
                     SteadyClock::time_point started, const std::exception_ptr& error, bool admitted, bool stopped,
                     std::uint64_t token = 0) noexcept {
  if (!telemetry || !cells) return;
  std::string what;
  if (error) {
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& failure) {
      what = failure.what();
    } catch (...) {
    }
  }
  const auto outcome = error      ? AcquireOutcome::failed
                       : admitted ? AcquireOutcome::admitted
                       : stopped  ? AcquireOutcome::stopped
                                  : AcquireOutcome::timed_out;
  telemetry->acquire_ended(*cells, primitive, name, outcome, started, SteadyClock::now(), token, what);
}

// Where an async queue acquire's end goes, at once (no std::function to allocate): the handle's
// state, as a Lease (the lock object's async holds told first) or as the record itself.
struct LeaseSink {
  std::shared_ptr<AsyncState<std::optional<Lease>>> state;
  std::shared_ptr<AsyncHolds> holds;  // none: not made through a lock object
  bool shared = false;
  void fail(std::exception_ptr error) { state->fail(std::move(error)); }
  void none() { state->complete(std::nullopt); }
  void held(std::shared_ptr<ClientState> client, const QueueRequest& request, std::unique_ptr<BackendHold> hold,
            std::shared_ptr<LossSignal> loss) {
    // One allocation for the record and its count (a Lease shares it).
    auto record = std::make_shared<HoldRecord>(std::move(client), request.name, request.permits, std::move(hold),
                                               std::move(loss));
    if (holds) holds->admitted(record, shared);
    state->complete(Lease(std::move(record)));
  }
};
// The record itself, to a handle's state (acquire_through_async) or to a callback (an
// election's campaign).
template <class Deliver>
struct RecordSink {
  Deliver deliver;  // (std::unique_ptr<HoldRecord>, std::exception_ptr)
  void fail(std::exception_ptr error) { deliver(nullptr, std::move(error)); }
  void none() { deliver(nullptr, nullptr); }
  void held(std::shared_ptr<ClientState> client, const QueueRequest& request, std::unique_ptr<BackendHold> hold,
            std::shared_ptr<LossSignal> loss) {
    deliver(std::make_unique<HoldRecord>(std::move(client), request.name, request.permits, std::move(hold),
                                         std::move(loss)),
            nullptr);
  }
};
struct ToRecordState {
  std::shared_ptr<AsyncState<std::unique_ptr<HoldRecord>>> state;
  void operator()(std::unique_ptr<HoldRecord> record, std::exception_ptr error) const {
    if (error) return state->fail(std::move(error));
    state->complete(std::move(record));
  }
};

template <class Sink>
class AsyncQueueAcquire final : public MachineAcquire<QueueMachine> {
 public:
  AsyncQueueAcquire(ClientState& client, QueueRequest request, Deadline deadline, std::shared_ptr<LossSignal> loss,
                    Sink sink)
      : MachineAcquire(client, deadline,
                       [&](std::stop_token stop) {
                         request.stop = std::move(stop);
                         return QueueMachine(client.backend(), std::move(request), deadline, std::move(loss));
                       }),
        sink_(std::move(sink)) {}

 private:
  void deliver(std::exception_ptr error) noexcept override;
  Sink sink_;
  SteadyClock::time_point started_ = SteadyClock::now();
};

template <class Sink>
void AsyncQueueAcquire<Sink>::deliver(std::exception_ptr error) noexcept {
  const auto& request = machine_.request();
  auto hold = machine_.take_hold();
  auto client = client_.lock();  // none: the client is ending
  error = ending_error(std::move(error), request.name);
  if (hold && !client && !error) error = std::make_exception_ptr(client_ended_error(driver().url(), request.name));
  if (hold && (error || cancelled())) {
    // Admitted as it was cancelled (or as the client ended): nothing is held afterwards.
    ClientState::release_unwanted(client, request.name, request.permits, std::move(hold), machine_.loss());
  }
  const auto& loss = *machine_.loss();
  const bool admitted = hold && !error;
  meter_async_end(loss.telemetry(), loss.cells(), loss.primitive(), request.name, started_, error, admitted,
                  cancelled() || request.stop.stop_requested(), admitted ? hold->fencing_token() : 0);
  if (error || !hold) {
    client.reset();  // may be the last handle: the client ends here, before the result is told
    return error ? sink_.fail(std::move(error)) : sink_.none();
  }
  sink_.held(std::move(client), request, std::move(hold), machine_.loss());
}

// Starts a queue acquire whose end goes to `sink`; the acquire (for cancel()), or nullptr when
// it ended at once (a stop requested already: it never joins a queue it would leave at once).
template <class Sink>
std::shared_ptr<AsyncQueueAcquire<Sink>> start_queue_acquire(ClientState& client, QueueRequest request,
                                                             const AsyncOptions& options, Sink sink,
                                                             const std::weak_ptr<ThreadHolds>* blocking_check) {
  if (options.stop.stop_requested()) {
    // Counted as stopped all the same, as an acquire stopped while it waits.
    const auto primitive = metered(request.primitive);
    auto& telemetry = *client.telemetry();
    meter_async_end(&telemetry, &telemetry.cells(request.name, primitive), primitive, request.name, SteadyClock::now(),
                    nullptr, false, true);
    sink.none();
    return nullptr;
  }
  auto loss = client.new_loss_signal(request.name, metered(request.primitive));
  auto acquire = std::make_shared<AsyncQueueAcquire<Sink>>(client, std::move(request), options.deadline,
                                                           std::move(loss), std::move(sink));
  if (blocking_check) acquire->check_blocking(*blocking_check);
  acquire->start(options.stop);
  return acquire;
}

class AsyncCounterAcquire final : public MachineAcquire<CounterMachine> {
 public:
  using State = AsyncState<bool>;
  AsyncCounterAcquire(ClientState& client, const std::string& name, std::int64_t permits, Deadline deadline,
                      std::shared_ptr<State> state)
      : MachineAcquire(client, deadline,
                       [&](std::stop_token stop) {
                         return CounterMachine(client.backend(), name, permits, deadline, std::move(stop));
                       }),
        name_(name), permits_(permits), backend_(client.backend()), state_(std::move(state)),
        telemetry_(client.telemetry()), cells_(&telemetry_->cells(name, kPermitCounter)) {}

 private:
  void deliver(std::exception_ptr error) noexcept override;
  std::string name_;
  std::int64_t permits_;
  Backend& backend_;
  std::shared_ptr<State> state_;
  std::shared_ptr<Telemetry> telemetry_;
  PrimitiveCells* cells_;  // telemetry_'s
  SteadyClock::time_point started_ = SteadyClock::now();
};

// Permits an acquire took that nobody will have: back to the counter (nobody else took them:
// they were ours). One try, never repeated: a counter change is applied at most once (a retry
// after an unanswered add could add them twice).
void give_permits_back(Backend& backend, const std::weak_ptr<ClientState>& client, const std::string& name,
                       std::int64_t permits) noexcept {
  try {
    backend.counter_add(name, permits);
  } catch (const Error& failure) {
    if (auto self = client.lock()) self->report(failure);
  }
}

void AsyncCounterAcquire::deliver(std::exception_ptr error) noexcept {
  bool taken = machine_.taken();
  error = ending_error(std::move(error), name_);
  if (taken && (error || cancelled())) {
    taken = false;  // taken as it was cancelled
    give_permits_back(backend_, client_, name_, permits_);
  }
  meter_async_end(telemetry_.get(), cells_, kPermitCounter, name_, started_, error, taken && !error, cancelled());
  if (error) return state_->fail(std::move(error));
  state_->complete(taken);
}

}  // namespace

Acquiring<std::optional<Lease>> ClientState::acquire_async(QueueRequest request, const AsyncOptions& options,
                                                           const AsyncLockObject* object) {
  if (auto held = try_here(request, options, object)) return Acquiring<std::optional<Lease>>::ended(std::move(*held));
  auto state = std::make_shared<AsyncState<std::optional<Lease>>>();
  Acquiring<std::optional<Lease>> handle(state);
  LeaseSink sink{.state = state, .holds = object ? object->holds : nullptr, .shared = object && object->shared};
  const std::weak_ptr<ThreadHolds> no_thread_holds;
  // Before the start: its first step may end it here, and the handle's state must know it.
  auto acquire = start_queue_acquire(*this, std::move(request), options, std::move(sink),
                                     object ? &object->thread_holds : &no_thread_holds);
  if (acquire && !state->ready()) state->set_operation(acquire);
  return handle;
}

std::shared_ptr<AsyncOperation> ClientState::start_record_async(QueueRequest request, const AsyncOptions& options,
                                                                RecordCallback on_end) {
  const std::weak_ptr<ThreadHolds> no_thread_holds;  // not thread-bound: only the pool's own check
  return start_queue_acquire(*this, std::move(request), options,
                             RecordSink<RecordCallback>{.deliver = std::move(on_end)}, &no_thread_holds);
}

std::optional<Lease> ClientState::try_here(QueueRequest& request, const AsyncOptions& options,
                                           const AsyncLockObject* object) {
  if (!backend().tries_locally() || !async_.first_step_here() || options.stop.stop_requested()) return std::nullopt;
  const auto started = SteadyClock::now();
  auto loss = new_loss_signal(request.name, metered(request.primitive));
  std::unique_ptr<BackendHold> hold;
  try {
    request.stop = options.stop;    // the async acquire that may follow puts its own in
    request.optimistic_try = true;  // not admitted: the async acquire waits as usual
    hold = acquire_in_queue(backend(), request, SteadyClock::now(), loss);  // a passed deadline: one try
    request.optimistic_try = false;
  } catch (const Error&) {
    request.optimistic_try = false;
    return std::nullopt;  // the async acquire meets it again and hands it to get()
  }
  if (!hold) return std::nullopt;
  auto record = std::make_shared<HoldRecord>(shared_from_this(), request.name, request.permits, std::move(hold), loss);
  // Only an admitted try is counted here: else the async acquire that follows counts its end.
  telemetry_->acquire_ended(*loss->cells(), loss->primitive(), request.name, AcquireOutcome::admitted, started,
                            record->held_since(), record->fencing_token());
  if (object && object->holds) object->holds->admitted(record, object->shared);
  return Lease(std::move(record));
}

void ClientState::check_blocking_wait(const std::weak_ptr<ThreadHolds>& holds) {
  if (async_.pool().on_pool_thread()) {
    throw WouldDeadlock(
        "a blocking wait for an async acquire on one of its client's pool threads would hold up "
        "the pool that drives it: co_await it or use then() there");
  }
  const auto thread_holds = holds.lock();
  if (thread_holds && (thread_holds->owns_exclusive() || thread_holds->owns_shared())) {
    throw WouldDeadlock("this thread holds '" + thread_holds->name() +
                        "' through lock(); waiting here for an async acquire of it would wait for itself");
  }
}

Acquiring<bool> ClientState::counter_acquire_async(std::string name, std::int64_t permits,
                                                   const AsyncOptions& options) {
  auto state = std::make_shared<AsyncCounterAcquire::State>();
  Acquiring<bool> handle(state);
  if (options.stop.stop_requested()) {
    meter_async_end(telemetry_.get(), &telemetry_->cells(name, kPermitCounter), kPermitCounter, name,
                    SteadyClock::now(), nullptr, false, true);
    state->complete(false);
    return handle;
  }
  // Taken, but the handle went without get(): nobody knows it has them. Given back on the pool,
  // not in the handle's destructor (which never waits for the network); not at all once the
  // client ends (its backend ends with it).
  state->set_unclaimed([client = weak_from_this(), storage = &backend(), name, permits](bool& taken) {
    const auto self = client.lock();
    if (!taken || !self) return;
    static_cast<void>(self->async_.pool().post([client, storage, name, permits] {
      // While the client lives, so does its backend.
      if (const auto owner = client.lock()) give_permits_back(*storage, client, name, permits);
    }));
  });
  auto acquire = std::make_shared<AsyncCounterAcquire>(*this, std::move(name), permits, options.deadline, state);
  acquire->check_blocking({});
  state->set_operation(acquire);
  acquire->start(options.stop);
  return handle;
}

bool ClientState::blocking_through_async() {
  static const bool through_async = [] {
    const char* value = std::getenv("TURNSTILE_TEST_BLOCKING_THROUGH_ASYNC");
    return value && std::string_view(value) == "1";
  }();
  return through_async;
}

std::unique_ptr<HoldRecord> ClientState::acquire_through_async(const QueueRequest& request, Deadline deadline) {
  auto state = std::make_shared<AsyncState<std::unique_ptr<HoldRecord>>>();
  Acquiring<std::unique_ptr<HoldRecord>> handle(state);
  auto acquire = start_queue_acquire(*this, request, {.deadline = deadline, .stop = request.stop},
                                     RecordSink<ToRecordState>{.deliver = {.state = state}}, nullptr);
  if (acquire) state->set_operation(acquire);
  return handle.get();
}

bool ClientState::counter_acquire_through_async(const std::string& name, std::int64_t permits, Deadline deadline,
                                                const std::stop_token& stop) {
  return counter_acquire_async(name, permits, {.deadline = deadline, .stop = stop}).get();
}

void ClientState::release_unwanted(const std::shared_ptr<ClientState>& client, const std::string& name,
                                   std::int64_t permits, std::unique_ptr<BackendHold> hold,
                                   std::shared_ptr<LossSignal> loss) noexcept {
  if (!client) {
    try {
      hold->release();
    } catch (...) {
      // The client is ending: its session ends with it and takes the entry along.
    }
    return;
  }
  HoldRecord record(client, name, permits, std::move(hold), std::move(loss));  // its end releases
}

}  // namespace turnstile::detail
