// SPDX-License-Identifier: Apache-2.0
// The etcd backend: storage for the core's queue algorithm on etcd's concurrency.Mutex layout,
// generalised to every queue primitive. A client's lease (ClientLease) is one etcd lease, kept
// alive every TTL/3. A contender of NAME puts the key NAME/<lease id in hex> (exclusive
// entries: exactly etcdctl lock's key) or NAME/<lease id in hex>_<n> (shared and lease
// entries) in a Txn guarded by "create revision == 0"; the queue is every key directly under
// NAME/ with exactly that syntax, in create-revision order (keys of a name nested below,
// NAME/x/..., are never counted), the create revision is the fencing token, and a waiter
// watches the one key it depends on (or, for Semaphore leases, the deletions under the
// prefix). So `etcdctl lock NAME` and turnstile exclude each other both ways; an entry written
// by anyone else (etcdctl's empty value) is an exclusive one. Elections use
// concurrency.Election's layout on the same queue (the value raw in the key, and a side key of
// turnstile's beside it: layout.hpp kCandidatePrefix; election.cpp).
//
// Beyond etcd 3.4's Mutex: after every wait the own key is read again, and a waiter whose lease
// ended is never admitted on it (etcd-io/etcd#11456, #19597: the core joins again on a new
// lease); exclusive keys are one per (lease, name), so threads of one client queue locally
// first (etcd-io/etcd#11360); a release deletes the key only if its create revision is still
// ours (etcd-io/etcd#22082).
//
// Loss: each lease is a ServerLease of the core's LossClock (last confirmed keep-alive's send
// time + granted TTL - TTL/10). Late copies: every join, take and counter change Txn is guarded
// by its request's marker (request_markers.hpp), which the join puts whatever its outcome and the
// clean-up of a request whose reply was lost puts too: a copy of a join that reaches etcd
// after its sender was answered, held, released or left changes nothing. Leaving with an entry
// of unknown outcome puts that marker and deletes the key (if it holds the join's value) in
// one Txn. Such leaves, and leaves that fail, are retried by a background thread until done
// or the lease is gone. A release writes a receipt (a key on the lease) with its delete, so a
// retry whose first reply was lost can tell "released by me" from "gone before".
#pragma once

#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "backends/etcd/connection.hpp"
#include "backends/etcd/key_watcher.hpp"
#include "backends/etcd/layout.hpp"
#include "backends/etcd/request_markers.hpp"
#include "backends/etcd/timeouts.hpp"
#include "core/call_budget.hpp"
#include "core/deadline_mutex.hpp"
#include "core/guaranteed_removal.hpp"
#include "core/loss_clock.hpp"

namespace turnstile::detail::etcd {

// --- leases and holds ----------------------------------------------------------------------

// One etcd lease of this client: the life of every key it writes while the lease lasts.
struct ClientLease {
  std::int64_t id = 0;
  std::string hex;  // the lease id as keys spell it
  // The core's loss rule for this lease; every hold riding on it is attached.
  std::shared_ptr<ServerLease> server_lease;
  // Attached to server_lease like a hold: tells the backend at once when the clock reports the
  // lease lost, so waiters stop and the lease is no longer used or kept alive.
  std::shared_ptr<LossSignal> watcher;
  // Guarded by the backend's mutex:
  milliseconds ttl{0};                 // as granted (and as keep-alive replies repeat it)
  SteadyClock::time_point next_round;  // the keeper's next keep-alive
  bool lost = false;                   // neither used for new entries nor kept alive any more
  bool gone = false;                   // etcd no longer has the lease: its keys are gone
  bool check_now = false;              // the keeper sends a keep-alive at once (a held key went)
  bool revoked_by_client = false;      // by the client's end: its holds were released with it
  int unresolved_takes = 0;            // PermitCounter takes whose marker (on it) is still to be read
  // The markers of this lease's joins and takes (thread-safe on its own).
  std::unique_ptr<RequestMarkers> markers;
  std::set<WatchStream*> waits;
  // A key this client wrote on the lease (so it may read it, whatever its etcd role): the
  // keep-alive's term check reads it. Empty until the first entry.
  std::string readable_key;
};

class EtcdBackend;

// A ticket in this client's local line for a name's exclusive key (one per lease and name; the
// line's front has the turn), left on destruction unless handed on (to the hold, or to a
// clean-up still removing the key).
struct LocalTurn {
  EtcdBackend* backend = nullptr;
  std::string name;
  std::uint64_t ticket = 0;
  bool in_line = false;
  LocalTurn(EtcdBackend* owner, std::string turn_name, std::uint64_t turn_ticket, bool is_in_line)
      : backend(owner), name(std::move(turn_name)), ticket(turn_ticket), in_line(is_in_line) {}
  LocalTurn(const LocalTurn&) = delete;
  LocalTurn& operator=(const LocalTurn&) = delete;
  ~LocalTurn();
};

// How a clean-up is run (EtcdBackend::run_cleanup).
struct CleanupOptions {
  // A local turn still held is kept until the clean-up is done (the key may exist).
  LocalTurn* turn = nullptr;
  // The try in the caller's thread: until the budget's deadline or stop (none at all when it
  // has passed already), an endpoint tried `attempt_cap` before the next.
  CallBudget first_try = CallBudget(SteadyClock::now() + kEtcdTimes.leave_try);
  milliseconds attempt_cap = kAttemptCap;
  // Runs once it is done (or moot: the lease is gone).
  std::function<void()> finished{};
  // What the background tries instead of the Txn, when given (it throws until done).
  std::function<void(const CallBudget&)> later{};
};

// What a queue's join does with the election candidates' side keys (kCandidatePrefix): none
// (a PermitCounter's line), reads them with the queue (a lock's), or puts ours too (a
// candidate's, with this "<pid> <host> <since ms>").
struct SideKeys {
  bool read = false;
  std::optional<std::string> put{};
};

class EtcdBackend final : public Backend {
 public:
  // --- its life (etcd_backend.cpp) ----------------------------------------------------------
  explicit EtcdBackend(Settings settings);
  ~EtcdBackend() override;
  // With live_backends()'s mutex held, at exit.
  void end_at_exit() noexcept;

  // --- the Backend interface ----------------------------------------------------------------
  // places.cpp: a queue entry from join to hold to release.
  std::unique_ptr<QueuePlace> join(const QueueRequest& request, bool try_once, Deadline deadline,
                                   Standing& first) override;
  // counter_line.cpp: a PermitCounter acquire's waiter key and take.
  std::unique_ptr<CounterLine> counter_line(const std::string& name, std::int64_t permits,
                                            const std::stop_token& stop) override;
  // counter.cpp: inspection and the PermitCounter's plain operations.
  Inspection inspect(const std::string& name, Deadline deadline) override;
  QueueNames queue_names(const std::string& prefix, std::size_t max_names, Deadline deadline) override;
  bool keeps_released_holds(EntryKind) const override { return true; }  // a lease of its own (places.cpp)
  // election.cpp: concurrency.Election's layout (places.cpp joins and proclaims).
  bool has_elections() const override { return true; }
  std::unique_ptr<LeaderWatch> watch_leader(const std::string& name) override;
  bool counter_try_set(const std::string& name, std::int64_t permits) override;
  std::int64_t counter_add(const std::string& name, std::int64_t delta) override;
  std::optional<std::int64_t> counter_get(const std::string& name) override;
  std::int64_t counter_drain(const std::string& name) override;
  // places.cpp: removes a dead holder's entry by its key and create revision.
  bool release_receipt(const std::string& receipt, Deadline deadline) override;

  // --- what places, holds and lines use ----------------------------------------------------
  Connection& connection() { return connection_; }
  KeyWatcher& key_watcher() { return key_watcher_; }
  const std::string& identity() const { return identity_; }
  const std::string& label_suffix() const { return label_suffix_; }
  // A number no other request of this client has (it makes keys and values unique).
  std::uint64_t next_request() { return ++unique_; }
  // Release and take receipts whose call has its answer: deleted by later releases and takes
  // (places.cpp).
  std::vector<std::string> receipts_to_delete();
  void receipts_deleted(const std::vector<std::string>& keys);
  void receipt_done(std::string key);
  // This client's turns for a name's exclusive key (etcd_backend.cpp; see LocalTurn): a ticket
  // at the back of the name's local line, whether it has the turn (is the front), the blocking
  // wait for it (false on the budget's deadline or stop), a wake-up when it comes (async
  // waiters), and leaving the line (which gives the turn to the next ticket).
  std::uint64_t queue_local_turn(const std::string& name);
  bool has_local_turn(const std::string& name, std::uint64_t ticket);
  bool wait_local_turn(const std::string& name, std::uint64_t ticket, const CallBudget& budget);
  std::unique_ptr<WakeArm> arm_local_turn(const std::string& name, std::uint64_t ticket, Wake wake);
  void leave_local_turn(const std::string& name, std::uint64_t ticket);

  // --- the lease (lease_keeper.cpp) --------------------------------------------------------
  // This client's lease for new keys (a new one when the current one is lost), granted within
  // `call` (its deadline is set: see CallBudget::for_call).
  std::shared_ptr<ClientLease> client_lease(const CallBudget& call);
  bool lease_gone(const ClientLease& lease) {
    std::lock_guard lock(mutex_);
    return lease.gone;
  }
  bool lease_lost(const ClientLease& lease) {
    std::lock_guard lock(mutex_);
    return lease.lost;
  }
  bool revoked_by_client(const ClientLease& lease) {
    std::lock_guard lock(mutex_);
    return lease.revoked_by_client;
  }
  // A take's receipt on `lease` is to be read (+1) or was read or given up (-1): the client does
  // not revoke a lease it gave up while one is (the receipt would go with it).
  void count_unresolved_take(ClientLease& lease, int delta) {
    std::lock_guard lock(mutex_);
    lease.unresolved_takes += delta;
  }
  // The lease is gone or must be given up: its holds are told (`reason`), its waiters stop,
  // the keeper stops renewing it and, unless etcd said it is gone, it is revoked in the
  // background.
  void lose_lease(const std::shared_ptr<ClientLease>& lease, const std::string& reason, bool gone);

  // --- lines: joining and waiting (lines.cpp) ----------------------------------------------
  // An entry put at the back of a line (a queue, or a PermitCounter's waiters).
  struct Joined {
    std::shared_ptr<ClientLease> lease;
    std::string key;
    std::string value;
    std::int64_t created = 0;      // the entry's create revision
    pb::RangeResponse range;       // the line's entries
    std::int64_t revision = 0;     // the store's revision when the entry was seen
    pb::RangeResponse candidates;  // the queue's candidates' side keys (SideKeys::read, put)
    std::uint64_t request = 0;     // the join's number (its marker's, its side key's)
  };

  // The key and value of an entry on `lease` for request number `request`.
  using EntryMaker =
      std::function<std::pair<std::string, std::string>(const ClientLease& lease, std::uint64_t request)>;
  // Puts an entry under `prefix` and reads the line in the same round trip; once more on a new
  // lease when etcd no longer knew the current one. Throws BackendUnavailable with the entry
  // left in the background, holding on to `turn` until it is gone; CallStopped on the budget's
  // stop.
  Joined join_line(const std::string& prefix, const EntryMaker& entry, const CallBudget& budget, LocalTurn* turn,
                   const SideKeys& side = {});
  // Waits for `after`'s events of the watch (or its end, the budget's deadline or stop, or the
  // lease's loss). `changed_already`, when given, is asked once the watch exists: how many of
  // those events happened before the watch began.
  void wait_for_change(ClientLease& lease, const pb::WatchCreateRequest& watch, const CallBudget& budget,
                       const WakeAfter& after = {}, const std::function<std::int64_t()>& changed_already = {});
  // wait_for_change without a thread (QueuePlace::arm, CounterLine::arm): `wake` runs once on
  // the key watcher's worker after `after`'s events of `watch` (give it a start revision), the
  // watch's end (compacted) or the lease's loss.
  std::unique_ptr<WakeArm> arm_watch(ClientLease& lease, const pb::WatchCreateRequest& watch, Wake wake,
                                     WakeAfter after = {});

  // --- clean-ups: a leave or a settle that must happen (cleanup.cpp) -------------------------
  // Runs a clean-up Txn (a leave): once here, then in the background (GuaranteedRemoval) until
  // it succeeds or the lease is gone. Returns the first try's answer, or none (not answered in
  // time, or the lease gone).
  std::optional<pb::TxnResponse> run_cleanup(const std::shared_ptr<ClientLease>& lease, pb::TxnRequest txn,
                                             CleanupOptions options = {});

 private:
  // One clean-up, in the caller's thread or the background's.
  struct Cleanup {
    std::shared_ptr<ClientLease> lease;
    std::function<void(const CallBudget&)> attempt;  // throws until done; ends by the budget
    std::unique_ptr<LocalTurn> turn;                 // a name's local turn kept until done
    std::function<void()> finished;                  // run once done, or empty
  };

  // etcd_backend.cpp
  // Stops the threads, tries the pending clean-ups and revokes the lease (unless it is lost,
  // or this process is a forked child: the lease is its parent's).
  void shut_down() noexcept;

  // lease_keeper.cpp
  // Grants a lease by `call`'s deadline (set).
  std::shared_ptr<ClientLease> grant_lease(const CallBudget& call);
  void give_up(const std::shared_ptr<ClientLease>& lease);
  void keep_alive_loop(std::stop_token stop);
  // One keep-alive round: the TTL etcd confirmed, or none (no answer, or the lease is gone).
  std::optional<milliseconds> keep_alive_round(const std::shared_ptr<ClientLease>& lease,
                                               SteadyClock::time_point sent_at, milliseconds patience);
  // A held key went: it may have gone with the lease (revoked), which a keep-alive tells now.
  void check_lease_now();

  // cleanup.cpp
  // Hands a clean-up to the background (`what` names it in a report).
  void schedule(std::string what, Cleanup cleanup);
  // One try of a clean-up by `deadline`: done (or moot: the lease is gone) unless it throws.
  void attempt_cleanup(Cleanup& cleanup, const CallBudget& budget);
  // Leaves with an entry whose join may or may not have been applied: the join's marker
  // written (so a join still in flight fails) and the key deleted if it holds the join's value
  // (with a candidate's `side_key`).
  void leave_unconfirmed(const std::shared_ptr<ClientLease>& lease, const std::string& key, std::uint64_t request,
                         const std::string& value, LocalTurn* turn, const std::string& side_key = "");

  // lines.cpp
  // Puts `key` (created at most once, guarded by the request's marker) and reads `prefix`'s
  // entries in the same Txn.
  Joined put_entry(const std::shared_ptr<ClientLease>& lease, std::string key, std::uint64_t request, std::string value,
                   const std::string& prefix, const CallBudget& budget, LocalTurn* turn, const SideKeys& side);

  // counter.cpp
  // The counter key `key` changed at most once: `change` makes the Txn from the value read
  // (none: nothing to change, return `unchanged`); `answer` what the call returns once it
  // applied. Its Txn is guarded by a request marker (see counter_change_applied).
  using CounterChange = std::function<std::optional<pb::TxnRequest>(const CounterValue&)>;
  std::int64_t change_counter(const std::string& key, const CounterChange& change, std::int64_t unchanged,
                              const std::function<std::int64_t(const CounterValue&)>& answer);
  // One guarded try of a counter change: true when applied, false when its compares failed or
  // it was found not applied (and now never will be).
  bool counter_change_applied(pb::TxnRequest txn, SteadyClock::time_point deadline, int& unknown_outcomes);

  std::unique_ptr<Connection> owned_connection_;
  Connection& connection_;
  const pid_t pid_ = getpid();
  bool ended_at_exit_ = false;  // guarded by live_backends()'s mutex
  std::string identity_;        // "<pid> <host>", for inspect
  std::string label_suffix_;    // " <holder label>" at the end of our values, or ""
  std::atomic<std::uint64_t> unique_{0};
  bool keep_alive_unanswered_ = false;  // the keeper thread's: its last round got no answer

  std::mutex mutex_;
  std::shared_ptr<ClientLease> lease_;
  DeadlineMutex grant_mutex_;  // one lease grant at a time (TSan sees it; see deadline_mutex.hpp)
  std::set<std::string> receipt_garbage_;

  std::condition_variable_any turns_cv_;
  std::map<std::string, std::list<std::uint64_t>> turns_;                     // name -> tickets, the front holds
  std::map<std::uint64_t, std::shared_ptr<KeyWatcher::Watched>> turn_wakes_;  // ticket -> armed wake-up
  std::uint64_t next_ticket_ = 0;

  std::condition_variable_any keeper_cv_;

  LossClock clock_;  // after what its thread's callbacks touch, so it stops first
  KeyWatcher key_watcher_{connection_, [this] { check_lease_now(); }};
  // After what its attempts use (the connection, the leases' clock, the local turns they
  // leave when dropped), so it is destroyed first; before the keeper, which hands it revokes.
  GuaranteedRemoval removal_{kEtcdTimes.background};
  std::jthread keeper_;
};

}  // namespace turnstile::detail::etcd
