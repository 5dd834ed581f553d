// The etcd backend: etcd's concurrency.Mutex layout and algorithm, generalised to every queue
// primitive. A client's session is one etcd lease, kept alive every TTL/3. A contender of
// NAME puts the key NAME/<lease id in hex> (exclusive entries: exactly etcdctl lock's key) or
// NAME/<lease id in hex>_<n> (shared and lease entries) in a Txn guarded by "create revision
// == 0"; the queue is every key under NAME/ in create-revision order, the create revision is
// the fencing token, and a waiter watches the one key it depends on (or, for Semaphore
// leases, the deletions under the prefix). So `etcdctl lock NAME` and turnstile exclude each
// other both ways; an entry written by anyone else (etcdctl's empty value) is an exclusive one.
//
// Beyond etcd 3.4's Mutex: after every wait the own key is read again (a waiter whose lease
// expired never takes the lock: etcd-io/etcd#11456); exclusive keys are one per (lease, name),
// so threads of one client queue locally first (etcd-io/etcd#11360); a release deletes the key
// only if its create revision is still ours (etcd-io/etcd#22082); a waiter whose session dies
// stops at once with HoldLost (etcd-io/etcd#19597).
#include <unistd.h>

#include <atomic>
#include <cinttypes>
#include <condition_variable>
#include <list>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "backends/etcd/connection.hpp"

namespace turnstile::detail::etcd {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr milliseconds kCallTimeout{5000};

// PermitCounter keys live outside every queue prefix: names cannot contain control characters.
const std::string kCounterPrefix = "\x1fturnstile/permits/";
const std::string kCounterWaiterPrefix = "\x1fturnstile/permit-waiters/";

std::string lease_hex(std::int64_t lease) {
  char buffer[24];
  std::snprintf(buffer, sizeof buffer, "%" PRIx64, static_cast<std::uint64_t>(lease));
  return buffer;
}

std::string host_name() {
  char buffer[256] = {};
  gethostname(buffer, sizeof buffer - 1);
  return buffer;
}

SteadyClock::time_point call_deadline() { return SteadyClock::now() + kCallTimeout; }

// One queue entry as stored: "turnstile <kind> <permits> <limit> <pid> <host> <since ms>".
// Anything else — etcdctl lock's empty value — is an exclusive entry of a foreign contender.
struct Entry {
  std::string key;
  std::int64_t create_revision = 0;
  EntryKind kind = EntryKind::exclusive;
  std::int64_t permits = 1;
  std::int64_t limit = 0;
  std::int64_t pid = 0;
  std::string host;
  std::int64_t since_ms = 0;
};

std::string entry_value(EntryKind kind, std::int64_t permits, std::int64_t limit, const std::string& identity) {
  const auto since = std::chrono::duration_cast<milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  return "turnstile " + std::string(to_string(kind)) + " " + std::to_string(permits) + " " + std::to_string(limit) + " " +
         identity + " " + std::to_string(since);
}

Entry parse_entry(const mvccpb::KeyValue& kv) {
  Entry entry;
  entry.key = kv.key();
  entry.create_revision = kv.create_revision();
  std::istringstream text(kv.value());
  std::string magic, kind;
  Entry parsed = entry;
  if (text >> magic >> kind >> parsed.permits >> parsed.limit >> parsed.pid >> parsed.host >> parsed.since_ms &&
      magic == "turnstile") {
    if (kind == "shared") parsed.kind = EntryKind::shared;
    else if (kind == "lease") parsed.kind = EntryKind::lease;
    else parsed.kind = EntryKind::exclusive;
    return parsed;
  }
  return entry;
}

std::string queue_mode(const Entry& head) { return head.kind == EntryKind::lease ? "semaphore" : "lock"; }

// --- request builders ----------------------------------------------------------------------

pb::RangeRequest queue_range(const std::string& prefix, std::int64_t max_create_revision = 0) {
  pb::RangeRequest range;
  range.set_key(prefix);
  range.set_range_end(prefix_end(prefix));
  range.set_sort_order(pb::RangeRequest::ASCEND);
  range.set_sort_target(pb::RangeRequest::CREATE);
  range.set_max_create_revision(max_create_revision);
  return range;
}

pb::RangeRequest key_range(const std::string& key) {
  pb::RangeRequest range;
  range.set_key(key);
  return range;
}

void add_compare(pb::TxnRequest& txn, const std::string& key, pb::Compare::CompareTarget target, std::int64_t value) {
  auto* compare = txn.add_compare();
  compare->set_key(key);
  compare->set_result(pb::Compare::EQUAL);
  compare->set_target(target);
  if (target == pb::Compare::CREATE) compare->set_create_revision(value);
  else if (target == pb::Compare::MOD) compare->set_mod_revision(value);
  else compare->set_version(value);
}

void add_put(google::protobuf::RepeatedPtrField<pb::RequestOp>* ops, const std::string& key, const std::string& value,
             std::int64_t lease) {
  auto* put = ops->Add()->mutable_request_put();
  put->set_key(key);
  put->set_value(value);
  put->set_lease(lease);
}

void add_delete(google::protobuf::RepeatedPtrField<pb::RequestOp>* ops, const std::string& key) {
  ops->Add()->mutable_request_delete_range()->set_key(key);
}

void add_range(google::protobuf::RepeatedPtrField<pb::RequestOp>* ops, const pb::RangeRequest& range) {
  *ops->Add()->mutable_request_range() = range;
}

std::vector<Entry> entries_of(const pb::RangeResponse& range) {
  std::vector<Entry> entries;
  entries.reserve(range.kvs_size());
  for (const auto& kv : range.kvs()) entries.push_back(parse_entry(kv));
  return entries;
}

std::vector<QueueEntryView> views_of(const std::vector<Entry>& entries, std::size_t up_to) {
  std::vector<QueueEntryView> views;
  for (std::size_t i = 0; i <= up_to && i < entries.size(); ++i) views.push_back({entries[i].kind, entries[i].permits});
  return views;
}

// --- sessions and holds --------------------------------------------------------------------

class EtcdHold;

// One etcd lease: the life of every key this client writes while it lasts.
struct Session {
  std::int64_t lease = 0;
  milliseconds ttl{0};  // as granted
  // Guarded by the backend's mutex:
  SteadyClock::time_point valid_until;  // the lease lasts at least until then
  bool lost = false;
  std::set<EtcdHold*> holds;
  std::set<WatchStream*> waits;
};

class EtcdBackend;

class EtcdHold final : public BackendHold {
 public:
  EtcdHold(EtcdBackend& backend, std::shared_ptr<Session> session, std::string name, std::string key,
           std::int64_t revision, bool gated, std::shared_ptr<LossSignal> loss)
      : backend_(backend), session_(std::move(session)), name_(std::move(name)), key_(std::move(key)),
        revision_(revision), gated_(gated), loss_(std::move(loss)) {}
  ~EtcdHold() override;

  std::uint64_t fencing_token() const override { return static_cast<std::uint64_t>(revision_); }
  void downgrade() override;
  void release() override;

  const std::shared_ptr<LossSignal>& loss() const { return loss_; }

 private:
  void forget();

  EtcdBackend& backend_;
  std::shared_ptr<Session> session_;
  std::string name_;
  std::string key_;
  std::int64_t revision_;
  bool gated_;  // holds this client's local turn for name_ (exclusive keys)
  std::shared_ptr<LossSignal> loss_;
  bool released_ = false;
};

class EtcdBackend final : public Backend {
 public:
  explicit EtcdBackend(Settings settings)
      : connection_(std::move(settings)), identity_(std::to_string(getpid()) + " " + host_name()) {
    keeper_ = std::jthread([this](std::stop_token stop) { keep_alive_loop(stop); });
  }

  ~EtcdBackend() override {
    keeper_.request_stop();
    keeper_cv_.notify_all();
    keeper_.join();
    // Every key this client wrote goes with its lease, at once rather than after the TTL.
    if (session_ && !session_->lost) {
      try {
        connection_.lease_revoke(session_->lease, SteadyClock::now() + milliseconds(1000));
      } catch (...) {
      }
    }
  }

  std::unique_ptr<BackendHold> acquire(const QueueRequest& request, Deadline deadline,
                                       std::shared_ptr<LossSignal> loss) override;
  Inspection inspect(const std::string& name) override;
  bool counter_try_set(const std::string& name, std::int64_t permits) override;
  std::int64_t counter_add(const std::string& name, std::int64_t delta) override;
  std::optional<std::int64_t> counter_get(const std::string& name) override;
  std::int64_t counter_drain(const std::string& name) override;
  bool counter_acquire(const std::string& name, std::int64_t permits, Deadline deadline) override;

  Connection& connection() { return connection_; }
  const std::string& identity() const { return identity_; }
  std::mutex& mutex() { return mutex_; }
  void leave_local_turn(const std::string& name);
  // Deletes the key if it is still the one created at `revision`; false when it was gone.
  bool delete_own_key(const std::string& key, std::int64_t revision, SteadyClock::time_point deadline);

 private:
  // A place in this client's local line for a name (one exclusive key per lease and name).
  bool enter_local_turn(const std::string& name, Deadline deadline);
  std::shared_ptr<Session> session(SteadyClock::time_point deadline);
  void lose_session(const std::shared_ptr<Session>& session, const std::string& reason);
  void keep_alive_loop(std::stop_token stop);
  // Waits for one event of the watch (or its end); false when the session died meanwhile.
  // Waits for an event of the watch. `changed_already`, when given, is asked once the watch
  // exists: true means what we wait for happened before the watch began, so no wait.
  bool wait_for_change(const std::shared_ptr<Session>& session, const pb::WatchCreateRequest& watch, Deadline deadline,
                       const std::function<bool()>& changed_already = {});

  Connection connection_;
  std::string identity_;  // "<pid> <host>", for inspect
  std::atomic<std::uint64_t> unique_{0};

  std::mutex mutex_;
  std::shared_ptr<Session> session_;
  std::mutex grant_mutex_;  // one lease grant at a time

  std::condition_variable turns_cv_;
  std::map<std::string, std::list<std::uint64_t>> turns_;  // name -> tickets, the front holds
  std::uint64_t next_ticket_ = 0;

  std::condition_variable_any keeper_cv_;
  std::jthread keeper_;
};

EtcdHold::~EtcdHold() {
  if (!released_) forget();  // the core releases first; this only guards misuse
}

void EtcdHold::forget() {
  {
    std::lock_guard lock(backend_.mutex());
    session_->holds.erase(this);
  }
  if (gated_) backend_.leave_local_turn(name_);
  gated_ = false;
}

void EtcdHold::downgrade() {
  pb::TxnRequest txn;
  add_compare(txn, key_, pb::Compare::CREATE, revision_);
  add_put(txn.mutable_success(), key_, entry_value(EntryKind::shared, 1, 0, backend_.identity()), session_->lease);
  if (!backend_.connection().txn(txn, call_deadline(), true).succeeded()) {
    loss_->lose("its etcd key was gone (the lease expired or the key was deleted)");
  }
}

void EtcdHold::release() {
  if (released_) return;
  const bool existed = backend_.delete_own_key(key_, revision_, SteadyClock::now() + milliseconds(2000));
  released_ = true;
  forget();
  if (!existed) loss_->lose("its etcd key was gone before the release (the lease expired or the key was deleted)");
}

bool EtcdBackend::delete_own_key(const std::string& key, std::int64_t revision, SteadyClock::time_point deadline) {
  // Guarded by the create revision: a retried or late release never deletes a newer entry
  // that reuses the key (etcd-io/etcd#22082).
  pb::TxnRequest txn;
  add_compare(txn, key, pb::Compare::CREATE, revision);
  add_delete(txn.mutable_success(), key);
  return connection_.txn(txn, deadline, true).succeeded();
}

bool EtcdBackend::enter_local_turn(const std::string& name, Deadline deadline) {
  std::unique_lock lock(mutex_);
  const auto ticket = next_ticket_++;
  auto& line = turns_[name];
  line.push_back(ticket);
  const auto mine = [&] { return turns_[name].front() == ticket; };
  if (deadline) {
    if (turns_cv_.wait_until(lock, *deadline, mine)) return true;
    auto& waiting = turns_[name];
    waiting.remove(ticket);
    if (waiting.empty()) turns_.erase(name);
    turns_cv_.notify_all();
    return false;
  }
  turns_cv_.wait(lock, mine);
  return true;
}

void EtcdBackend::leave_local_turn(const std::string& name) {
  std::lock_guard lock(mutex_);
  auto it = turns_.find(name);
  if (it == turns_.end()) return;
  it->second.pop_front();
  if (it->second.empty()) turns_.erase(it);
  turns_cv_.notify_all();
}

std::shared_ptr<Session> EtcdBackend::session(SteadyClock::time_point deadline) {
  {
    std::lock_guard lock(mutex_);
    if (session_ && !session_->lost) return session_;
  }
  std::lock_guard grant(grant_mutex_);
  {
    std::lock_guard lock(mutex_);
    if (session_ && !session_->lost) return session_;
  }
  const auto ttl_seconds = std::max<std::int64_t>(1, (connection_.settings().ttl.count() + 999) / 1000);
  const auto sent_at = SteadyClock::now();
  const auto granted = connection_.lease_grant(ttl_seconds, deadline);
  auto fresh = std::make_shared<Session>();
  fresh->lease = granted.id();
  fresh->ttl = seconds(granted.ttl());
  fresh->valid_until = sent_at + fresh->ttl;
  {
    std::lock_guard lock(mutex_);
    session_ = fresh;
  }
  keeper_cv_.notify_all();
  return fresh;
}

void EtcdBackend::lose_session(const std::shared_ptr<Session>& session, const std::string& reason) {
  std::vector<std::shared_ptr<LossSignal>> signals;
  {
    std::lock_guard lock(mutex_);
    if (session->lost) return;
    session->lost = true;
    for (auto* hold : session->holds) signals.push_back(hold->loss());
    // Waiters stop at once (etcd-io/etcd#19597).
    for (auto* wait : session->waits) wait->cancel();
  }
  // lose() runs user callbacks, which may release holds: never with mutex_ held.
  for (auto& signal : signals) signal->lose(reason);
  // Keys that etcd might still keep (it revives leases after a restart) go now.
  try {
    connection_.lease_revoke(session->lease, SteadyClock::now() + milliseconds(1000));
  } catch (...) {
  }
}

// Every TTL/3, one keep-alive round. While rounds fail, the session's holds are suspended;
// they are held again once one gets through. The session is lost when etcd no longer knows
// the lease, or when no round got through before the lease's end as last confirmed (a paused
// process, an unreachable cluster): etcd may then have expired the keys and granted them.
void EtcdBackend::keep_alive_loop(std::stop_token stop) {
  std::unique_lock lock(mutex_);
  auto retry_at = SteadyClock::time_point::min();
  while (!stop.stop_requested()) {
    const auto current = session_;
    if (!current || current->lost) {
      keeper_cv_.wait(lock, stop, [&] { return session_ && !session_->lost; });
      continue;
    }
    const auto period = std::max(milliseconds(200), std::chrono::duration_cast<milliseconds>(current->ttl / 3));
    const auto margin = std::chrono::duration_cast<milliseconds>(current->ttl / 10);
    // A keep-alive unanswered for this long suspends the holds, and is tried again soon.
    const auto patience = std::min(period, milliseconds(1000));
    const auto renew_at = std::max(retry_at, current->valid_until - current->ttl + period);
    keeper_cv_.wait_until(lock, stop, renew_at, [&] { return session_ != current || current->lost; });
    if (stop.stop_requested() || session_ != current || current->lost) continue;
    const auto now = SteadyClock::now();
    if (now >= current->valid_until - margin) {
      lock.unlock();
      lose_session(current, "no lease keep-alive reached etcd within the TTL (the process was paused or etcd unreachable)");
      lock.lock();
      continue;
    }
    lock.unlock();
    std::optional<std::int64_t> ttl_left;
    try {
      ttl_left = connection_.keep_alive(current->lease, std::min(current->valid_until - margin, now + patience));
    } catch (const Error&) {
    }
    if (ttl_left && *ttl_left <= 0) lose_session(current, "etcd expired the session's lease");
    lock.lock();
    std::vector<std::shared_ptr<LossSignal>> signals;
    for (auto* hold : current->holds) signals.push_back(hold->loss());
    if (ttl_left && *ttl_left > 0) {
      current->valid_until = now + seconds(*ttl_left);
      retry_at = SteadyClock::time_point::min();
    } else {
      retry_at = SteadyClock::now() + milliseconds(100);  // try again soon, until the lease ends
    }
    // These run user callbacks, which may release holds: never with mutex_ held.
    lock.unlock();
    for (auto& signal : signals) {
      if (!ttl_left) signal->suspend("the lease keep-alive did not reach etcd; the lease may still be alive");
      else if (*ttl_left > 0) signal->resume();
    }
    lock.lock();
  }
}

bool EtcdBackend::wait_for_change(const std::shared_ptr<Session>& session, const pb::WatchCreateRequest& request,
                                  Deadline deadline, const std::function<bool()>& changed_already) {
  const auto started = SteadyClock::now();
  // A bounded watch: a healthy stream is renewed now and then, so no wait depends on one
  // connection forever.
  auto until = started + seconds(30);
  if (deadline) until = std::min(until, *deadline);
  WatchStream watch(connection_, request, until);
  {
    std::lock_guard lock(mutex_);
    if (session->lost) return false;
    session->waits.insert(&watch);
  }
  bool already = false;
  if (changed_already) {
    try {
      already = changed_already();
    } catch (const BackendUnavailable&) {
      // Could not look: the watch tells.
    }
  }
  pb::WatchResponse response;
  const bool changed = already || watch.next(response);
  {
    std::lock_guard lock(mutex_);
    session->waits.erase(&watch);
    if (session->lost) return false;
  }
  // A stream that ended at once (etcd restarting, a fork): do not spin.
  if (!changed && SteadyClock::now() - started < milliseconds(50) && (!deadline || *deadline > SteadyClock::now())) {
    std::this_thread::sleep_for(milliseconds(100));
  }
  return true;
}

std::unique_ptr<BackendHold> EtcdBackend::acquire(const QueueRequest& request, Deadline deadline,
                                                  std::shared_ptr<LossSignal> loss) {
  const bool try_once = deadline && *deadline <= SteadyClock::now();
  // One exclusive key per (lease, name): this client's threads take turns for it.
  const bool gated = request.kind == EntryKind::exclusive;
  if (gated && !enter_local_turn(request.name, deadline)) return nullptr;
  struct Turn {
    EtcdBackend& backend;
    const std::string& name;
    bool held;
    ~Turn() {
      if (held) backend.leave_local_turn(name);
    }
  } turn{*this, request.name, gated};

  const auto live = session(deadline ? std::max(*deadline, call_deadline()) : call_deadline());
  const auto prefix = request.name + "/";
  const auto key = prefix + lease_hex(live->lease) + (gated ? "" : "_" + std::to_string(++unique_));

  // Join: put the key unless it exists, and read the queue, in one round trip.
  pb::TxnRequest join;
  add_compare(join, key, pb::Compare::CREATE, 0);
  add_put(join.mutable_success(), key, entry_value(request.kind, request.permits, request.limit, identity_), live->lease);
  add_range(join.mutable_success(), queue_range(prefix));
  add_range(join.mutable_failure(), key_range(key));
  add_range(join.mutable_failure(), queue_range(prefix));
  const auto joined = connection_.txn(join, call_deadline(), true);
  std::int64_t revision = 0;
  if (joined.succeeded()) {
    revision = joined.header().revision();
  } else {
    // Our own key from an attempt whose answer was lost: it is our entry.
    const auto& own = joined.responses(0).response_range();
    if (own.kvs_size() == 0) throw BackendUnavailable("etcd lost the key of '" + request.name + "' while joining");
    revision = own.kvs(0).create_revision();
  }
  auto entries = entries_of(joined.responses(1).response_range());

  const auto leave = [&]() noexcept {
    try {
      delete_own_key(key, revision, SteadyClock::now() + milliseconds(2000));
    } catch (...) {
    }
  };
  try {
    for (;;) {
      // The entries up to ours; ours must still be there (etcd-io/etcd#11456).
      std::size_t mine = entries.size();
      for (std::size_t i = 0; i < entries.size(); ++i) {
        if (entries[i].create_revision == revision && entries[i].key == key) mine = i;
      }
      if (mine == entries.size()) {
        lose_session(live, "the session's lease expired while waiting");
        throw HoldLost("the queue entry of '" + request.name + "' vanished while waiting (its etcd lease expired)");
      }
      if (mine > 0) check_queue_mode(request, queue_mode(entries[0]), entries[0].limit);
      const auto verdict = evaluate_queue(views_of(entries, mine), mine, request.limit);
      if (verdict.admitted()) break;
      if (try_once || (deadline && *deadline <= SteadyClock::now())) {
        leave();
        return nullptr;
      }
      // The watch starts now, not just after our read: a watch from a revision etcd has
      // already passed joins its "unsynced" watchers, caught up only every 100 ms (that was
      // the handoff p99 under contention). What changed between our read and the watch is
      // found by reading the entries ahead of ours once more after the watch exists.
      pb::WatchCreateRequest watch;
      const auto ahead = std::vector<Entry>(entries.begin(), entries.begin() + static_cast<std::ptrdiff_t>(mine));
      const auto changed_meanwhile = [&] {
        const auto now = entries_of(connection_.range(queue_range(prefix, revision - 1), call_deadline()));
        if (now.size() != ahead.size()) return true;
        for (std::size_t i = 0; i < now.size(); ++i) {
          if (now[i].key != ahead[i].key || now[i].create_revision != ahead[i].create_revision || now[i].kind != ahead[i].kind) {
            return true;
          }
        }
        return false;
      };
      if (verdict.wait == WaitFor::leave || verdict.wait == WaitFor::exclusive_end) {
        // concurrency.Mutex's wait: the one key ahead of ours.
        watch.set_key(entries[verdict.index].key);
        if (verdict.wait == WaitFor::leave) watch.add_filters(pb::WatchCreateRequest::NOPUT);
      } else {
        // A lease waits for room: any entry leaving may make it.
        watch.set_key(prefix);
        watch.set_range_end(prefix_end(prefix));
        watch.add_filters(pb::WatchCreateRequest::NOPUT);
      }
      if (!wait_for_change(live, watch, deadline, changed_meanwhile)) {
        leave();
        throw HoldLost("the etcd session of this client ended while waiting for '" + request.name + "'");
      }
      // Look again after every wait: the own key first of all.
      for (;;) {
        try {
          const auto range = connection_.range(queue_range(prefix, revision), call_deadline());
          entries = entries_of(range);
          break;
        } catch (const BackendUnavailable&) {
          // etcd unreachable: keep trying while the session may still live; its end stops us.
          std::lock_guard lock(mutex_);
          if (live->lost) throw HoldLost("the etcd session of this client ended while waiting for '" + request.name + "'");
        }
      }
    }
  } catch (const HoldLost&) {
    throw;
  } catch (...) {
    leave();
    throw;
  }

  auto hold = std::make_unique<EtcdHold>(*this, live, request.name, key, revision, gated, loss);
  turn.held = false;  // the hold keeps the local turn until it is released
  bool lost_already = false;
  {
    std::lock_guard lock(mutex_);
    live->holds.insert(hold.get());
    lost_already = live->lost;
  }
  if (lost_already) loss->lose("the etcd session of this client ended as the hold was granted");
  return hold;
}

struct CounterValue {
  std::optional<std::int64_t> value;
  std::int64_t mod_revision = 0;  // 0 while the key does not exist
};

CounterValue counter_value(const pb::RangeResponse& range) {
  CounterValue result;
  if (range.kvs_size() == 0) return result;
  result.mod_revision = range.kvs(0).mod_revision();
  try {
    result.value = std::stoll(range.kvs(0).value());
  } catch (const std::exception&) {
    throw BackendUnavailable("the PermitCounter key '" + range.kvs(0).key() + "' does not hold a number");
  }
  return result;
}

Inspection EtcdBackend::inspect(const std::string& name) {
  const auto prefix = name + "/";
  pb::TxnRequest read;
  add_range(read.mutable_success(), queue_range(prefix));
  add_range(read.mutable_success(), key_range(kCounterPrefix + name));
  add_range(read.mutable_success(), queue_range(kCounterWaiterPrefix + name + "/"));
  const auto answer = connection_.txn(read, call_deadline(), true);
  Inspection result;
  result.name = name;
  const auto entries = entries_of(answer.responses(0).response_range());
  if (!entries.empty()) {
    result.mode = queue_mode(entries[0]);
    if (result.mode == "semaphore") result.limit = entries[0].limit;
  }
  for (std::size_t i = 0; i < entries.size(); ++i) {
    EntryInfo info;
    info.fencing_token = static_cast<std::uint64_t>(entries[i].create_revision);
    info.kind = to_string(entries[i].kind);
    info.permits = entries[i].permits;
    info.pid = entries[i].pid;
    info.host = entries[i].host;
    info.since = std::chrono::system_clock::time_point(milliseconds(entries[i].since_ms));
    info.holding = evaluate_queue(views_of(entries, i), i, entries[0].limit).admitted();
    (info.holding ? result.holders : result.waiters).push_back(info);
  }
  result.permits = counter_value(answer.responses(1).response_range()).value;
  for (const auto& kv : answer.responses(2).response_range().kvs()) {
    EntryInfo info;
    info.kind = "permits";
    info.fencing_token = static_cast<std::uint64_t>(kv.create_revision());
    std::istringstream text(kv.value());
    long long since_ms = 0;
    text >> info.permits >> info.pid >> info.host >> since_ms;
    info.since = std::chrono::system_clock::time_point(milliseconds(since_ms));
    result.waiters.push_back(info);
  }
  return result;
}

// --- PermitCounter: one key changed by Txn on its mod revision -------------------------------

bool EtcdBackend::counter_try_set(const std::string& name, std::int64_t permits) {
  const auto key = kCounterPrefix + name;
  pb::TxnRequest txn;
  add_compare(txn, key, pb::Compare::CREATE, 0);
  add_put(txn.mutable_success(), key, std::to_string(permits), 0);
  return connection_.txn(txn, call_deadline(), false).succeeded();
}

std::int64_t EtcdBackend::counter_add(const std::string& name, std::int64_t delta) {
  const auto key = kCounterPrefix + name;
  for (;;) {
    const auto current = counter_value(connection_.range(key_range(key), call_deadline()));
    std::int64_t updated = 0;
    if (__builtin_add_overflow(current.value.value_or(0), delta, &updated)) {
      throw InvalidArgument("PermitCounter '" + name + "': adding " + std::to_string(delta) + " would overflow");
    }
    pb::TxnRequest txn;
    add_compare(txn, key, pb::Compare::MOD, current.mod_revision);
    add_put(txn.mutable_success(), key, std::to_string(updated), 0);
    if (connection_.txn(txn, call_deadline(), false).succeeded()) return updated;
  }
}

std::optional<std::int64_t> EtcdBackend::counter_get(const std::string& name) {
  return counter_value(connection_.range(key_range(kCounterPrefix + name), call_deadline())).value;
}

std::int64_t EtcdBackend::counter_drain(const std::string& name) {
  const auto key = kCounterPrefix + name;
  for (;;) {
    const auto current = counter_value(connection_.range(key_range(key), call_deadline()));
    if (!current.value) return 0;
    pb::TxnRequest txn;
    add_compare(txn, key, pb::Compare::MOD, current.mod_revision);
    add_put(txn.mutable_success(), key, "0", 0);
    if (connection_.txn(txn, call_deadline(), false).succeeded()) return *current.value;
  }
}

// Waiters line up as keys under the waiter prefix (tied to the session, so a dead waiter
// leaves the line); only the first may take permits, and it watches the counter key, the
// others the waiter just ahead.
bool EtcdBackend::counter_acquire(const std::string& name, std::int64_t permits, Deadline deadline) {
  const auto key = kCounterPrefix + name;
  const auto line_prefix = kCounterWaiterPrefix + name + "/";
  std::shared_ptr<Session> live;
  std::string place;  // our waiter key, once in line
  std::int64_t place_revision = 0;
  const auto leave_line = [&]() noexcept {
    if (place.empty()) return;
    try {
      delete_own_key(place, place_revision, SteadyClock::now() + milliseconds(2000));
    } catch (...) {
    }
  };
  try {
    for (;;) {
      pb::TxnRequest read;  // the counter and the line ahead of us, at one revision
      add_range(read.mutable_success(), key_range(key));
      add_range(read.mutable_success(), queue_range(line_prefix, place_revision));
      const auto state = connection_.txn(read, call_deadline(), true);
      const auto current = counter_value(state.responses(0).response_range());
      const auto& line = state.responses(1).response_range();
      const bool in_line = !place.empty();
      if (in_line) {
        bool present = false;
        for (const auto& kv : line.kvs()) present = present || kv.key() == place;
        if (!present) throw HoldLost("the PermitCounter waiter of '" + name + "' vanished while waiting (its etcd lease expired)");
      }
      const bool first = in_line ? line.kvs(0).key() == place : line.kvs_size() == 0;
      if (first && current.value.value_or(0) >= permits) {
        pb::TxnRequest take;
        add_compare(take, key, pb::Compare::MOD, current.mod_revision);
        if (in_line) {
          add_compare(take, place, pb::Compare::CREATE, place_revision);
        } else {
          // Nobody in line: the range compare holds when no key is there.
          auto* empty = take.add_compare();
          empty->set_key(line_prefix);
          empty->set_range_end(prefix_end(line_prefix));
          empty->set_result(pb::Compare::EQUAL);
          empty->set_target(pb::Compare::VERSION);
          empty->set_version(0);
        }
        add_put(take.mutable_success(), key, std::to_string(*current.value - permits), 0);
        if (in_line) add_delete(take.mutable_success(), place);
        if (connection_.txn(take, call_deadline(), false).succeeded()) return true;
        continue;  // someone changed the counter meanwhile
      }
      if (deadline && *deadline <= SteadyClock::now()) {
        leave_line();
        return false;
      }
      if (!in_line) {
        live = session(call_deadline());
        place = line_prefix + lease_hex(live->lease) + "_" + std::to_string(++unique_);
        pb::TxnRequest join;
        add_compare(join, place, pb::Compare::CREATE, 0);
        add_put(join.mutable_success(), place, std::to_string(permits) + " " + identity_ + " " +
                    std::to_string(std::chrono::duration_cast<milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count()),
                live->lease);
        add_range(join.mutable_failure(), key_range(place));
        const auto joined = connection_.txn(join, call_deadline(), true);
        place_revision = joined.succeeded() ? joined.header().revision()
                                            : joined.responses(0).response_range().kvs(0).create_revision();
        continue;  // look again from our place
      }
      pb::WatchCreateRequest watch;
      watch.set_start_revision(state.header().revision() + 1);
      if (first) {
        watch.set_key(key);  // the counter changing
      } else {
        // The waiter just ahead leaving.
        watch.set_key(line.kvs(line.kvs_size() - 2).key());
        watch.add_filters(pb::WatchCreateRequest::NOPUT);
      }
      if (!wait_for_change(live, watch, deadline)) {
        leave_line();
        throw HoldLost("the etcd session of this client ended while waiting for PermitCounter '" + name + "'");
      }
    }
  } catch (const HoldLost&) {
    throw;
  } catch (...) {
    leave_line();
    throw;
  }
}

}  // namespace
}  // namespace turnstile::detail::etcd

extern "C" std::unique_ptr<turnstile::detail::Backend> turnstile_backend_factory_v1(
    const turnstile::detail::BackendUrl& url, const turnstile::ClientOptions& options) {
  using namespace turnstile::detail::etcd;
  return std::make_unique<EtcdBackend>(parse_settings(url, options));
}
