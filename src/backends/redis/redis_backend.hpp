// SPDX-License-Identifier: Apache-2.0
// The Redis backend: every state change is one Lua script (scripts/*.lua), so an uncontended
// acquire and a release are one round trip each. Everything one name needs lives in ONE hash
// (eviction or deletion takes all of it or nothing): a queue ordered by fencing tokens that
// keep growing even when that hash is lost (max(last + 1, server time in µs)), whose entries
// are leases renewed by a watchdog on its own connection every TTL/3 and reaped by the next
// script once they run out. Waiters sleep until a message names them, then ask the server: a
// message only wakes, the scripts alone admit. PermitCounter keeps Redisson's RSemaphore layout
// so Java and C++ share permits.
//
// RedisBackend's declaration is the backend's table of contents: the queue places (places.cpp),
// the holds (holds.cpp), the counter lines and changes (counter_line.cpp, counters.cpp), the
// watchdog that renews leases (watchdog.cpp), inspect (inspect.cpp); the key layout (keys.hpp),
// the waiters (waiters.hpp) and the connections (cluster.hpp, connection.hpp).
#pragma once

#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "backends/redis/cluster.hpp"
#include "backends/redis/connection.hpp"
#include "backends/redis/eviction.hpp"
#include "backends/redis/keys.hpp"
#include "backends/redis/request_ids.hpp"
#include "backends/redis/subscriber.hpp"
#include "backends/redis/timeouts.hpp"
#include "backends/redis/waiters.hpp"
#include "core/call_budget.hpp"
#include "core/fork_generation.hpp"
#include "core/guaranteed_removal.hpp"
#include "core/loss_clock.hpp"

namespace turnstile::detail::redis {

class RedisBackend;

// What the watchdog shares with a hold: its lease, and whether its release has begun. Once it
// has, no renewal speaks for the hold: a renewal that crossed the release finds the entry gone
// because the release removed it (the release itself reports a real loss).
struct HoldLease {
  explicit HoldLease(std::shared_ptr<ServerLease> l) : lease(std::move(l)) {}
  std::shared_ptr<ServerLease> lease;
  std::atomic<bool> releasing{false};
};

class RedisHold final : public BackendHold {
 public:
  RedisHold(RedisBackend& backend, std::string name, std::uint64_t seq, std::uint64_t join,
            std::shared_ptr<LossSignal> loss, std::shared_ptr<ServerLease> lease, std::string server);
  ~RedisHold() override;

  std::uint64_t fencing_token() const override { return seq_; }
  void downgrade() override;
  void release() override;
  // Sends the release on an idle command connection and returns: its reply is read by the next
  // call on that connection, or by the watchdog within kCollectOwed (release() when none is idle).
  void release_pipelined(ReleaseDone done) override;
  // "redis1 <request> <seq> <name>": the entry's owner (its acquire's request id) and place.
  std::string receipt() const override;
  // The entry stays until `keep_for` from now by the server's clock, no longer renewed.
  void release_after(milliseconds keep_for) override;
  // proclaim.lua: the candidate's value rewritten while its entry is ours and admitted.
  void proclaim(const std::string& value) override;

  const std::string& name() const { return name_; }
  std::uint64_t seq() const { return seq_; }
  const std::string& request() const { return request_; }
  const std::shared_ptr<HoldLease>& state() const { return state_; }
  // The server (Opened::server) whose script admitted the hold, or where a resharding moved
  // its entry since. Read and changed with the backend's holds_mutex_ held.
  const std::string& server() const { return server_; }
  void moved_to(std::string server) { server_ = std::move(server); }

 private:
  void leave_keeping(milliseconds keep_for);  // zero: removed
  // The release script's arguments (its request opened on first use, then the same for every
  // try); marks the release begun.
  std::vector<std::string> release_args(const QueueKeys& keys, milliseconds keep_for);
  // The release script answered `reply`: the hold is released, or lost when its entry was gone.
  void released(const Reply& reply);

  RedisBackend& backend_;
  std::string name_;
  std::uint64_t seq_;
  std::string server_;
  std::string request_;                // the acquire's request id: the entry's owner
  std::uint64_t release_request_ = 0;  // the release's own number, the same for every try; 0 until the first
  std::shared_ptr<LossSignal> loss_;
  std::shared_ptr<ServerLease> lease_;
  std::shared_ptr<HoldLease> state_;
  bool released_ = false;
  std::uint64_t fork_generation_ = fork_generation();  // a child's copy touches nothing
};

class RedisBackend final : public Backend {
 public:
  RedisBackend(Settings settings, EvictionRule eviction, ErrorHandler warn, const std::string& label);
  ~RedisBackend() override;

  std::unique_ptr<QueuePlace> join(const QueueRequest& request, bool try_once, Deadline deadline,
                                   Standing& first) override;
  std::unique_ptr<CounterLine> counter_line(const std::string& name, std::int64_t permits,
                                            const std::stop_token& stop) override;
  Inspection inspect(const std::string& name, Deadline deadline) override;
  std::vector<Inspection> inspect_each(const std::vector<std::string>& names, Deadline deadline) override;
  QueueNames queue_names(const std::string& prefix, std::size_t max_names, Deadline deadline) override;
  bool keeps_released_holds(EntryKind) const override { return true; }  // release.lua's keep
  bool has_elections() const override { return true; }                  // values in 'v<seq>' (queue_prelude.lua)
  std::unique_ptr<LeaderWatch> watch_leader(const std::string& name) override;
  bool counter_try_set(const std::string& name, std::int64_t permits) override;
  std::int64_t counter_add(const std::string& name, std::int64_t delta) override;
  std::optional<std::int64_t> counter_get(const std::string& name) override;
  std::int64_t counter_drain(const std::string& name) override;
  bool release_receipt(const std::string& receipt, Deadline deadline) override;

  Router& connection() { return connection_; }
  RequestIds& request_ids() { return request_ids_; }
  QueueKeys keys_of(const std::string& name) const { return queue_keys(name, settings_.db); }
  // How long a release is remembered, so a resend after a lost reply is recognised.
  std::string release_memory_ms() const { return std::to_string(request_memory(settings_).count()); }
  // Renewed by the watchdog from now on; lost at once when a failover already moved the name.
  void track(RedisHold* hold);
  // With sentinels: WAIT for min_replicas after the script that admits an entry (a FollowUp
  // for Connection::eval; none without min_replicas). `admitted` reads the script's reply.
  FollowUp replica_wait(Deadline deadline, bool (*admitted)(const redisReply*)) const;
  // Throws NotReplicated unless `reply` (WAIT's) counts min_replicas replicas.
  void check_replicas(const Reply& reply) const;
  // A reply is owed on the command connection (a pipelined release): the watchdog reads it
  // within kCollectOwed unless a call on that connection has read it first.
  void collect_soon() {
    if (!collect_armed_.exchange(true)) wake_watchdog();
  }
  void untrack(RedisHold* hold) {
    std::lock_guard lock(holds_mutex_);
    holds_.erase(hold);
  }

 private:
  friend class RedisPlace;
  friend class RedisCounterLine;
  friend class RedisHold;
  friend class RedisLeaderWatch;

  milliseconds recheck_interval() const { return std::min(kMaxRecheck, settings_.ttl / 3); }
  milliseconds renewal_period() const { return std::max(kMinRenewalPeriod, settings_.ttl / 3); }
  milliseconds renewal_retry() const { return std::min(renewal_period(), kMaxRenewalRetry); }
  static int make_wake_fd() {
    const int fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (fd < 0) throw BackendUnavailable("eventfd failed");
    return fd;
  }
  void on_subscriber_reset();
  // A new connection found another server. With sentinels every hold admitted by another
  // server than `server` is lost: a failover (or a restart) may have lost its entry, or handed
  // the name to someone else, and the holder must not go on believing it holds.
  void on_server_changed(const std::string& server);
  static std::string primary_changed(const std::string& was, const std::string& now);
  // host:port of a server (Opened::server: "host:port run_id").
  static std::string address_of(const std::string& server) { return server.substr(0, server.find(' ')); }
  // With a cluster: by `router`'s map, the node that admitted a hold (`server`) serves the
  // name's slot no more and no slot at all: a failover demoted it, or it is gone. (A node that
  // only gave the slot away to a resharding, or admitted the hold through ASK while the slot
  // moves to it, still serves slots: the renewal's answer decides then, by which node answers.)
  bool demoted(Router& router, const HoldLease& state, const std::string& name, const std::string& server);
  void renew_soon();
  void wake_watchdog();
  void watchdog_loop(std::stop_token stop);
  // The watchdog's sleep until `until`; false when a round is due at once (renew_soon, a stop,
  // the server gone). Reads the replies owed on the command connection kCollectOwed after
  // collect_soon() armed it.
  bool sleep_until(SteadyClock::time_point until, const std::stop_token& stop);
  // What the watchdog renews: a hold's lease, by seq and request id.
  struct Renewal {
    std::shared_ptr<HoldLease> state;
    std::string seq, request;
    std::string server;  // that admitted the hold
  };
  // What one round renews of a name: its holds, then its waiting entries, in one call.
  struct Entries {
    std::vector<Renewal> holds;
    std::vector<Waiters::Queued> queued;  // after the holds, in the same call
  };
  using RoundEntries = std::map<std::string, Entries>;
  // One round: a pipelined call renewing every hold and waiting entry, then the removals that
  // are due (removals_). False when a renewal went unanswered (the next round comes after
  // renewal_retry()). `stop`: the watchdog's, which ends a round in flight (a client's end).
  bool renewal_round(const std::stop_token& stop);
  // The round's snapshot of the holds and waiting entries, by name (leases are shared: a hold
  // may be released and destroyed meanwhile).
  RoundEntries round_entries();
  // With sentinels: the primary they name now; both routers drop connections to another.
  void follow_sentinels();
  // With a cluster: reads the slot map again; holds whose node was demoted are lost, not renewed.
  void drop_demoted(RoundEntries& by_name);
  // With a cluster: whether another node's renewal answer for a hold is its own entry carried
  // there by a resharding (the map read this round still has the hold's node serve slots, so no
  // failover demoted it); then the hold follows its slot (renewal.server and the hold's own).
  bool follows_resharding(Renewal& renewal, long long where, const std::string& server);
  // Applies the round's answers (one Result per name, in order); false when one confirmed nothing.
  bool apply_round(RoundEntries& by_name, const std::vector<Result>& results, SteadyClock::time_point sent_at);
  // Wakes the waiters of a name whose entries the server called admitted or gone; notes the
  // renewal of those it found there (sent at `sent_at`).
  void poke_moved_waiters(const Entries& entries, const Result& result, SteadyClock::time_point sent_at);
  // Applies a name's renewal reply to its holds (the first answers; `queued` waiting entries'
  // answers follow). False when it confirmed nothing for one of them.
  bool settle_renewals(std::vector<Renewal>& holds, const Result& result, SteadyClock::time_point sent_at,
                       const std::string& server, std::size_t queued);
  // Takes the entry of the acquire numbered `join` out of the queue (by seq when known),
  // bounded; when that fails, the watchdog keeps trying (an entry left behind would hold the
  // name up for a TTL). Either way the acquire is retired: a copy of it delivered late creates
  // nothing. `settle_join`: the acquire's outcome was unknown, its number is still in flight.
  // `patience`: how long to wait for the server before the watchdog takes over (0: at once).
  void leave(const std::string& name, const std::string& seq, std::uint64_t join, bool settle_join,
             milliseconds patience = kRedisTimes.leave_try) noexcept;
  // Runs a counter change once (its request marked with a fresh number); when its outcome is
  // unknown, the request is retired in the background before the error reaches the caller.
  Reply counter_change(const QueueKeys& keys, const Script& script,
                       const std::function<std::vector<std::string>(const std::string& marked)>& args_with);

  Settings settings_;
  std::string identity_;      // "<pid> <host>", for inspect
  std::string label_suffix_;  // " <holder label>" after the entry's since, or "" (for inspect)
  // Wakes the watchdog (renew now, or stop). Closed last, after every thread that uses it.
  struct WakeFd {
    int fd;
    ~WakeFd() { close(fd); }
  } wake_fd_;
  RequestIds request_ids_;
  LossClock loss_clock_;  // before every hold's lease
  Router connection_;
  Router renewals_;  // the watchdog's own: renewals never queue behind other calls
  Waiters waiters_;

  // A request given up without an answer (Curator's guaranteed delete is the model): an entry
  // whose removal failed or whose creation's outcome is unknown, a counter change or take whose
  // outcome is unknown. It is retired by one idempotent script call (so that a copy delivered
  // late changes nothing), which removals_ retries from the watchdog's rounds until answered;
  // the numbers it settles stay in flight (holding their key's watermark) until the item ends.
  struct Retirement {
    const Script* script;
    std::vector<std::string> keys, args;
    std::string key;                     // the key whose request numbers `settles` are
    std::vector<std::uint64_t> settles;  // settled once it is answered, given up or dropped
  };
  void retire_later(Retirement retirement);
  // One attempt of a retirement: bounded by removal_budget_ and kRemovalAttempt.
  Removal retire_once(const ScriptCall& call);

  std::atomic<bool> renew_requested_{false};  // renew_soon() since the last round
  std::atomic<bool> collect_armed_{false};    // collect_soon() since the last collection

  std::mutex holds_mutex_;
  std::set<RedisHold*> holds_;
  std::string primary_;     // with sentinels: the server the latest new connection found
  bool map_fresh_ = false;  // with a cluster: this round's drop_demoted read the map (watchdog thread only)

  // Retirements, tried from the watchdog's rounds (Driver::caller) so that they go over the
  // renewal connection, paced by its rounds; declared after what the attempts use
  // (renewals_, request_ids_), so destroyed before it. removal_budget_: what the attempts
  // running now may take (the round's end, or the client's last second); only the thread
  // running them (the watchdog, then the destructor after joining it) touches it.
  GuaranteedRemoval removals_;
  CallBudget removal_budget_;
  milliseconds removal_attempt_cap_ = kRenewalPatience;

  Subscriber subscriber_;  // after the waiter tables: its thread calls into them
  std::jthread watchdog_;  // last: stopped and joined first
};
}  // namespace turnstile::detail::redis
