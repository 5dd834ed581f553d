// The Consul backend (consul_backend.cpp, places.cpp): storage for the core's queue loop in
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
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stop_token>
#include <string>
#include <thread>

#include "backends/consul/counter_markers.hpp"
#include "backends/consul/http.hpp"
#include "backends/consul/keys.hpp"
#include "backends/consul/layout.hpp"
#include "backends/consul/refusals.hpp"
#include "backends/consul/sessions.hpp"
#include "core/backend.hpp"
#include "turnstile/error.hpp"

namespace turnstile::detail::consul {

using std::chrono::milliseconds;

// The fixed waits, each in one place with why.
// An ordinary call's longest timeout: a Consul answer takes milliseconds; past this the
// server is unreachable for this call (the caller's deadline may end it sooner).
constexpr milliseconds kCallCap{10000};
// The least time a call that must reach Consul once gets (a try-once join, a release).
constexpr milliseconds kCallFloor{1000};
// The least a call of a timed acquire gets however little is left: it may overrun the deadline
// by this much when the server stalls, rather than fail a call a healthy server answers at once.
constexpr milliseconds kTimedCallFloor{250};
// A blocking query's longest `wait`: the waiter then looks again (Consul's default is 5 min).
constexpr milliseconds kBlockingWaitMax{60000};
// Beyond `wait`, Consul adds up to wait/16 of jitter; plus room for the answer itself.
constexpr milliseconds kBlockingSlack{2000};
// After an acquire refused by a lock-delay, look again this soon (api.Lock waits 5 s).
constexpr milliseconds kLockDelayRetry{1000};
// A release or a downgrade gets this long (a failed release is retried in the background by the
// core); a release of a hold already reported lost only this, so its caller is not kept waiting
// on a dead link.
constexpr milliseconds kReleaseTry{2000};
constexpr milliseconds kLostReleaseTry{250};
// A leave tries this long in the caller's thread before the background takes it over.
constexpr milliseconds kLeaveTry{500};
// A blocking query cut at the caller's deadline may end this much later (curl's own timer).
constexpr milliseconds kDeadlineGrace{50};
// What a leave or a given-up join could not remove at once is retried this often, for this long.
constexpr milliseconds kCleanupRetry{500};
constexpr milliseconds kCleanupGiveUp{60000};
// A call that found no server, or a CAS that lost a race, is tried again after this, doubling up
// to kResendBackoffMax: an outage (a restart) is waited through within the caller's deadline.
constexpr milliseconds kResendBackoff{50};
constexpr milliseconds kResendBackoffMax{1000};
// How many times a CAS that lost a race (a release's `.lock`, a counter's value) is tried before
// its caller hears of it: each try after a pause as above, so a busy peer never meets a hot loop.
constexpr int kCasRaces = 32;

struct Settings {
  Endpoint endpoint;
  SessionSettings session;
  milliseconds connect_timeout = kCallCap;  // ClientOptions::connect_timeout, else kCallCap
  std::string label;                        // ClientOptions::holder_label
};

Settings parse_settings(const BackendUrl& url, const ClientOptions& options);

// Removals retried in the background until done (true) or given up; nothing thrown.
class Cleanup {
 public:
  Cleanup();
  ~Cleanup();
  void add(std::function<bool()> job);

 private:
  void run(std::stop_token stop);
  struct Job {
    std::function<bool()> work;
    SteadyClock::time_point give_up;
  };
  std::mutex mutex_;
  std::condition_variable_any wake_;
  std::deque<Job> jobs_;
  std::jthread thread_;
};

class ConsulBackend final : public Backend {
 public:
  explicit ConsulBackend(Settings settings);
  ~ConsulBackend() override;

  std::unique_ptr<QueuePlace> join(const QueueRequest& request, bool try_once, Deadline deadline,
                                   Standing& first) override;
  std::unique_ptr<CounterLine> counter_line(const std::string& name, std::int64_t permits,
                                            const std::stop_token& stop) override;
  Inspection inspect(const std::string& name, Deadline deadline) override;
  bool counter_try_set(const std::string& name, std::int64_t permits) override;
  std::int64_t counter_add(const std::string& name, std::int64_t delta) override;
  std::optional<std::int64_t> counter_get(const std::string& name) override;
  std::int64_t counter_drain(const std::string& name) override;

  // --- for the places, holds and lines (places.cpp) ---
  Http& http() { return http_; }
  Sessions& sessions() { return sessions_; }
  Cleanup& cleanup() { return cleanup_; }
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
  // After a call found no server: sleeps `backoff` (then doubles it) within the deadline and
  // the stop; false when either ended it (the caller gives up).
  bool pause_before_resend(Deadline deadline, const std::stop_token& stop, milliseconds& backoff);
  // Runs `look_once` (a read of a queue or a line) again while no server answers (a restart),
  // until the deadline or a stop: then `gave_up` is returned. One that was due already (try
  // once) reports the unreachable server instead.
  template <typename Standing, typename Look>
  Standing look_resending(Deadline deadline, const std::stop_token& stop, Look look_once, Standing gave_up) {
    const bool due = deadline && *deadline <= SteadyClock::now();
    for (auto backoff = kResendBackoff;;) {
      try {
        return look_once();
      } catch (const BackendUnavailable&) {
        if (due) throw;
        if (!pause_before_resend(deadline, stop, backoff)) return gave_up;
      }
    }
  }
  // A blocking query on `target` until it changes, the deadline or a stop. One that found no
  // server pauses a little and returns: the caller's look resends (an outage is waited through).
  void block(const WaitTarget& target, Deadline deadline, const std::stop_token& stop);
  // The same on several targets at once, until any of them changes.
  void block(const std::vector<WaitTarget>& targets, Deadline deadline, const std::stop_token& stop);
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
  // call; it is then settled at once (kCallFloor), as after a lost reply. One marker, one call.
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
  // the marker written "void" (retried until done, the session gone, or kCleanupGiveUp).
  bool settle_change(const std::string& key, const CounterSeen& seen, const ChangeMarker& marker,
                     SteadyClock::time_point until);
  void void_in_background(const std::string& key, const CounterSeen& seen, const ChangeMarker& marker);
  // A marker's value: nullopt when absent, else whether its change applied (not "void").
  std::optional<bool> marker_says_applied(const ChangeMarker& marker);
  // PUT/DELETE answering true/false (false also for an acquire whose session is gone).
  bool write(const char* method, const std::string& path, const std::string& body, milliseconds timeout,
             const std::string& context);

 private:
  Http http_;
  Sessions sessions_;
  SettledMarkers markers_;  // before cleanup_: its jobs use it until cleanup_'s thread ends
  Cleanup cleanup_;
  std::atomic<std::uint64_t> entries_{0};
  std::string host_;
  std::string label_;
  std::mutex released_mutex_;
  std::map<std::string, std::uint64_t> released_locks_;  // name -> ModifyIndex, bounded
};

// The timeout of one call under the caller's deadline: what is left of it, at least
// kTimedCallFloor (or `floor` if less), at most kCallCap; `floor` once the deadline has passed
// (a try-once acquire still reaches Consul once).
milliseconds call_timeout(Deadline deadline, milliseconds floor = kCallFloor);

// Transaction operations (Consul's /v1/txn KV verbs).
nlohmann::json kv_op(const char* verb, const std::string& key);
nlohmann::json kv_lock(const std::string& key, const std::string& value, std::uint64_t flags, const std::string& session);
nlohmann::json kv_unlock(const std::string& key, std::uint64_t flags, const std::string& session);
nlohmann::json kv_check_session(const std::string& key, const std::string& session);

std::unique_ptr<QueuePlace> make_place(ConsulBackend& backend, const QueueRequest& request, Deadline deadline,
                                       Standing& first);
std::unique_ptr<CounterLine> make_counter_line(ConsulBackend& backend, const std::string& name, std::int64_t permits,
                                               const std::stop_token& stop);

}  // namespace turnstile::detail::consul
