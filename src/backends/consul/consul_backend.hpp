// SPDX-License-Identifier: Apache-2.0
// The Consul backend (consul_backend.cpp, places.cpp, inspection.cpp): storage for the core's queue loop in
// Consul's KV store, on the layouts of api.Lock (Mutex) and api.Semaphore (Semaphore).
//
// Every contender writes a queue entry turnstile/q/<name key>/<session>-<n>, acquired by the
// client's main session (Behavior delete: it dies with it), ordered by CreateIndex; the core
// decides on the entries up to ours. A holder the peers know of and turnstile's queue does not
// (an api.Lock session on the name's key, api.Semaphore holders in `.lock`) is shown to the core
// at the front, so turnstile waits for it; the head of the queue then takes the peers' key in
// the same transaction that marks its entry held, so a peer is always excluded in Consul itself.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stop_token>
#include <string>

#include "backends/consul/blocking_queries.hpp"
#include "backends/consul/counter_markers.hpp"
#include "backends/consul/http.hpp"
#include "backends/consul/keys.hpp"
#include "backends/consul/layout.hpp"
#include "backends/consul/refusals.hpp"
#include "backends/consul/retired_joins.hpp"
#include "backends/consul/sessions.hpp"
#include "backends/consul/timeouts.hpp"
#include "core/backend.hpp"
#include "core/call_budget.hpp"
#include "core/guaranteed_removal.hpp"
#include "turnstile/error.hpp"

namespace turnstile::detail::consul {

struct Settings {
  Endpoint endpoint;
  SessionSettings session;
  milliseconds connect_timeout = kConsulTimes.call.cap;  // ClientOptions::connect_timeout, else the cap
  std::string label;                                     // ClientOptions::holder_label
};

Settings parse_settings(const BackendUrl& url, const ClientOptions& options);

class ConsulBackend final : public Backend {
 public:
  explicit ConsulBackend(Settings settings);
  ~ConsulBackend() override;

  std::unique_ptr<QueuePlace> join(const QueueRequest& request, bool try_once, Deadline deadline,
                                   Standing& first) override;
  std::unique_ptr<CounterLine> counter_line(const std::string& name, std::int64_t permits,
                                            const std::stop_token& stop) override;
  Inspection inspect(const std::string& name, Deadline deadline) override;  // inspection.cpp
  QueueNames queue_names(const std::string& prefix, std::size_t max_names,
                         Deadline deadline) override;  // inspection.cpp
  // Locks, not leases (holds.cpp).
  bool keeps_released_holds(EntryKind kind) const override { return kind != EntryKind::lease; }
  // The leader-election guide's key NAME, with api.Lock's flags (election.hpp).
  bool has_elections() const override { return true; }
  std::unique_ptr<LeaderWatch> watch_leader(const std::string& name) override;  // election.cpp
  bool counter_try_set(const std::string& name, std::int64_t permits) override;
  std::int64_t counter_add(const std::string& name, std::int64_t delta) override;
  std::optional<std::int64_t> counter_get(const std::string& name) override;
  std::int64_t counter_drain(const std::string& name) override;
  bool release_receipt(const std::string& receipt, Deadline deadline) override;  // holds.cpp

  // --- for the places, holds and lines (places.cpp) ---
  Http& http() { return http_; }
  Sessions& sessions() { return sessions_; }
  // Removals the caller's thread could not finish (leaves, given-up joins, unknown outcomes).
  GuaranteedRemoval& removals() { return removals_; }
  // The markers of ended joins, removed after kRetiredKeep (retired_joins.hpp).
  RetiredJoins& retired_joins() { return retired_; }
  std::string next_id(const std::string& session_id) { return session_id + "-" + std::to_string(++entries_); }
  EntryValue new_value(const QueueRequest& request) const;
  // GET a key or (recurse) a prefix: its entries (none when 404) and X-Consul-Index.
  // A `stop` ends a call at once, as BackendUnavailable (no answer).
  std::vector<KvEntry> read(const std::string& key, bool recurse, milliseconds timeout, std::uint64_t* index = nullptr,
                            const std::stop_token& stop = {});
  // PUT /v1/txn: the KV results, or nullopt when Consul refused it (409: a check, CAS or lock
  // failed; each failed operation with its reason in `refused`, when given). A refusal of the
  // ACL throws AccessDenied, one with a reason nobody expects (or none) BackendUnavailable.
  std::optional<std::vector<KvEntry>> txn(const nlohmann::json& ops, milliseconds timeout, const std::string& context,
                                          Refused* refused = nullptr, const std::stop_token& stop = {});
  // The api.Lock key of `name` as this client last left it (released, ModifyIndex), so an
  // uncontended exclusive join can take it in one transaction that checks it is still so
  // (forgotten when a join finds it moved on).
  std::optional<std::uint64_t> released_lock_index(const std::string& name);
  void note_released_lock(const std::string& name, std::optional<std::uint64_t> index);
  // Whether an exclusive join of `name` last found others in line (its one-step take refused
  // by the occupancy key): the next join then skips that take, which would only be refused
  // again, until a join finds itself alone in line.
  bool crowded(const std::string& name);
  void note_crowded(const std::string& name, bool crowded);
  // After a call found no server, or a CAS lost a race: sleeps `backoff` (then doubles it, up
  // to kResendBackoffMax) within the budget; false when its deadline or stop ended it (the
  // caller gives up).
  bool pause_before_retry(const CallBudget& budget, milliseconds& backoff);
  // Runs `look_once` (a read of a queue or a line) again while no server answers (a restart),
  // until the budget's deadline or stop: then `gave_up` is returned. One that was due already
  // (try once) reports the unreachable server instead.
  template <typename Standing, typename Look>
  Standing look_resending(const CallBudget& budget, Look look_once, Standing gave_up) {
    const bool due = detail::passed(budget.deadline());
    for (auto backoff = kResendBackoff;;) {
      try {
        return look_once();
      } catch (const BackendUnavailable&) {
        if (due) throw;
        if (!pause_before_retry(budget, backoff)) return gave_up;
      }
    }
  }
  // A blocking query on `target` until it changes, the deadline or a stop. One that found no
  // server pauses a little and returns: the caller's look resends (an outage is waited through).
  void block(const WaitTarget& target, const CallBudget& budget);
  // The same on several targets at once, until any of them changes. Returns the index of the
  // client's shared answer that ended it (QueryWake's `answer`), else 0.
  std::uint64_t block(const std::vector<WaitTarget>& targets, const CallBudget& budget);
  // block() without a thread (QueuePlace::arm, CounterLine::arm): the queries run on the
  // client's one I/O thread, whose wake gets the typed error of an unexpected answer, if any.
  std::unique_ptr<WakeArm> arm_block(const std::vector<WaitTarget>& targets, const Deadline& deadline, QueryWake wake);
  BlockingQueries& blocking_queries() { return queries_; }
  // A PermitCounter's key as one read saw it (index 0: absent).
  struct CounterSeen {
    std::optional<CounterValue> value;
    std::uint64_t index = 0;
  };
  CounterSeen read_counter(const std::string& key, milliseconds timeout);
  // A new request marker for one counter change, on the client's main session (made if none).
  ChangeMarker new_marker(milliseconds timeout);
  // Changes the counter at `key` from `seen` to `n` by CAS, with `marker` and `extra` ops in the
  // same transaction (counter_markers.hpp): true when applied (also when only a resend of it was,
  // or its reply was lost and its marker is there), false when it did not apply and no copy of it
  // ever will (someone else's change came first, its session is gone, or it was voided). Throws
  // BackendUnavailable when neither could be told within `timeout`. A `stop` cuts the change's
  // call; it is then settled at once (within the one-shot floor), as after a lost reply. One marker, one call.
  bool change_counter(const std::string& key, const CounterSeen& seen, std::int64_t n, const nlohmann::json& extra,
                      const ChangeMarker& marker, milliseconds timeout, const std::string& context,
                      const std::stop_token& stop = {});
  // After an unknown outcome: whether the change with `marker` (a CAS on `seen`) applied; once
  // this answers false, no copy of it can apply any more (its marker is written "void" unless it
  // is there). Throws BackendUnavailable when that cannot be told by `until`, or after a bounded
  // number of looks, or when the marker's session is gone and the counter moved on meanwhile.
  bool counter_change_applied(const std::string& key, const CounterSeen& seen, const ChangeMarker& marker,
                              SteadyClock::time_point until);
  // counter_change_applied's look, and what it leaves to the background when it cannot tell:
  // the marker written "void" (retried until done, the session gone, or the background gives up).
  bool settle_change(const std::string& key, const CounterSeen& seen, const ChangeMarker& marker,
                     SteadyClock::time_point until);
  // One look of settle_change: whether it applied, nullopt when that cannot be told yet.
  std::optional<bool> settle_once(const std::string& key, const CounterSeen& seen, const ChangeMarker& marker);
  void void_in_background(const std::string& key, const CounterSeen& seen, const ChangeMarker& marker);
  // A marker's value: nullopt when absent, else whether its change applied (not "void").
  std::optional<bool> marker_says_applied(const ChangeMarker& marker);
  // PUT/DELETE answering true/false (false also for an acquire whose session is gone).
  bool write(const char* method, const std::string& path, const std::string& body, milliseconds timeout,
             const std::string& context);

 private:
  // What a wait on `targets` sends (consul_backend.cpp).
  BlockingPlan plan_block(const std::vector<WaitTarget>& targets, const Deadline& deadline) const;

  Http http_;
  Sessions sessions_;
  BlockingQueries queries_;  // the waits' I/O thread: stopped before the sessions end
  SettledMarkers markers_;
  RetiredJoins retired_;  // before removals_: its batches' jobs use it
  std::atomic<std::uint64_t> entries_{0};
  std::string host_;
  std::string label_;
  std::mutex released_mutex_;
  std::map<std::string, std::uint64_t> released_locks_;  // name -> ModifyIndex, bounded
  std::set<std::string> crowded_;                        // names, bounded (see crowded)
  // Last: destroyed (its thread joined) before everything its attempts use.
  GuaranteedRemoval removals_{kConsulTimes.background};
};

// Transaction operations (Consul's /v1/txn KV verbs).
nlohmann::json kv_op(const char* verb, const std::string& key);
nlohmann::json kv_lock(const std::string& key, const std::string& value, std::uint64_t flags,
                       const std::string& session);
nlohmann::json kv_unlock(const std::string& key, std::uint64_t flags, const std::string& session);
nlohmann::json kv_check_session(const std::string& key, const std::string& session);

std::unique_ptr<QueuePlace> make_place(ConsulBackend& backend, const QueueRequest& request, bool try_once,
                                       Deadline deadline, Standing& first);
std::unique_ptr<CounterLine> make_counter_line(ConsulBackend& backend, const std::string& name, std::int64_t permits,
                                               const std::stop_token& stop);

}  // namespace turnstile::detail::consul
