// SPDX-License-Identifier: Apache-2.0
// What a backend stores for the one queue algorithm, and the loops that run it (queue_loop.cpp).
//
// The core owns the algorithm (Curator's LockInternals, etcd's concurrency.Mutex): join, look
// where our entry stands, decide with evaluate_queue, wait for the event the verdict names,
// give up on a deadline or a stop, leave on every error, join again when our entry vanished.
// A backend only stores: it adds an entry, reads the entries up to ours, sleeps on an event,
// removes an entry and turns an admitted entry into a hold. Storage that must decide
// atomically (the embedded backend under its robust mutex, Redis in Lua) returns its verdict
// from the same read instead of the entries, through `Standing::decided`.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <stop_token>
#include <string>
#include <vector>

#include "core/call_budget.hpp"
#include "core/loss_signal.hpp"
#include "core/queue.hpp"
#include "turnstile/deadline.hpp"

namespace turnstile::detail {

class BackendHold;

// Thrown by a storage call when our entry is gone although we never left (its session or lease
// ended, the server lost the name's state, the state file was replaced): nothing was held, so
// the core joins again at the back, as a newcomer would (Curator retries the same way).
struct QueueEntryGone : std::exception {
  const char* what() const noexcept override { return "the queue entry vanished"; }
};

// Thrown by QueuePlace::hold when the storage's state moved on since the look that admitted us
// (a versioned write lost a race, a reply was lost and the write found not applied): nothing
// was taken and our entry keeps its place, so the core looks again rather than joining again.
struct QueueChanged : std::exception {
  const char* what() const noexcept override { return "the queue changed since the look"; }
};

// A wake-up armed for one acquire that waits without a thread of its own (the async acquires:
// QueuePlace::arm, CounterLine::arm). Destroying it disarms: once the destructor has returned,
// the wake is neither running nor will it run (a wake running meanwhile is waited for; a wake
// never destroys its own arm, it posts the acquire's next step to the core's pool).
class WakeArm {
 public:
  virtual ~WakeArm() = default;
};
using Wake = std::function<void()>;

// Where our entry stands, as one read of the storage saw it.
struct Standing {
  // The live entries up to and including ours (the last), in queue order: the core evaluates.
  std::vector<QueueEntryView> entries;
  // Set instead when the storage decided in the same atomic step (then `entries` may be empty).
  std::optional<Verdict> decided;
  // The mode and limit the queue has from the others in it (none: nobody else): the core checks
  // them against the request (KindMismatch, LimitMismatch).
  QueueMode mode = QueueMode::none;
  std::int64_t limit = 0;
};

// Our entry in a name's queue, from join until it becomes a hold or leaves.
class QueuePlace {
 public:
  virtual ~QueuePlace() = default;
  // Reads where our entry stands now. Throws QueueEntryGone when it is gone.
  virtual Standing look(Deadline deadline) = 0;
  // Sleeps until the event `verdict` names (about the last look's entries) may have happened,
  // the deadline passes or `stop` is requested. May return early: only a look admits.
  virtual void wait(const Verdict& verdict, Deadline deadline, const std::stop_token& stop) = 0;
  // wait() without a thread: arms a one-shot wake-up for the event `verdict` names and returns
  // at once. `wake` runs at most once, never inside arm(), from a thread the backend has anyway
  // (an event, watch or I/O thread: it must not block), when the event may have happened, or
  // when the backend can no longer watch for it (session or connection lost: the next look
  // tells). It may run early: only a look admits. The deadline and the stop are the core's (it
  // destroys the arm on them); `deadline` bounds what arm() itself does now (setting a watch on
  // the server). Default: wait() on a thread of its own, i.e. a thread per waiter; a backend
  // overrides it with its events.
  virtual std::unique_ptr<WakeArm> arm(const Verdict& verdict, Deadline deadline, Wake wake);
  // The entry was admitted: it becomes the hold, which owns it from now on. nullptr when the
  // admission excluded nobody (the state it was in moved away) and the entry has left: the core
  // joins again. Throws QueueChanged when the admission no longer stands (the core looks again).
  virtual std::unique_ptr<BackendHold> hold(std::shared_ptr<LossSignal> loss) = 0;
  // Leaves the queue. Never throws and does nothing the second time; what it cannot remove now
  // (no answer in time) it removes in the background, never leaving it to hold up the name.
  virtual void leave() noexcept = 0;
  // leave() waiting for the server no later than `deadline` (passed: not at all; what is not
  // confirmed goes to the background at once): a client's end leaves all of its pending async
  // acquires by one deadline, not one leave's patience each. Default: leave(), for a backend
  // whose leave() never waits on a server that does not answer.
  virtual void leave_by(Deadline /*deadline*/) noexcept { leave(); }
};

// How long a leave_by(deadline) may wait for the server: the backend's own leave patience,
// no longer than what is left before `deadline` (zero once it has passed).
inline milliseconds leave_patience(Deadline deadline, milliseconds leave_try) {
  const auto left = CallBudget(deadline).left();
  return left ? std::min(*left, leave_try) : leave_try;
}

class QueueStore {
 public:
  virtual ~QueueStore() = default;
  // True when a try-once join costs no round trip and adds nothing when not admitted (the
  // embedded backend decides under its mutex): an async acquire started on one of the client's
  // pool threads is then first tried right there, as try_lock() would, with no state of its
  // own; only one that must wait becomes an async acquire (ClientState::acquire_async). A
  // network backend says false: the try would cost a contended acquire one more round trip.
  virtual bool tries_locally() const { return false; }
  // Adds our entry at the back of `request.name`'s queue and reports where it stands in `first`.
  // `try_once`: the caller will not wait, so a storage that decides at the join may add nothing
  // and return nullptr (not admitted). Throws KindMismatch, LimitMismatch, QueueFull,
  // BackendUnavailable with nothing left behind.
  virtual std::unique_ptr<QueuePlace> join(const QueueRequest& request, bool try_once, Deadline deadline,
                                           Standing& first) = 0;
};

// Where a PermitCounter acquire stands: the value, and the waiters ahead of it.
struct CounterStanding {
  std::optional<std::int64_t> value;  // none: never set (no permits)
  std::size_t ahead = 0;              // waiters ahead of us; outside the line, all of them
  bool in_line = false;
  bool taken = false;  // the storage took the permits in the same atomic step as the read
};

// One PermitCounter acquire: outside the line first, in it once it has to wait.
class CounterLine {
 public:
  virtual ~CounterLine() = default;
  // Reads the value and our place. `last_try`: the caller will not wait (a storage may then
  // make sure the waiters ahead are alive). May take the permits at once when the counter
  // rules allow it (`taken`). Throws QueueEntryGone when our place in line vanished.
  virtual CounterStanding look(bool last_try, Deadline deadline) = 0;
  // Takes the permits if the value and our place are still as `seen` says, leaving the line in
  // the same step; false when something changed meanwhile (look again).
  virtual bool take(const CounterStanding& seen, Deadline deadline) = 0;
  // Enters the line at its back.
  virtual void join(Deadline deadline) = 0;
  virtual void wait(CounterWait wait, Deadline deadline, const std::stop_token& stop) = 0;
  // wait() without a thread, as QueuePlace::arm.
  virtual std::unique_ptr<WakeArm> arm(CounterWait wait, Deadline deadline, Wake wake);
  // Leaves the line (never throws; idempotent). True when the storage finds that this acquire
  // had taken the permits already (a reply lost on the way): then the acquire succeeded.
  virtual bool leave() noexcept = 0;
};

class CounterStore {
 public:
  virtual ~CounterStore() = default;
  // `stop` is the caller's: every call the line makes should end on it.
  virtual std::unique_ptr<CounterLine> counter_line(const std::string& name, std::int64_t permits,
                                                    const std::stop_token& stop) = 0;
};

// The one queue algorithm: join, then look, decide, wait until admitted, the deadline passes or
// a stop is requested (nullptr; the entry has left). Leaves on every error.
std::unique_ptr<BackendHold> acquire_in_queue(QueueStore& store, const QueueRequest& request, Deadline deadline,
                                              std::shared_ptr<LossSignal> loss);

// What a look means for a waiter, for any driver of the loop (a blocked thread today, events
// later): hold now, give up, or wait for `verdict`'s event.
struct QueueStep {
  enum class Action { hold, give_up, wait } action;
  Verdict verdict;
};
QueueStep next_queue_step(const QueueRequest& request, const Standing& standing, bool may_wait);

// PermitCounter::acquire: taken (true) or not before the deadline or a stop (false).
bool acquire_from_counter(CounterStore& store, const std::string& name, std::int64_t permits, Deadline deadline,
                          const std::stop_token& stop);

}  // namespace turnstile::detail
