// SPDX-License-Identifier: Apache-2.0
// The narrow interface every backend implements. The core (src/core) owns reentrancy, guards,
// MultiLock, loss signalling and release retries; a backend owns only queues and counters.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <stop_token>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/loss_signal.hpp"
#include "core/queue.hpp"
#include "core/queue_store.hpp"
#include "core/telemetry.hpp"
#include "core/url.hpp"
#include "turnstile/client.hpp"
#include "turnstile/deadline.hpp"

namespace turnstile::detail {

// One admitted entry of a queue.
class BackendHold {
 public:
  virtual ~BackendHold() = default;
  virtual std::uint64_t fencing_token() const = 0;
  // An exclusive entry becomes a shared one in place: same position, same token.
  virtual void downgrade() = 0;
  // Leaves the queue. Throws BackendUnavailable (the core retries later) or HoldLost.
  // Once it has succeeded, calling it again does nothing.
  virtual void release() = 0;
  // What another process needs to remove exactly this entry later (Backend::release_receipt):
  // printable text without line breaks; "" where nothing outlives the holder (file://).
  virtual std::string receipt() const { return {}; }
  // Leaves the queue `keep_for` from now instead of now (release_after): the entry stays,
  // admitted, and ends on its own then, by the engine's clock, even when this process is gone
  // by then. Once it has succeeded, release() does nothing. Throws InvalidArgument (nothing
  // changed: release() still works) where the backend cannot keep an entry; else as release().
  virtual void release_after(std::chrono::milliseconds keep_for);
  // The release of unlock() (noexcept: its failures go to the error handler), which need not
  // wait for the server's answer. The backend sends the release now, ordered before any later
  // request of this client on the same connection (so this client's next join of the name
  // finds the entry gone), and calls `done` exactly once when the answer is known, from any
  // thread: an empty exception_ptr when released, else what release() would have thrown (the
  // core retries a BackendUnavailable through its guaranteed removal). The core keeps this
  // hold alive until `done` has run; `done` may destroy it, so nothing of the hold is touched
  // after calling it. `done` runs the error handler and may run loss callbacks: call it where
  // holds' callbacks may run (never on a thread they could wait for). The client's end waits
  // up to 1 s for the `done`s still due; a backend calls the rest by its own end at the latest
  // (with BackendUnavailable: the session's end removes the entry). Default: release(), then
  // `done` at once.
  using ReleaseDone = std::function<void(std::exception_ptr)>;
  virtual void release_pipelined(ReleaseDone done);
  // An election's leader changes its value (Election::proclaim): written only while the entry
  // is still ours, at most once (a copy delivered after its sender gave up changes nothing).
  // Throws HoldLost (the entry is gone: nothing written), BackendUnavailable (outcome unknown).
  // Default: InvalidArgument (the backend has no election layout).
  virtual void proclaim(const std::string& value);
};

// Sleeps until the leader of one name may have changed (LeaderObserver::next): the core reads
// the leader after each wake and reports what differs; waking early costs only a read.
class LeaderWatch {
 public:
  virtual ~LeaderWatch() = default;
  // Returns when the leader may have changed, `deadline` passed or `stop` was requested.
  virtual void wait(Deadline deadline, const std::stop_token& stop) = 0;
};

// The names a backend's scan found that may have queue entries (see Backend::queue_names).
struct QueueNames {
  std::vector<std::string> names;  // in any order; each at most once
  bool complete = true;            // false when the scan stopped at its bound

  // Adds `name`, unless `max_names` are listed already: then the list is incomplete and the
  // scan stops (false).
  bool add(std::string name, std::size_t max_names) {
    if (names.size() == max_names) {
      complete = false;
      return false;
    }
    names.push_back(std::move(name));
    return true;
  }
};

// A backend is storage for the core's queue algorithm (queue_store.hpp) plus the PermitCounter's
// plain operations and inspection.
class Backend : public QueueStore, public CounterStore {
 public:
  ~Backend() override = default;

  // Its calls end by `deadline` when one is given (else by the backend's own call bounds).
  virtual Inspection inspect(const std::string& name, Deadline deadline) = 0;
  // The names starting with `prefix` that may have queue entries, at most `max_names` of them
  // (`complete` false when there were more), found by a bounded scan that reads no entry: the
  // core inspects each one and drops those found empty. Ends by `deadline`. (A backend that
  // cannot list says so: InvalidArgument.)
  virtual QueueNames queue_names(const std::string& /*prefix*/, std::size_t /*max_names*/, Deadline /*deadline*/) {
    throw InvalidArgument("this backend cannot list the names in use (inspect one NAME instead)");
  }

  // inspect() of each name, in order, by one deadline; a backend that can ask about many names
  // in one round trip does (Client::names_in_use inspects every candidate).
  virtual std::vector<Inspection> inspect_each(const std::vector<std::string>& names, Deadline deadline) {
    std::vector<Inspection> queues;
    for (const auto& name : names) queues.push_back(inspect(name, deadline));
    return queues;
  }
  // Whether its holds of `kind` implement BackendHold::release_after (Client::can_release_after).
  virtual bool keeps_released_holds(EntryKind) const { return false; }
  // Whether it has an election layout (Primitive::election requests, BackendHold::proclaim, the
  // candidates' values in inspect). Without one the core refuses Client::election at once.
  virtual bool has_elections() const { return false; }
  // What wakes a LeaderObserver. Default: a poll every kLeaderPoll (a backend with events for
  // leader changes overrides it).
  virtual std::unique_ptr<LeaderWatch> watch_leader(const std::string& name);
  static constexpr std::chrono::milliseconds kLeaderPoll{500};

  // PermitCounter: a number changed atomically; its waiters are served by the core's loop.
  virtual bool counter_try_set(const std::string& name, std::int64_t permits) = 0;
  virtual std::int64_t counter_add(const std::string& name, std::int64_t delta) = 0;
  virtual std::optional<std::int64_t> counter_get(const std::string& name) = 0;
  virtual std::int64_t counter_drain(const std::string& name) = 0;

  // Removes the entry a BackendHold::receipt() names, if it is still there, by `deadline`;
  // true when it was there. Never touches another entry. Throws InvalidArgument (not a
  // receipt of this backend), BackendUnavailable. Default: nothing to remove.
  virtual bool release_receipt(const std::string& receipt, Deadline /*deadline*/) {
    throw InvalidArgument("not a release receipt of this backend: '" + receipt + "'");
  }
  // Removes what the backend keeps for names starting with `prefix` that nobody holds, waits
  // for or counts with (Client::collect_unused), and says what it removed. Only the embedded
  // backend keeps such state; a network backend's entries end with their sessions or leases.
  virtual std::vector<std::string> collect_unused([[maybe_unused]] const std::string& prefix) { return {}; }
};

// A backend's entry point (turnstile_backend_factory_v2 in a module). `reports` lives as long as
// the backend: it reports its renewals and connections there (file:// has neither).
using BackendFactory = std::unique_ptr<Backend> (*)(const BackendUrl& url, const ClientOptions& options,
                                                    BackendReports& reports);

// Throws InvalidArgument unless `name` is a valid turnstile name (see Client).
void validate_name(std::string_view name);

}  // namespace turnstile::detail
