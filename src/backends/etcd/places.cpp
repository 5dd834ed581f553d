// SPDX-License-Identifier: Apache-2.0
// The queue: our entry from join until it is held or leaves, and the hold until its release.
#include "backends/etcd/etcd_backend.hpp"

#include <algorithm>
#include <limits>
#include <mutex>
#include <optional>

#include "core/receipt.hpp"

namespace turnstile::detail::etcd {
namespace {

class EtcdHold final : public BackendHold {
 public:
  EtcdHold(EtcdBackend& backend, std::shared_ptr<ClientLease> lease, std::string name, std::string key,
           std::int64_t revision, std::uint64_t turn, std::shared_ptr<LossSignal> loss,
           std::shared_ptr<KeyWatcher::Watched> watched, std::string value, std::string side_key)
      : backend_(backend), lease_(std::move(lease)), name_(std::move(name)), key_(std::move(key)), revision_(revision),
        turn_(turn), loss_(std::move(loss)), watched_(std::move(watched)), value_(std::move(value)),
        side_key_(std::move(side_key)) {}
  ~EtcdHold() override;

  std::uint64_t fencing_token() const override { return static_cast<std::uint64_t>(revision_); }
  void downgrade() override;
  void release() override;
  // "etcd1 <create revision> <key>": the entry, as the key's creation made it.
  std::string receipt() const override { return receipt_text({"etcd1", std::to_string(revision_), key_}); }
  // The key moves to a lease of its own, granted for `keep_for`, which nobody keeps alive.
  void release_after(milliseconds keep_for) override;
  std::int64_t grant_kept_lease(SteadyClock::time_point promised_end, const CallBudget& budget);
  // concurrency.Election's Proclaim, written at most once: see proclaim_txn.
  void proclaim(const std::string& value) override;

 private:
  // One proclaim's Txn: the new value, while the key is still ours and unchanged since our
  // last write (a copy that arrives after a later proclaim fails); else reads the key.
  pb::TxnRequest proclaim_txn(const std::string& value) const;
  // The key's mod revision when it still holds one of our values (none: gone, or not ours).
  std::optional<std::int64_t> our_mod_revision(const pb::RangeResponse& read, const std::string& value) const;
  // After a proclaim's write was not applied: the key's mod revision when it holds the late copy
  // of one of our proclaims of unknown outcome (ours still; none: gone, or not ours).
  std::optional<std::int64_t> late_copy_revision(const pb::RangeResponse& read) const;
  // The loss of a key that may still be there (our create revision, another writer's put): it
  // is removed, with the side key, so that it does not block the name while our lease lives.
  HoldLost lost_with_key(const std::string& why);
  // Stops watching the key and the lease for this hold, and gives up the local turn.
  void let_go();

  EtcdBackend& backend_;
  std::shared_ptr<ClientLease> lease_;
  std::string name_;
  std::string key_;
  std::int64_t revision_;
  std::uint64_t turn_;  // this client's local turn for name_ it holds (exclusive keys), or 0
  std::shared_ptr<LossSignal> loss_;
  std::shared_ptr<KeyWatcher::Watched> watched_;  // the key, watched while held
  std::string value_;                             // the key's value as we last wrote it
  std::string side_key_;                          // an election candidate's side key, or ""
  bool released_ = false;
  // Proclaims and the release (or release_after) one at a time: a release never overtakes a
  // proclaim still in flight, and a proclaim after the release writes nothing.
  std::mutex writes_;
  std::int64_t mod_revision_ = 0;  // our key's, after our last write (0: unknown: read first)
  // The values of proclaims whose outcome is unknown since our last known write: a late copy of
  // one may still be applied (at most once), and the key holding it is still ours.
  std::vector<std::string> unsettled_;
};

class EtcdPlace final : public QueuePlace {
 public:
  EtcdPlace(EtcdBackend& backend, const QueueRequest& request)
      : backend_(backend), request_(request), prefix_(request.name + "/"),
        exclusive_(request.kind == EntryKind::exclusive), election_(request.primitive == Primitive::election),
        turn_(&backend, request.name, exclusive_ ? backend.queue_local_turn(request.name) : 0, exclusive_) {}
  ~EtcdPlace() override { leave(); }

  // Puts our entry once this client's turn for the name came (exclusive entries; until then,
  // a verdict to wait for it). Throws CallStopped on the request's stop.
  Standing join(Deadline deadline);
  Standing look(Deadline deadline) override;
  void wait(const Verdict& verdict, Deadline deadline, const std::stop_token& stop) override;
  std::unique_ptr<WakeArm> arm(const Verdict& verdict, Deadline deadline, Wake wake) override;
  std::unique_ptr<BackendHold> hold(std::shared_ptr<LossSignal> loss) override;
  void leave() noexcept override;
  // A client's end: its pending acquires leave by one deadline (what is left goes to the
  // background at once, drained by drain_at_end as the backend ends).
  void leave_by(Deadline deadline) noexcept override;

 private:
  void leave_trying(const CallBudget& first_try) noexcept;
  // Where our entry stands in a read of the queue at `revision`; QueueEntryGone when not there.
  // `candidates`, when read with it, marks the candidates (their side keys): a join's read.
  Standing stand(const pb::RangeResponse& range, std::int64_t revision, const pb::RangeResponse* candidates = nullptr);
  Standing standing(bool candidates_read) const;
  // The Txn that removes our entry (and an election candidate's side key) if still ours.
  pb::TxnRequest leave_txn() const;
  // Not admitted, without entries: waiting for the local turn, or stopped after a wait.
  static Standing still_waiting() {
    Standing waiting;
    waiting.decided = Verdict{WaitFor::leave, 0};
    return waiting;
  }
  // What the verdict waits for: the key ahead, or (leases) deletions under the prefix.
  pb::WatchCreateRequest watch_for(const Verdict& verdict) const;
  // How many of the watch's events may make the verdict's event (from the last look).
  WakeAfter wake_after(const Verdict& verdict) const;
  // A Semaphore waiter: the entries ahead that must leave before it can be admitted.
  std::int64_t leaves_needed() const;
  // After the watch began: the entries ahead of ours gone (or changed) since the last read.
  std::int64_t changed_meanwhile(Deadline deadline) const;

  EtcdBackend& backend_;
  const QueueRequest request_;
  const std::string& name_ = request_.name;
  const std::string prefix_;
  const std::stop_token& stop_ = request_.stop;
  const bool exclusive_;   // one key per (lease, name): this client's acquires take turns for it
  const bool election_;    // a candidate: its value raw in the key, and a side key (layout.hpp)
  bool suffixed_ = false;  // a candidate beside another of this client: NAME/<hex>_<n>
  LocalTurn turn_;
  std::shared_ptr<ClientLease> lease_;
  std::string key_;
  std::string value_;
  std::string side_key_;           // a candidate's, once joined
  std::int64_t revision_ = 0;      // our key's create revision, once joined (0: waits for its local turn)
  std::int64_t seen_ = 0;          // the store's revision at the last read that found our key
  std::vector<EntryKey> entries_;  // the entries up to ours, as last read (none while armed)
  bool done_ = false;              // left, or handed to a hold
};

Standing EtcdPlace::join(Deadline deadline) {
  // Another acquire of this client has (or waits for) our lease's one key of the name: we wait
  // for the end of its turn here, as for an entry just ahead (wait(), arm()).
  if (exclusive_ && !backend_.has_local_turn(name_, turn_.ticket)) {
    if (!election_) return still_waiting();
    // A candidate need not wait: the lease's plain key is another candidate's of this client,
    // so this one is NAME/<lease hex>_<n>, which concurrency.Election counts as well.
    turn_.in_line = false;
    backend_.leave_local_turn(name_, turn_.ticket);
    suffixed_ = true;
  }
  const auto& request = request_;
  SideKeys side{.read = true};
  if (election_) side.put = candidate_info(backend_.identity());
  auto joined = backend_.join_line(
      prefix_,
      [&](const ClientLease& lease, std::uint64_t number) {
        // A candidate's value is the key's whole value, as concurrency.Election writes it.
        return std::pair{prefix_ + lease.hex + (exclusive_ && !suffixed_ ? "" : "_" + std::to_string(number)),
                         election_ ? request.value
                                   : entry_value(request.kind, request.permits, request.limit, backend_.identity(),
                                                 number, backend_.label_suffix())};
      },
      CallBudget(deadline, request.stop), &turn_, side);
  lease_ = std::move(joined.lease);
  key_ = std::move(joined.key);
  value_ = std::move(joined.value);
  if (election_) side_key_ = candidate_key(prefix_, lease_->hex, joined.request);
  revision_ = joined.created;
  return stand(joined.range, joined.revision, &joined.candidates);
}

Standing EtcdPlace::stand(const pb::RangeResponse& range, std::int64_t revision, const pb::RangeResponse* candidates) {
  auto entries = entries_of(range, prefix_);
  if (candidates) mark_candidates(entries, *candidates, prefix_);
  const auto mine = std::find_if(entries.begin(), entries.end(), [&](const EntryKey& entry) {
    return entry.create_revision == revision_ && entry.key == key_;
  });
  if (mine == entries.end()) throw QueueEntryGone();
  entries.erase(mine + 1, entries.end());
  entries_ = std::move(entries);
  seen_ = revision;
  return standing(candidates != nullptr);
}

// An election's queue is concurrency.Election's: every key is one candidate (a proposal may
// read like a turnstile entry). Its mode is checked where the side keys were read (the join).
Standing EtcdPlace::standing(bool candidates_read) const {
  Standing standing;
  standing.entries = views_of(entries_, entries_.size() - 1);
  if (election_) {
    for (auto& view : standing.entries) view = {EntryKind::exclusive, 1};
    if (!candidates_read) return standing;
  }
  if (entries_.size() > 1) {
    standing.mode = queue_mode_for(entries_.front(), request_.primitive);
    standing.limit = entries_.front().limit;
  }
  return standing;
}

// The own key is read after every wait, within the caller's deadline; an untimed waiter rides
// out an outage.
Standing EtcdPlace::look(Deadline deadline) {
  if (revision_ == 0) {  // waited for the local turn
    try {
      return join(deadline);
    } catch (const CallStopped&) {
      return still_waiting();  // not joined: the core ends the acquire on the stop
    }
  }
  // A lease given up goes with its keys: never admitted on it (etcd-io/etcd#11456).
  const auto check_lease = [&] {
    if (backend_.lease_lost(*lease_)) throw QueueEntryGone();
  };
  for (;;) {
    check_lease();
    std::optional<pb::RangeResponse> read;
    try {
      read = backend_.connection().range(queue_range(prefix_, revision_), CallBudget(deadline).for_call(kLastLook));
    } catch (const BackendUnavailable&) {
    }
    check_lease();
    if (read) return stand(*read, read->header().revision());
    // Stopped: as the last read, which did not admit us (we waited after it), so the core leaves.
    if (stop_.stop_requested()) return still_waiting();
    if (detail::passed(deadline)) {
      throw BackendUnavailable("no etcd answered while '" + name_ +
                               "' waited, until the deadline; its queue entry is removed in the background");
    }
  }
}

void EtcdPlace::wait(const Verdict& verdict, Deadline deadline, const std::stop_token& stop) {
  if (revision_ == 0) {
    backend_.wait_local_turn(name_, turn_.ticket, CallBudget(deadline, stop));
    return;
  }
  // The watch starts now, not just after our read: a watch from a revision etcd has already
  // passed joins its "unsynced" watchers, caught up only every 100 ms (that was the handoff p99
  // under contention). What changed between our read and the watch is found by reading the
  // entries ahead of ours once more after the watch exists.
  backend_.wait_for_change(*lease_, watch_for(verdict), CallBudget(deadline, stop), wake_after(verdict),
                           [&] { return changed_meanwhile(deadline); });
}

// Without a thread: the watch runs on the key watcher's stream, from the revision of our last
// read (nothing since is missed). A past revision costs the wake up to etcd's 100 ms catch-up
// when the awaited change comes just after the arm; a waiter armed earlier is woken at once.
std::unique_ptr<WakeArm> EtcdPlace::arm(const Verdict& verdict, Deadline, Wake wake) {
  if (revision_ == 0) return backend_.arm_local_turn(name_, turn_.ticket, std::move(wake));
  auto watch = watch_for(verdict);
  watch.set_start_revision(seen_ + 1);
  auto after = wake_after(verdict);
  // The next look reads the entries again: a waiter keeps none while it sleeps, so its memory
  // does not grow with the queue ahead (a thousand waiters would keep a million entries).
  std::vector<EntryKey>().swap(entries_);
  return backend_.arm_watch(*lease_, watch, std::move(wake), std::move(after));
}

pb::WatchCreateRequest EtcdPlace::watch_for(const Verdict& verdict) const {
  pb::WatchCreateRequest watch;
  if (verdict.wait == WaitFor::leave || verdict.wait == WaitFor::exclusive_end) {
    // concurrency.Mutex's wait: the one key ahead of ours.
    watch.set_key(entries_[verdict.index].key);
    if (verdict.wait == WaitFor::leave) watch.add_filters(pb::WatchCreateRequest::NOPUT);
  } else {
    // A lease waits for room: any entry leaving may make it.
    watch.set_key(prefix_);
    watch.set_range_end(prefix_end(prefix_));
    watch.add_filters(pb::WatchCreateRequest::NOPUT);
  }
  return watch;
}

// A Semaphore waiter is admitted once the permits of the entries up to ours fit the limit
// (evaluate_queue), and every entry that leaves frees at most the largest permits ahead: it
// can be admitted only after this many have left (an entry's permits count as at least 1 and
// at most limit + 1, as no entry above the limit is ever admitted). So a release wakes the
// waiters it may admit, not every waiter (each of whose looks reads the whole queue). Entries
// behind ours leaving count too: early, never late.
std::int64_t EtcdPlace::leaves_needed() const {
  const auto limit = request_.limit;
  if (entries_.size() < 2 || limit < 0 || limit == std::numeric_limits<std::int64_t>::max()) return 1;
  std::int64_t total = 0, largest = 1;
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    const auto permits = std::min(std::max<std::int64_t>(entries_[i].permits, 1), limit + 1);
    if (i + 1 < entries_.size()) largest = std::max(largest, permits);
    if (total > std::numeric_limits<std::int64_t>::max() - permits) return 1;
    total += permits;
  }
  const auto excess = total - limit;
  const auto needed = excess / largest + (excess % largest != 0 ? 1 : 0);
  return std::clamp<std::int64_t>(needed, 1, static_cast<std::int64_t>(entries_.size()) - 1);
}

WakeAfter EtcdPlace::wake_after(const Verdict& verdict) const {
  if (verdict.wait != WaitFor::admission && verdict.wait != WaitFor::any_holder_leave) return {};
  return {.events = leaves_needed(), .own_key = key_};  // our own entry going wakes at once
}

std::int64_t EtcdPlace::changed_meanwhile(Deadline deadline) const {
  const auto read =
      backend_.connection().range(queue_range(prefix_, revision_ - 1), CallBudget(deadline).for_call(kLastLook));
  const auto now = entries_of(read, prefix_);
  // Both in queue order; nothing joins ahead of ours.
  std::int64_t changed = 0;
  std::size_t j = 0;
  for (std::size_t i = 0; i + 1 < entries_.size(); ++i) {
    const auto& then = entries_[i];
    while (j < now.size() && now[j].create_revision < then.create_revision) ++j;
    const bool same = j < now.size() && now[j].create_revision == then.create_revision && now[j].key == then.key &&
                      now[j].kind == then.kind;
    if (same) ++j;
    else ++changed;
  }
  return changed;
}

std::unique_ptr<BackendHold> EtcdPlace::hold(std::shared_ptr<LossSignal> loss) {
  // Watched from the read that found it ours: a deletion since then is not missed.
  auto watched = backend_.key_watcher().watch(key_, revision_, lease_->id, value_, seen_, loss, side_key_);
  auto hold = std::make_unique<EtcdHold>(backend_, lease_, name_, key_, revision_, turn_.in_line ? turn_.ticket : 0,
                                         loss, std::move(watched), value_, side_key_);
  turn_.in_line = false;  // the hold keeps the local turn until it is released
  done_ = true;
  lease_->server_lease->attach(loss);  // a lease lost meanwhile loses the hold at once
  return hold;
}

void EtcdPlace::leave() noexcept { leave_trying(CallBudget(SteadyClock::now() + kEtcdTimes.leave_try)); }

void EtcdPlace::leave_by(Deadline deadline) noexcept {
  leave_trying(CallBudget(SteadyClock::now() + leave_patience(deadline, kEtcdTimes.leave_try)));
}

void EtcdPlace::leave_trying(const CallBudget& first_try) noexcept {
  if (!done_ && revision_ == 0 && turn_.in_line) {
    // Still waiting for the local turn: the next acquire of this client need not wait for us.
    turn_.in_line = false;
    backend_.leave_local_turn(name_, turn_.ticket);
  }
  if (done_ || revision_ == 0) return;  // not joined: a join of unknown outcome left by itself
  done_ = true;
  backend_.run_cleanup(lease_, leave_txn(), {.turn = &turn_, .first_try = first_try});
}

pb::TxnRequest EtcdPlace::leave_txn() const {
  auto txn = delete_entry_txn(key_, revision_);
  if (!side_key_.empty()) add_delete(txn.mutable_success(), side_key_);
  return txn;
}

EtcdHold::~EtcdHold() {
  if (!released_) let_go();  // the core releases first; this only guards misuse
}

void EtcdHold::let_go() {
  backend_.key_watcher().unwatch(watched_);
  lease_->server_lease->detach(loss_.get());
  if (turn_ != 0) backend_.leave_local_turn(name_, turn_);
  turn_ = 0;
}

void EtcdHold::downgrade() {
  const auto value = entry_value(EntryKind::shared, 1, 0, backend_.identity(), 0, backend_.label_suffix());
  backend_.key_watcher().allow(*watched_, value);  // our own write is no loss
  pb::TxnRequest txn;
  add_compare(txn, key_, pb::Compare::CREATE, revision_);
  add_put(txn.mutable_success(), key_, value, lease_->id);
  bool present = false;
  try {
    present = backend_.connection().txn(txn, CallBudget(), Resend::allowed).succeeded();
  } catch (const LeaseGone&) {
  }
  if (!present) loss_->lose("its etcd key was gone (the lease expired or the key was deleted)", LossCause::entry_gone);
  value_ = value;
}

constexpr auto kGoneAtRelease = "its etcd key was gone before the release (the lease expired or the key was deleted)";
// etcd's clock ends it: a lease granted for `keep_for` (whole seconds, rounded up; etcd raises
// a TTL below its minimum) that nobody keeps alive. The move is guarded by the key's create
// revision, so a late or resent copy never re-creates a key that ended meanwhile.
void EtcdHold::release_after(milliseconds keep_for) {
  std::unique_lock serial(writes_);
  if (released_) return;
  if (backend_.revoked_by_client(*lease_) || backend_.lease_gone(*lease_)) {
    serial.unlock();
    return release();
  }
  const CallBudget budget(SteadyClock::now() + kEtcdTimes.release_try);
  const auto until = std::chrono::system_clock::now() + keep_for;  // the earliest end, however late the grant
  const auto kept_lease = grant_kept_lease(SteadyClock::now() + keep_for, budget);
  const auto value = kept_value(value_, std::chrono::duration_cast<milliseconds>(until.time_since_epoch()).count());
  // Our own move is no loss, nor is any resent or late copy of it: the watch ends before the
  // first is sent, and the Txn's own answer says whether the key was still ours.
  backend_.key_watcher().unwatch(watched_);
  pb::TxnRequest txn;
  add_compare(txn, key_, pb::Compare::CREATE, revision_);
  add_put(txn.mutable_success(), key_, value, kept_lease);
  bool kept = false;
  try {
    kept = backend_.connection().txn(txn, budget, Resend::allowed).succeeded();
  } catch (const LeaseGone&) {
    // The kept lease ended already (a TTL shorter than the call): nothing was written.
  }
  released_ = true;
  let_go();
  if (!kept) loss_->lose(kGoneAtRelease, LossCause::entry_gone);
}

// A lease's TTL runs from its grant on the server: a grant answered late may have arrived late
// and would keep the key that much past `promised_end`. It is then granted again (a new lease)
// for what is left; the unused one ends by itself.
std::int64_t EtcdHold::grant_kept_lease(SteadyClock::time_point promised_end, const CallBudget& budget) {
  constexpr auto kLateGrant = std::chrono::milliseconds(1000);
  for (int tries = 1;; ++tries) {
    const auto sent = SteadyClock::now();
    const auto ttl = std::chrono::ceil<std::chrono::seconds>(promised_end - sent).count();
    const auto id = backend_.connection().lease_grant(std::max<std::int64_t>(ttl, 1), budget).id();
    if (SteadyClock::now() - sent < kLateGrant || tries == 3) return id;
  }
}

// The delete carries a receipt (a key on our lease): when a resent release finds the key gone,
// the receipt tells whether an earlier attempt of this release deleted it (released) or it
// was gone before (lost).
void EtcdHold::release() {
  std::lock_guard serial(writes_);
  if (released_) return;
  backend_.key_watcher().unwatch(watched_);  // our own delete is no loss
  bool existed = backend_.revoked_by_client(*lease_);
  if (!existed && !backend_.lease_gone(*lease_)) {
    const auto receipt = kReceiptPrefix + lease_->hex + "_" + std::to_string(revision_);
    const auto garbage = backend_.receipts_to_delete();
    pb::TxnRequest txn;
    add_compare(txn, key_, pb::Compare::CREATE, revision_);
    add_delete(txn.mutable_success(), key_);
    if (!side_key_.empty()) add_delete(txn.mutable_success(), side_key_);
    add_put(txn.mutable_success(), receipt, "", lease_->id);
    for (const auto& old : garbage) add_delete(txn.mutable_success(), old);
    add_range(txn.mutable_failure(), key_range(receipt));
    try {
      const auto answer = backend_.connection().txn(
          txn, CallBudget(SteadyClock::now() + (loss_->lost_by_now() ? kLostReleaseTry : kEtcdTimes.release_try)),
          Resend::allowed);
      existed = answer.succeeded() || answer.responses(0).response_range().kvs_size() > 0;
      if (answer.succeeded()) backend_.receipts_deleted(garbage);
      if (existed) backend_.receipt_done(receipt);
    } catch (const LeaseGone&) {
      // Not applied, and the key went with the lease.
      backend_.lose_lease(lease_, "etcd no longer knows the client's lease", true);
    }
  }
  released_ = true;
  let_go();
  if (!existed) loss_->lose(kGoneAtRelease, LossCause::entry_gone);
}

// concurrency.Election's Proclaim (If CreateRevision(key) == ours Then Put(key, value, lease)),
// also guarded by the key's mod revision after our last write: a copy of an earlier proclaim
// that etcd runs after a later one (a resend, a paused member) fails, so each proclaim is
// written at most once and never undoes a newer one. The held-key watcher is told first, so
// our own put is no loss. A write that fails because the late copy of an earlier proclaim of
// unknown outcome was applied meanwhile finds the key still ours: it is tried again (each late
// copy applies at most once, so a few tries suffice).
void EtcdHold::proclaim(const std::string& value) {
  constexpr int kProclaimTries = 4;
  std::lock_guard serial(writes_);
  if (side_key_.empty()) return BackendHold::proclaim(value);  // not a candidate's key
  if (released_) throw HoldLost("the leadership of '" + name_ + "' was resigned; nothing was proclaimed");
  // Long enough for a resend to the next endpoint after a stuck attempt.
  const auto budget = [] { return CallBudget(SteadyClock::now() + kEtcdTimes.call.cap); };
  if (mod_revision_ == 0) {  // the first proclaim, or one after a proclaim of unknown outcome
    const auto mod =
        our_mod_revision(backend_.connection().range(key_range(key_), budget().for_call(kEtcdTimes.call)), {});
    if (!mod) throw lost_with_key("its etcd key was gone or rewritten by another writer");
    mod_revision_ = *mod;
  }
  backend_.key_watcher().allow(*watched_, value);
  for (int tries = 1;; ++tries) {
    pb::TxnResponse answer;
    try {
      answer = backend_.connection().txn(proclaim_txn(value), budget(), Resend::allowed);
    } catch (const LeaseGone&) {
      loss_->lose("etcd no longer knows the client's lease", LossCause::session_expired);
      throw HoldLost("the leadership of '" + name_ + "' (fencing token " + std::to_string(revision_) +
                     ") is gone (etcd no longer knows the client's lease); nothing was proclaimed");
    } catch (const BackendUnavailable&) {
      mod_revision_ = 0;  // written or not: the next proclaim reads the key first
      unsettled_.push_back(value);
      throw;
    }
    std::optional<std::int64_t> mod = answer.header().revision();
    // Not applied: an earlier try of this very proclaim (its answer lost) may have been.
    if (!answer.succeeded()) mod = our_mod_revision(answer.responses(0).response_range(), value);
    if (mod) {
      mod_revision_ = *mod;
      value_ = value;
      unsettled_.clear();  // their copies compare an older mod revision: none can apply now
      return;
    }
    const auto late = late_copy_revision(answer.responses(0).response_range());
    if (!late) throw lost_with_key("its etcd key was gone or rewritten by another writer");
    if (tries == kProclaimTries) {
      mod_revision_ = 0;
      throw BackendUnavailable("the leadership of '" + name_ + "' is kept, but its value could not be proclaimed: " +
                               "late copies of earlier proclaims kept changing it");
    }
    mod_revision_ = *late;
  }
}

std::optional<std::int64_t> EtcdHold::late_copy_revision(const pb::RangeResponse& read) const {
  for (const auto& earlier : unsettled_) {
    if (auto mod = our_mod_revision(read, earlier)) return mod;
  }
  return std::nullopt;
}

// Guarded by our create revision: a newer entry on the same key is never removed. Best effort:
// what is not removed goes with our lease.
HoldLost EtcdHold::lost_with_key(const std::string& why) {
  loss_->lose(why, LossCause::entry_gone);
  backend_.key_watcher().unwatch(watched_);  // our own delete is no second loss
  pb::TxnRequest txn;
  add_compare(txn, key_, pb::Compare::CREATE, revision_);
  add_delete(txn.mutable_success(), key_);
  add_delete(txn.mutable_success(), side_key_);
  add_delete(txn.mutable_failure(), side_key_);
  try {
    backend_.connection().txn(txn, CallBudget(SteadyClock::now() + kEtcdTimes.release_try), Resend::allowed);
  } catch (const Error&) {
    // Not removed now: the key and the side key end with the client's lease.
  }
  return HoldLost("the leadership of '" + name_ + "' (fencing token " + std::to_string(revision_) + ") is gone (" +
                  why + "); nothing was proclaimed");
}

pb::TxnRequest EtcdHold::proclaim_txn(const std::string& value) const {
  pb::TxnRequest txn;
  add_compare(txn, key_, pb::Compare::CREATE, revision_);
  add_compare(txn, key_, pb::Compare::MOD, mod_revision_);
  add_put(txn.mutable_success(), key_, value, lease_->id);
  add_range(txn.mutable_failure(), key_range(key_));
  return txn;
}

// Ours: created at our revision, on our lease (another writer's put names its own lease, or
// none), holding `value` when one is given.
std::optional<std::int64_t> EtcdHold::our_mod_revision(const pb::RangeResponse& read, const std::string& value) const {
  if (read.kvs_size() == 0) return std::nullopt;
  const auto& kv = read.kvs(0);
  if (kv.create_revision() != revision_ || kv.lease() != lease_->id) return std::nullopt;
  if (!value.empty() && kv.value() != value) return std::nullopt;
  return kv.mod_revision();
}

}  // namespace

std::unique_ptr<QueuePlace> EtcdBackend::join(const QueueRequest& request, bool, Deadline deadline, Standing& first) {
  auto place = std::make_unique<EtcdPlace>(*this, request);
  try {
    first = place->join(deadline);
  } catch (const CallStopped&) {
    // Stopped while joining (a join that may have been applied leaves in the background): not
    // admitted, as a stop while waiting would end it.
    return nullptr;
  }
  return place;
}

// The key is deleted only while it is the entry created at that revision (delete_entry_txn):
// never a newer entry on the same key. Its lease lives on until its TTL, holding nothing.
bool EtcdBackend::release_receipt(const std::string& receipt, Deadline deadline) {
  const auto fields = receipt_fields(receipt, "etcd1", 3);
  const auto& revision = fields ? (*fields)[1] : receipt;
  const auto slash = fields ? (*fields)[2].rfind('/') : std::string::npos;
  if (slash == std::string::npos || revision.empty() || revision.size() > 18 ||
      revision.find_first_not_of("0123456789") != std::string::npos) {
    return Backend::release_receipt(receipt, deadline);
  }
  const auto& key = (*fields)[2];
  validate_name(key.substr(0, slash));
  const auto answer = connection_.txn(delete_entry_txn(key, std::stoll(revision)),
                                      CallBudget(deadline).for_call(kEtcdTimes.call), Resend::allowed);
  return answer.succeeded();
}

std::vector<std::string> EtcdBackend::receipts_to_delete() {
  std::lock_guard lock(mutex_);
  std::vector<std::string> keys;
  for (auto it = receipt_garbage_.begin(); it != receipt_garbage_.end() && keys.size() < kMaxReceiptsPerTxn; ++it) {
    keys.push_back(*it);
  }
  return keys;
}

void EtcdBackend::receipts_deleted(const std::vector<std::string>& keys) {
  std::lock_guard lock(mutex_);
  for (const auto& key : keys) receipt_garbage_.erase(key);
}

void EtcdBackend::receipt_done(std::string key) {
  std::lock_guard lock(mutex_);
  receipt_garbage_.insert(std::move(key));
}
}  // namespace turnstile::detail::etcd
