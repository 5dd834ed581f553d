// The queue: our entry from join until it is held or leaves, and the hold until its release.
#include "backends/etcd/etcd_backend.hpp"

#include <algorithm>

namespace turnstile::detail::etcd {
namespace {

class EtcdHold final : public BackendHold {
 public:
  EtcdHold(EtcdBackend& backend, std::shared_ptr<ClientLease> lease, std::string name, std::string key,
           std::int64_t revision, bool gated, std::shared_ptr<LossSignal> loss,
           std::shared_ptr<KeyWatcher::Watched> watched)
      : backend_(backend), lease_(std::move(lease)), name_(std::move(name)), key_(std::move(key)), revision_(revision),
        gated_(gated), loss_(std::move(loss)), watched_(std::move(watched)) {}
  ~EtcdHold() override;

  std::uint64_t fencing_token() const override { return static_cast<std::uint64_t>(revision_); }
  void downgrade() override;
  void release() override;

 private:
  // Stops watching the key and the lease for this hold, and gives up the local turn.
  void let_go();

  EtcdBackend& backend_;
  std::shared_ptr<ClientLease> lease_;
  std::string name_;
  std::string key_;
  std::int64_t revision_;
  bool gated_;  // holds this client's local turn for name_ (exclusive keys)
  std::shared_ptr<LossSignal> loss_;
  std::shared_ptr<KeyWatcher::Watched> watched_;  // the key, watched while held
  bool released_ = false;
};

class EtcdPlace final : public QueuePlace {
 public:
  EtcdPlace(EtcdBackend& backend, const QueueRequest& request, bool exclusive)
      : backend_(backend), name_(request.name), prefix_(request.name + "/"), stop_(request.stop), exclusive_(exclusive),
        turn_(&backend, request.name, exclusive) {}
  ~EtcdPlace() override { leave(); }

  Standing join(const QueueRequest& request, Deadline deadline);
  Standing look(Deadline deadline) override;
  void wait(const Verdict& verdict, Deadline deadline, const std::stop_token& stop) override;
  std::unique_ptr<BackendHold> hold(std::shared_ptr<LossSignal> loss) override;
  void leave() noexcept override;

 private:
  // Where our entry stands in a read of the queue at `revision`; QueueEntryGone when not there.
  Standing stand(const pb::RangeResponse& range, std::int64_t revision);
  Standing standing() const;
  // After the watch began: whether the entries ahead of ours changed since the last read.
  bool changed_meanwhile(Deadline deadline) const;

  EtcdBackend& backend_;
  const std::string name_;
  const std::string prefix_;
  const std::stop_token stop_;
  const bool exclusive_;  // one key per (lease, name): this client's threads take turns for it
  LocalTurn turn_;
  std::shared_ptr<ClientLease> lease_;
  std::string key_;
  std::string value_;
  std::int64_t revision_ = 0;      // our key's create revision, once joined
  std::int64_t seen_ = 0;          // the store's revision at the last read that found our key
  std::vector<EntryKey> entries_;  // the entries up to ours, as last read
  bool done_ = false;              // left, or handed to a hold
};

Standing EtcdPlace::join(const QueueRequest& request, Deadline deadline) {
  auto joined = backend_.join_line(
      prefix_,
      [&](const ClientLease& lease, std::uint64_t number) {
        return std::pair{prefix_ + lease.hex + (exclusive_ ? "" : "_" + std::to_string(number)),
                         entry_value(request.kind, request.permits, request.limit, backend_.identity(), number,
                                     backend_.label_suffix())};
      },
      CallBudget(deadline, request.stop), &turn_);
  lease_ = std::move(joined.lease);
  key_ = std::move(joined.key);
  value_ = std::move(joined.value);
  revision_ = joined.created;
  return stand(joined.range, joined.revision);
}

Standing EtcdPlace::stand(const pb::RangeResponse& range, std::int64_t revision) {
  auto entries = entries_of(range, prefix_);
  const auto mine = std::find_if(entries.begin(), entries.end(), [&](const EntryKey& entry) {
    return entry.create_revision == revision_ && entry.key == key_;
  });
  if (mine == entries.end()) throw QueueEntryGone();
  entries.erase(mine + 1, entries.end());
  entries_ = std::move(entries);
  seen_ = revision;
  return standing();
}

Standing EtcdPlace::standing() const {
  Standing standing;
  standing.entries = views_of(entries_, entries_.size() - 1);
  if (entries_.size() > 1) {
    standing.mode = queue_mode(entries_.front());
    standing.limit = entries_.front().limit;
  }
  return standing;
}

// The own key is read after every wait, within the caller's deadline; an untimed waiter rides
// out an outage.
Standing EtcdPlace::look(Deadline deadline) {
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
    // Stopped: the last read, which did not admit us (we waited after it), so the core leaves.
    if (stop_.stop_requested()) return standing();
    if (detail::passed(deadline)) {
      throw BackendUnavailable("no etcd answered while '" + name_ +
                               "' waited, until the deadline; its queue entry is removed in the background");
    }
  }
}

void EtcdPlace::wait(const Verdict& verdict, Deadline deadline, const std::stop_token& stop) {
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
  // The watch starts now, not just after our read: a watch from a revision etcd has already
  // passed joins its "unsynced" watchers, caught up only every 100 ms (that was the handoff p99
  // under contention). What changed between our read and the watch is found by reading the
  // entries ahead of ours once more after the watch exists.
  backend_.wait_for_change(*lease_, watch, CallBudget(deadline, stop), [&] { return changed_meanwhile(deadline); });
}

bool EtcdPlace::changed_meanwhile(Deadline deadline) const {
  const auto read =
      backend_.connection().range(queue_range(prefix_, revision_ - 1), CallBudget(deadline).for_call(kLastLook));
  const auto now = entries_of(read, prefix_);
  if (now.size() + 1 != entries_.size()) return true;
  for (std::size_t i = 0; i < now.size(); ++i) {
    if (now[i].key != entries_[i].key || now[i].create_revision != entries_[i].create_revision ||
        now[i].kind != entries_[i].kind) {
      return true;
    }
  }
  return false;
}

std::unique_ptr<BackendHold> EtcdPlace::hold(std::shared_ptr<LossSignal> loss) {
  // Watched from the read that found it ours: a deletion since then is not missed.
  auto watched = backend_.key_watcher().watch(key_, revision_, lease_->id, value_, seen_, loss);
  auto hold =
      std::make_unique<EtcdHold>(backend_, lease_, name_, key_, revision_, turn_.held, loss, std::move(watched));
  turn_.held = false;  // the hold keeps the local turn until it is released
  done_ = true;
  lease_->server_lease->attach(loss);  // a lease lost meanwhile loses the hold at once
  return hold;
}

void EtcdPlace::leave() noexcept {
  if (done_ || revision_ == 0) return;  // not joined: a join of unknown outcome left by itself
  done_ = true;
  backend_.run_cleanup(lease_, delete_entry_txn(key_, revision_), {.turn = &turn_});
}

EtcdHold::~EtcdHold() {
  if (!released_) let_go();  // the core releases first; this only guards misuse
}

void EtcdHold::let_go() {
  backend_.key_watcher().unwatch(watched_);
  lease_->server_lease->detach(loss_.get());
  if (gated_) backend_.leave_local_turn(name_);
  gated_ = false;
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
  if (!present) loss_->lose("its etcd key was gone (the lease expired or the key was deleted)");
}

// The delete carries a receipt (a key on our lease): when a resent release finds the key gone,
// the receipt tells whether an earlier attempt of this release deleted it (released) or it
// was gone before (lost).
void EtcdHold::release() {
  if (released_) return;
  backend_.key_watcher().unwatch(watched_);  // our own delete is no loss
  bool existed = backend_.revoked_by_client(*lease_);
  if (!existed && !backend_.lease_gone(*lease_)) {
    const auto receipt = kReceiptPrefix + lease_->hex + "_" + std::to_string(revision_);
    const auto garbage = backend_.receipts_to_delete();
    pb::TxnRequest txn;
    add_compare(txn, key_, pb::Compare::CREATE, revision_);
    add_delete(txn.mutable_success(), key_);
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
  if (!existed) loss_->lose("its etcd key was gone before the release (the lease expired or the key was deleted)");
}

}  // namespace

std::unique_ptr<QueuePlace> EtcdBackend::join(const QueueRequest& request, bool, Deadline deadline, Standing& first) {
  const bool exclusive = request.kind == EntryKind::exclusive;
  if (exclusive && !enter_local_turn(request.name, CallBudget(deadline, request.stop))) return nullptr;
  auto place = std::make_unique<EtcdPlace>(*this, request, exclusive);
  try {
    first = place->join(request, deadline);
  } catch (const CallStopped&) {
    // Stopped while joining (a join that may have been applied leaves in the background): not
    // admitted, as a stop while waiting would end it.
    return nullptr;
  }
  return place;
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
